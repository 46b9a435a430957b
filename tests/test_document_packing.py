"""``data.packing: documents``: a packed window's loss is the sum of its documents' losses, each run alone.

Documents of different lengths are packed into one window; the model (float64) gives the summed token loss of the
window, and the same documents run one at a time (positions from 0, nothing else in the sequence) give theirs. They
must agree to fp64 rounding (1e-10 relative, tests/tolerances.py). Negative control: the same window and labels with
attention across documents differ by orders of magnitude more. (Restarting the rotary positions alone changes only
rounding: inside one document rotary attention depends on relative positions; the restart matters for what the
model sees at inference, where every document starts at 0.)
"""

from __future__ import annotations

import torch

from kuangchao_core.data.packing import document_window, pack_documents_with_starts, window
from kuangchao_core.data.tokenizer import ByteTokenizer
from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss
from tests.fixtures import tiny_llama
from tests.tolerances import FP64_REL, NEGATIVE_MIN

DOCS = ["12+30=42", "7+8=15", "hello there", "x"]


def _model() -> LlamaForCausalLM:
    cfg = tiny_llama(hidden_size=32, intermediate_size=64, max_seq_len=64)
    m = LlamaForCausalLM(cfg)
    m.init_weights(0)
    return m.double().eval()


def _summed_loss(model, batch) -> float:
    extra = {k: batch[k][None] for k in ("position_ids", "segment_ids") if k in batch}
    logits = model(batch["input_ids"][None], **extra)
    return float(causal_lm_loss(logits, batch["labels"][None], reduction="sum"))


def test_window_fields_restart_per_document():
    stream, starts = pack_documents_with_starts(DOCS, ByteTokenizer())
    assert starts.tolist() == [0, 9, 16, 28]
    w = document_window(stream, starts, 0, 29)
    assert w["segment_ids"].tolist() == [0] * 9 + [1] * 7 + [2] * 12 + [3]
    assert w["position_ids"].tolist() == list(range(9)) + list(range(7)) + list(range(12)) + [0]
    masked = [i for i, t in enumerate(w["labels"].tolist()) if t == -100]
    assert masked == [8, 15, 27]  # each separator's label would be the next document's first token
    later = document_window(stream, starts, 1, 5)  # a window starting inside the first document continues it
    assert later["position_ids"].tolist()[:4] == [5, 6, 7, 8] and later["segment_ids"].tolist()[:5] == [0] * 4 + [1]


@torch.no_grad()
def test_packed_loss_equals_the_documents_run_one_by_one():
    tok, model = ByteTokenizer(), _model()
    stream, starts = pack_documents_with_starts(DOCS, tok)
    seq = int(stream.numel()) - 1  # one window over the whole stream
    packed = _summed_loss(model, document_window(stream, starts, 0, seq))
    alone = 0.0
    ends = [*starts.tolist()[1:], int(stream.numel())]
    for lo, hi in zip(starts.tolist(), ends, strict=True):
        doc = stream[lo:hi]  # the document and its separator
        if doc.numel() < 2:
            continue
        alone += _summed_loss(model, window(doc, 0, doc.numel() - 1))
    assert abs(packed - alone) <= FP64_REL * abs(alone), (packed, alone)
    # negative control: the same labels with attention across documents
    w = document_window(stream, starts, 0, seq)
    across = _summed_loss(model, {"input_ids": w["input_ids"], "labels": w["labels"]})
    assert abs(across - alone) >= NEGATIVE_MIN * abs(alone), (across, alone)


def test_the_engine_trains_packed_documents_alike_at_tp2_pp2_and_in_one_process(tmp_path):
    from tests.engine_helpers import run_trainers, tiny_job
    from tests.mp import run_distributed
    from tests.tolerances import max_rel_diff

    def job(name, packing, sabotage=None, **parallel):
        return {
            "cfg": tiny_job(
                str(tmp_path / name),
                data={"seq_len": 32, "packing": packing},
                parallel={"micro_batch_size": 2, "gradient_accumulation_steps": 2, **parallel},
                train={"steps": 3, "dtype": "fp64"},
            ),
            "sabotage": sabotage,
        }

    one = run_distributed(run_trainers, 1, args=([job("ref", "documents"), job("concat", "concat")],))[0]
    two = run_distributed(
        run_trainers,
        2,
        args=(
            [
                job("tp2", "documents", tensor_parallel_size=2),
                job("pp2", "documents", pipeline_parallel_size=2),
                job("pp2_blind", "documents", "stages_without_documents", pipeline_parallel_size=2),
            ],
        ),
    )
    ref, concat = one[0], one[1]["losses"]
    assert max(max_rel_diff(r[0]["losses"], ref["losses"]) for r in two) <= FP64_REL
    pp2 = two[1][1]  # the last stage holds the loss and the held-out loss
    assert max_rel_diff(pp2["losses"], ref["losses"]) <= FP64_REL
    assert max_rel_diff([pp2["eval_loss"]], [ref["eval_loss"]]) <= FP64_REL
    assert max_rel_diff(concat, ref["losses"]) >= NEGATIVE_MIN  # the packing really changed what the model saw
    # negative control: pipeline stages that drop the documents' positions and segments
    assert max_rel_diff(two[1][2]["losses"], ref["losses"]) >= NEGATIVE_MIN
