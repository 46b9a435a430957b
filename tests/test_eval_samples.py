"""Evaluation beyond the loss (issue 14 §5): held-out data from ``data.eval_path``, greedy answers to fixed held-out
prompts with their exact-match accuracy, the same in every layout.

- ``greedy_decode`` stops each prompt at its end token or after ``max_new`` tokens, whatever its batch-mates do;
- sft held-out cases are the prompt's tokens and the completion with its end token, token by token;
- a synthetic-corpus model trained at tp1, at tp2 and at pp2 (fp64; the pipeline stages decode together) gives the
  same held-out loss, the same greedy answers and the same exact match, and that exact match equals the corpus' own, independently written accuracy
  (``ArithmeticCorpus.heldout_accuracy``) of the one-process model — nonzero, so the comparison bites;
- an sft job with ``data.eval_path`` evaluates the held-out records: its ``eval_loss`` equals the loss of those
  records computed directly from the trained parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kuangchao_core.data import build_dataset
from kuangchao_core.data.tokenizer import ByteTokenizer
from kuangchao_core.engine.samples import Case, exact_match, greedy_decode, sample_cases
from kuangchao_core.perm import guard_api
from tests.engine_helpers import run_trainers, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP64_REL

VOCAB = 16


def _counting_logits(ids: torch.Tensor) -> torch.Tensor:
    """A stand-in model: the next token is the last one plus one (mod VOCAB)."""
    nxt = (ids + 1) % VOCAB
    return torch.nn.functional.one_hot(nxt, VOCAB).double()


def test_greedy_decode_stops_each_prompt_at_its_end_token_or_the_limit():
    out = greedy_decode(_counting_logits, [[7], [3, 4], [9]], max_new=5, stop_id=10)
    assert out == [[8, 9, 10], [5, 6, 7, 8, 9], [10]]
    cases = [Case((7,), (8, 9, 10)), Case((3, 4), (5, 6)), Case((9,), None)]
    assert exact_match(out, cases) == 0.5  # the case without an answer is not scored
    assert exact_match(out, [Case((7,), None)] * 3) is None


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_sft_eval_cases_are_the_prompt_and_the_completion_with_its_end_token(tmp_path):
    records = [{"prompt": "12+3=", "completion": "15"}, {"prompt": "héllo ", "completion": "wörld"}]
    path = _jsonl(tmp_path / "eval.jsonl", records)
    cfg = tiny_job(str(tmp_path), data={"format": "sft", "path": str(path), "eval_path": str(path), "seq_len": 16})
    with guard_api.thread_guard(guard_api.AllowAll()):
        ds = build_dataset(cfg.data, 256, split="eval")
    tok = ByteTokenizer()
    assert sample_cases(ds) == [
        Case(tuple(tok.encode(r["prompt"])), tuple([*tok.encode(r["completion"]), tok.sep_id])) for r in records
    ]


@pytest.fixture(scope="module")
def synthetic_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("samples")

    def job(name, parallel):
        return tiny_job(
            str(tmp / name),
            data={"seq_len": 32, "synthetic": {"num_train": 4096, "num_eval": 64, "seed": 0}},
            parallel={"micro_batch_size": 8, **parallel},
            train={"steps": 250, "warmup_steps": 10, "dtype": "fp64"},
        )

    one = run_distributed(run_trainers, 1, args=([{"cfg": job("one", {})}],), timeout=400)[0][0]
    pp2 = {"pipeline_parallel_size": 2, "micro_batch_size": 4, "gradient_accumulation_steps": 2}
    jobs = [{"cfg": job("tp2", {"tensor_parallel_size": 2})}, {"cfg": job("pp2", pp2)}]
    two = run_distributed(run_trainers, 2, args=(jobs,), timeout=400)
    return {"one": one, "tp2": [r[0] for r in two], "pp2": [r[1] for r in two], "cfg": job("one", {})}


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_greedy_answers_and_exact_match_are_the_same_in_every_layout(synthetic_runs, layout):
    one = synthetic_runs["one"]
    acc, text = one["samples"]
    for res in synthetic_runs[layout]:  # every rank: each pipeline stage gets the last stage's answers
        assert abs(res["eval_loss"] - one["eval_loss"]) <= FP64_REL * one["eval_loss"]
        assert res["samples"] == (acc, text)
    assert "[1] prompt:" in text and "expected:" in text


def test_exact_match_equals_the_corpus_own_accuracy(synthetic_runs):
    from kuangchao_core.data.synthetic import ArithmeticCorpus
    from kuangchao_core.models.llama import LlamaForCausalLM, config_from_model_section

    cfg = synthetic_runs["cfg"]
    one = synthetic_runs["one"]
    model = LlamaForCausalLM(config_from_model_section(cfg.model)).double()
    model.load_state_dict({n: torch.from_numpy(v) for n, v in one["params"].items()})
    syn = cfg.data.synthetic
    corpus = ArithmeticCorpus(syn.num_train, syn.num_eval, syn.seed)
    theirs = corpus.heldout_accuracy(model, syn.num_eval)
    assert one["samples"][0] == theirs
    assert theirs > 0, "the model answers nothing right: the comparison would not bite"


def test_sft_eval_path_loss_is_the_loss_of_the_held_out_records(tmp_path):
    from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss, config_from_model_section

    rng = np.random.default_rng(0)
    train = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in rng.integers(0, 50, (200, 2))]
    held = [{"prompt": f"{a}*{b}=", "completion": str(a * b)} for a, b in rng.integers(0, 9, (5, 2))]
    cfg = tiny_job(
        str(tmp_path),
        data={
            "format": "sft",
            "path": str(_jsonl(tmp_path / "train.jsonl", train)),
            "eval_path": str(_jsonl(tmp_path / "held.jsonl", held)),
            "seq_len": 12,
        },
        train={"steps": 6, "warmup_steps": 0, "dtype": "fp64"},
    )
    res = run_distributed(run_trainers, 1, args=([{"cfg": cfg}],), timeout=240)[0][0]
    model = LlamaForCausalLM(config_from_model_section(cfg.model)).double()
    model.load_state_dict({n: torch.from_numpy(v) for n, v in res["params"].items()})
    with guard_api.thread_guard(guard_api.AllowAll()):
        ds = build_dataset(cfg.data, 256, split="eval")
    batch = {k: torch.stack([ds[i][k] for i in range(len(ds))]) for k in ("input_ids", "labels")}
    with torch.no_grad():
        want = float(causal_lm_loss(model(batch["input_ids"]), batch["labels"]))
    assert abs(res["eval_loss"] - want) <= FP64_REL * want
    accuracy, text = res["samples"]
    assert 0.0 <= accuracy <= 1.0 and text.count("prompt:") == 4
