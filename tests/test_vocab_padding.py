"""A model vocabulary padded beyond the tokenizer's (issue 25 item 7): greedy decoding can produce an id the tokenizer
does not know, and that must never end a job.

- ``ByteTokenizer.decode`` and ``HFTokenizer.decode`` show an id outside their vocabulary as ``<unk:ID>`` between the
  text of the known ids (the byte tokenizer raised on an id >= 256; ``tokenizers`` dropped one silently and raised
  on a negative one);
- a sample the tokenizer cannot render at all is shown as not rendered, with a warning, and exact match is still
  computed on the ids;
- fine-tuning a random ``transformers`` Llama whose vocabulary is 320 with the byte tokenizer (256), its output
  layer set so that greedy decoding of the held-out prompts picks ids >= 256, trains and evaluates on 2 Gloo
  processes: the evaluation before the first step and the final one render those ids as ``<unk:ID>`` (exact match
  0 on the ids), and the padding is said exactly once, by rank 0, naming both sizes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re

import pytest
import torch

from kuangchao_core.data.tokenizer import ByteTokenizer, HFTokenizer, vocab_padding_note
from kuangchao_core.engine.samples import Case, SampleEvaluator
from tests.engine_helpers import tiny_job, trainer_in_process
from tests.fixtures import hf_llama_config, tiny_llama
from tests.mp import run_distributed

MODEL_VOCAB = 320
PADDING_NOTE = "is larger than the tokenizer's vocabulary"


# --- decoding ids the tokenizer does not know ----------------------------------------------------------------------


def test_byte_tokenizer_shows_ids_outside_its_vocabulary():
    tok = ByteTokenizer()
    assert tok.decode([104, 105, 300, 10, 256, -1]) == "hi<unk:300>\n<unk:256><unk:-1>"
    assert tok.decode(list("é".encode()) + [0xFF]) == "é\ufffd"  # invalid UTF-8 is still U+FFFD
    assert tok.decode(torch.tensor([104, 319]).tolist()) == "h<unk:319>"


def test_hf_tokenizer_shows_ids_outside_its_vocabulary(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(
        ["the cat sat on the mat", "a dog and a cat"] * 20,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]),
    )
    raw.save(str(tmp_path / "tok.json"))
    tok = HFTokenizer(tmp_path / "tok.json")
    n = tok.vocab_size
    cat, sat = tok.encode("the cat"), tok.encode(" sat")
    assert tok.decode(cat + sat) == "the cat sat"
    assert tok.decode([*cat, n + 3, *sat]) == f"the cat<unk:{n + 3}> sat"  # the library alone dropped it
    assert tok.decode([-1, *cat]) == "<unk:-1>the cat"  # the library alone raised OverflowError


def test_vocab_padding_note_names_both_sizes_only_when_the_model_is_larger():
    tok = ByteTokenizer()
    assert vocab_padding_note(tok, 256) is None and vocab_padding_note(tok, None) is None
    note = vocab_padding_note(tok, MODEL_VOCAB)
    assert "model.vocab_size 320" in note and "256 tokens" in note and "256..319" in note
    assert "never produced by the data" in note and "<unk:ID>" in note


@contextlib.contextmanager
def _warnings(*names: str):
    """The warnings of the ``names`` loggers while in the block (a handler of their own: the ``kuangchao`` tree
    does not propagate to the root once a worker's logging is set up)."""
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append
    loggers = [logging.getLogger(n) for n in names]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield seen
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


class _FailingTokenizer(ByteTokenizer):
    """The byte tokenizer as it was: ``bytes(ids)``, which raises for an id >= 256."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_sample_that_cannot_be_rendered_is_said_and_scored_on_ids():
    vocab = 300

    def always_290_then_stop(ids):  # a stand-in model: 290, then the separator
        nxt = torch.where(ids[:, -1] == 290, 10, 290)
        return torch.nn.functional.one_hot(nxt, vocab).float()[:, None, :].expand(-1, ids.shape[1], -1)

    cases = [Case((49, 43, 50, 61), (290, 10)), Case((50, 43, 50, 61), (52, 10))]
    evaluator = SampleEvaluator(always_290_then_stop, torch.nn.Linear(1, 1), cases, _FailingTokenizer(), "cpu")
    with _warnings("kuangchao.engine.samples") as seen:
        accuracy, text = evaluator()
    assert accuracy == 0.5  # the first case's answer holds id 290: right on the ids, whatever the text
    assert text.count("<could not be rendered: ids [290, 10] (ValueError") == 3  # both outputs, the first answer
    assert "prompt:   '1+2='" in text and "expected: '4\\n' (wrong)" in text
    warned = [r.getMessage() for r in seen]
    assert len(warned) == 3 and all("cannot render ids [290, 10]" in w for w in warned)


# --- fine-tuning a transformers Llama with a padded vocabulary -----------------------------------------------------


def _save_padded_llama(path):
    """A tiny random ``transformers.LlamaForCausalLM`` with vocabulary 320 (hidden 64, 2 layers), its output rows
    for ids >= 256 scaled up so greedy decoding picks those ids, saved with ``save_pretrained``."""
    import transformers

    torch.manual_seed(5)
    cfg = hf_llama_config(tiny_llama(vocab_size=MODEL_VOCAB), rms_norm_eps=1e-6)  # transformers' default eps
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight[256:] *= 20.0  # logits ~6-9 above every byte's, far beyond what 3 steps move
        probe = model(input_ids=torch.tensor([list(b"12+34=")])).logits[0].argmax(-1)
    assert bool((probe >= 256).all()), "the probe must pick padded ids, or the test would not bite"
    model.save_pretrained(path, safe_serialization=True)


class _Recorder:
    """A metric sink keeping what rank 0 logs (the step metrics and the samples text artifacts)."""

    def __init__(self):
        self.steps: list[tuple[int, dict]] = []
        self.texts: list[tuple[str, str]] = []

    def log_step(self, step, metrics):
        self.steps.append((step, dict(metrics)))

    def log_text(self, text, name):
        self.texts.append((name, text))


def _finetune(rank: int, world_size: int, cfg):
    """Train ``cfg`` in this process (a rank of a Gloo group) with the data and samples loggers recorded."""
    with _warnings("kuangchao.data", "kuangchao.engine.samples") as seen:
        trainer = trainer_in_process(cfg, rank, world_size)
        sink = _Recorder()
        state = trainer.run(resume="never", metric_sink=sink)
        final = trainer.samples()  # collective
    return {
        "warnings": [(r.name, r.getMessage()) for r in seen],
        "losses": list(state.losses),
        "steps": sink.steps,
        "texts": sink.texts,
        "final": final,
        "lm_head": tuple(dict(trainer.model.named_parameters())["lm_head.weight"].shape),
    }


@pytest.mark.timeout(300)
def test_finetune_of_a_model_with_a_padded_vocabulary_trains_and_evaluates(tmp_path):
    pytest.importorskip("transformers")
    hf_dir = tmp_path / "hf"
    _save_padded_llama(hf_dir)
    cfg = tiny_job(
        str(tmp_path),
        model={"preset": None, "num_layers": None, "checkpoint": str(hf_dir)},
        data={"seq_len": 16, "synthetic": {"num_train": 256, "num_eval": 8, "seed": 3}},
        parallel={"data_parallel_size": 2, "micro_batch_size": 2},
        optimizer={"lr": 1e-3},
        train={"steps": 3, "warmup_steps": 0, "eval_interval": 3},
    )
    ranks = run_distributed(_finetune, 2, args=(cfg,), timeout=240)

    # said once: rank 0 names both sizes; nothing else is warned (no sample failed to render)
    assert [len(r["warnings"]) for r in ranks] == [1, 0], [r["warnings"] for r in ranks]
    name, note = ranks[0]["warnings"][0]
    assert name == "kuangchao.data" and PADDING_NOTE in note and "320" in note and "256 tokens" in note

    for r in ranks:
        assert r["lm_head"] == (MODEL_VOCAB, 64)
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
    assert ranks[0]["final"] == ranks[1]["final"]

    # rank 0's evaluations: before the first step (a fine-tune's starting point) and at step 3
    steps = dict(ranks[0]["steps"])
    assert sorted(k for k, m in steps.items() if "eval_loss" in m) == [0, 3]
    for step in (0, 3):
        assert math.isfinite(steps[step]["eval_loss"]) and steps[step]["eval_exact_match"] == 0.0
    texts = dict(ranks[0]["texts"])
    assert sorted(texts) == ["samples/step_00000000.txt", "samples/step_00000003.txt"]
    accuracy, final_text = ranks[0]["final"]
    assert accuracy == 0.0
    for text in (*texts.values(), final_text):
        outputs = re.findall(r"output: +'(.*)'", text)
        assert len(outputs) == 4 and "could not be rendered" not in text
        padded = [int(i) for o in outputs for i in re.findall(r"<unk:(\d+)>", o)]
        assert padded and all(256 <= i < MODEL_VOCAB for i in padded), outputs
