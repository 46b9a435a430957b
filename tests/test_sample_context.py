"""Fail once, say why (issue 39, item 4): an evaluation whose greedy samples cannot fit in ``model.max_seq_len`` is
refused by the config's validation where the config tells (text prompts), else when the job sets up, naming the
field and the length it needs, and never retried.

Before, a text job with ``model.max_seq_len`` equal to ``data.seq_len`` (24 prompt + 48 new tokens, 71 of them fed back, > 64)
trained to its first evaluation, crashed there, and restarted into the same crash twice. Now text has no samples
unless asked (item 1), so that job trains; asking for samples that cannot fit is refused before any attempt. The
control shows the crash the refusal prevents: the same decode on the model itself fails past its context.
"""

from __future__ import annotations

import glob

import pytest

from kuangchao_core.engine.samples import TEXT_NEW_TOKENS, TEXT_PROMPT_TOKENS, Case, fitting_cases, greedy_decode
from kuangchao_core.errors import ConfigError
from tests.conftest_prefect import STEPS, run_flow, tiny_overrides

TEXT = [Case(tuple(range(TEXT_PROMPT_TOKENS)), None)] * 3
NEED = TEXT_PROMPT_TOKENS + TEXT_NEW_TOKENS - 1  # positions the model sees: the last new token is never fed


def test_text_samples_that_cannot_fit_are_refused_naming_the_field():
    with pytest.raises(ConfigError) as info:
        fitting_cases(TEXT, NEED - 1)
    [(path, message)] = info.value.errors
    assert path == "model.max_seq_len" and f"at least {NEED}" in message, message
    assert fitting_cases(TEXT, NEED) == TEXT and fitting_cases(TEXT, None) == TEXT


def test_answers_that_do_not_fit_are_left_out_and_the_others_kept():
    short, long = Case((1, 2, 3), (4, 5)), Case(tuple(range(30)), (7, 8))
    assert fitting_cases([short, long, short], 16) == [short, short]
    with pytest.raises(ConfigError, match="at least 31"):
        fitting_cases([long], 16)


def test_control_the_decode_fails_past_the_models_context():
    from kuangchao_core.models.llama import LlamaForCausalLM
    from tests.fixtures import tiny_llama

    model = LlamaForCausalLM(tiny_llama(hidden_size=32, intermediate_size=64, max_seq_len=NEED - 1))
    with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
        greedy_decode(model, [TEXT[0].prompt], TEXT_NEW_TOKENS, stop_id=10**6)
    model = LlamaForCausalLM(tiny_llama(hidden_size=32, intermediate_size=64, max_seq_len=NEED))
    assert len(greedy_decode(model, [TEXT[0].prompt], TEXT_NEW_TOKENS, stop_id=10**6)[0]) == TEXT_NEW_TOKENS


def _text_overrides(tmp_path, session_store, **extra):
    text, held_out = tmp_path / "corpus.txt", tmp_path / "held_out.txt"
    text.write_text("\n\n".join(f"line {i} of some plain text to train on, long enough" for i in range(400)))
    held_out.write_text("\n\n".join(f"held-out line {i} of the same kind of text" for i in range(40)))
    fields = {
        "data.path": str(text),
        "data.eval_path": str(held_out),
        "data.format": "txt",
        "data.seq_len": 32,
        "model.max_seq_len": 32,
        "train.eval_interval": 2,
        **extra,
    }
    return tiny_overrides(tmp_path, session_store, **fields)


def test_text_samples_that_cannot_fit_are_refused_before_any_attempt(prefect_api, session_store, tmp_path):
    overrides = _text_overrides(tmp_path, session_store, **{"train.samples.count": 4})
    with pytest.raises(ConfigError) as info:
        run_flow(tmp_path, overrides)
    assert "model.max_seq_len" in str(info.value) and f"at least {NEED}" in str(info.value), info.value
    assert not glob.glob(str(tmp_path / "runs" / "*" / "*" / "attempt_*")), "refused before any worker started"


def test_a_text_job_with_max_seq_len_equal_to_seq_len_trains_without_samples(prefect_api, session_store, tmp_path):
    """The issue's job: it used to crash at its first evaluation; samples are now off on text by default, so it
    trains, evaluates its whole held-out split every 2 steps with each evaluation's time, and decodes nothing."""
    from mlflow.tracking import MlflowClient

    summary = run_flow(tmp_path, _text_overrides(tmp_path, session_store))
    assert summary["attempts"] == 1 and summary["heldout_accuracy"] is None
    # the whole loop (evaluations and checkpoints included) is slower than its steps alone
    assert 0 < summary["tokens_per_s_loop"] < summary["tokens_per_s_mean"], summary
    client = MlflowClient(f"sqlite:///{session_store / 'mlflow.db'}")
    history = client.get_metric_history(summary["mlflow_run_id"], "eval_time_s")
    assert sorted(m.step for m in history) == list(range(2, STEPS + 1, 2)) and all(m.value > 0 for m in history)
    metrics = client.get_run(summary["mlflow_run_id"]).data.metrics
    assert "eval_loss" in metrics and "eval_exact_match" not in metrics and "tokens_per_s_loop" in metrics
    artifacts = [a.path for a in client.list_artifacts(summary["mlflow_run_id"], "samples")]
    assert artifacts == [], "no greedy samples on text unless asked"
