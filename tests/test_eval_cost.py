"""Evaluation that costs what it measures (issue 39 item 1), in one process.

- The held-out loss covers the whole held-out split by default: it equals the token-weighted mean over every window
  computed here directly (fp64); the old cap (the first 8 micro-batches) gives another number (control), and
  ``train.eval_tokens`` covers exactly its first windows.
- Greedy samples decoded with the key/value cache equal the uncached decode token for token; a cache fed the wrong
  positions (control) does not.
- Samples are off by default on plain text (no exact match to score) and on where the data has answers; the final
  samples run where asked or where a registered champion metric needs them; the new fields validate with their
  paths; a config whose samples cannot fit in ``model.max_seq_len`` is refused by validation (issue 39 item 4).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kuangchao_core.config import config_from_dict
from kuangchao_core.config.settings import eval_settings
from kuangchao_core.data import build_dataset
from kuangchao_core.engine.evaluation import EVAL_MICRO_BATCHES, HeldOutLoss, eval_windows
from kuangchao_core.engine.samples import greedy_decode
from kuangchao_core.errors import ConfigError
from kuangchao_core.models.kv_cache import KVCacheDecoder, can_cache
from kuangchao_core.models.llama import IGNORE_INDEX, LlamaForCausalLM, causal_lm_loss
from kuangchao_core.perm import guard_api
from tests.fixtures import tiny_llama
from tests.tolerances import FP64_REL

MICRO = 2
SEQ = 16


def _text_job(tmp_path, **train):
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n\n".join(f"held-out line {i}: some words to predict, {i * 7 % 13}" for i in range(60)))
    return config_from_dict(
        {
            "task": {"name": "t"},
            "data": {"path": str(held_out), "eval_path": str(held_out), "format": "txt", "seq_len": SEQ},
            "train": train,
        }
    )


def _one_process_mesh():
    return SimpleNamespace(dp=1, dp_rank=0, cp=1, pp_group=None, dp_group=None, dp_cp_group=None)


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    cfg = _text_job(tmp_path_factory.mktemp("eval"))
    with guard_api.thread_guard(guard_api.AllowAll()):
        ds = build_dataset(cfg.data, 256, split="eval")
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama(hidden_size=32, intermediate_size=64, max_seq_len=SEQ)).double()
    return ds, model


def _direct_mean(model, ds, windows: int) -> float:
    """Token-weighted mean loss of the first ``windows`` windows, all in one forward."""
    ids = torch.stack([ds[i]["input_ids"] for i in range(windows)])
    labels = torch.stack([ds[i]["labels"] for i in range(windows)])
    with torch.no_grad():
        total = causal_lm_loss(model(ids), labels, reduction="sum")
    return float(total / (labels != IGNORE_INDEX).sum())


def test_the_held_out_loss_covers_every_window_by_default(held_out):
    ds, model = held_out
    assert len(ds) > EVAL_MICRO_BATCHES * MICRO, "the split must be longer than the old cap for the control to bite"
    full = HeldOutLoss(model, causal_lm_loss, ds, _one_process_mesh(), MICRO, "cpu")
    got, want = full(), _direct_mean(model, ds, len(ds))
    assert full.windows == len(ds) and full.tokens == sum(int((ds[i]["labels"] != -100).sum()) for i in range(len(ds)))
    assert abs(got - want) <= FP64_REL * want, (got, want)
    # control: the old evaluation (the first 8 micro-batches) is another number, beyond the tolerance
    capped = HeldOutLoss(model, causal_lm_loss, ds, _one_process_mesh(), MICRO, "cpu", EVAL_MICRO_BATCHES * MICRO)()
    assert abs(capped - want) > 100 * FP64_REL * want, (capped, want)


def test_eval_tokens_covers_its_first_windows(held_out):
    ds, model = held_out
    windows = eval_windows(5 * SEQ - 3, SEQ)  # a budget of 4.8 windows: 5 whole ones
    assert windows == 5 and eval_windows(None, SEQ) is None and eval_windows(1, SEQ) == 1
    part = HeldOutLoss(model, causal_lm_loss, ds, _one_process_mesh(), MICRO, "cpu", windows)
    got, want = part(), _direct_mean(model, ds, 5)
    assert part.windows == 5 and abs(got - want) <= FP64_REL * want
    assert abs(_direct_mean(model, ds, 6) - want) > 100 * FP64_REL * want  # control: one window more differs


class _WrongPositions(KVCacheDecoder):
    """Control: every new token rotated as if at position 0 (the cache forgets where it is)."""

    def step(self, tokens):
        self.length = 0
        return super().step(tokens)


def test_the_kv_cache_decodes_what_the_whole_sequence_decodes():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama(hidden_size=32, intermediate_size=64, max_seq_len=64)).double().eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 4, 4, 9)]
    stop = 10**6  # never: every prompt runs its 40 tokens
    with torch.no_grad():
        plain = greedy_decode(model, prompts, 40, stop)
        cached = greedy_decode(None, prompts, 40, stop, decoder=KVCacheDecoder(model))
        wrong = greedy_decode(None, prompts, 40, stop, decoder=_WrongPositions(model))
    assert cached == plain and all(len(o) == 40 for o in plain)
    assert wrong != plain, "the comparison must catch a cache that loses its positions"
    assert can_cache(model, pipelined=False, zero_stage=0) and not can_cache(model, pipelined=True, zero_stage=0)
    assert not can_cache(model, pipelined=False, zero_stage=3)


def test_the_kv_cache_stops_at_the_models_context():
    model = LlamaForCausalLM(tiny_llama(hidden_size=32, intermediate_size=64, max_seq_len=8)).double().eval()
    with torch.no_grad(), pytest.raises(ValueError, match="exceeds model.max_seq_len 8"):
        greedy_decode(None, [[1, 2, 3]], 7, 10**6, decoder=KVCacheDecoder(model))
        # 3 prompt + 6 fed back = 9 positions


def test_samples_are_off_by_default_on_text_and_on_where_there_are_answers(tmp_path):
    text = eval_settings(_text_job(tmp_path))
    assert text.sample_count == 0 and not text.samples_at_end and text.eval_tokens is None
    synthetic = eval_settings(config_from_dict({"task": {"name": "t"}, "train": {"eval_interval": 10}}))
    assert synthetic.sample_count == 256 and synthetic.samples_at_end and synthetic.sample_every == 10
    sft = config_from_dict({"task": {"name": "t"}, "data": {"path": "x.jsonl", "format": "sft"}})
    assert eval_settings(sft).sample_count == 256
    asked = eval_settings(_text_job(tmp_path, samples={"count": 4, "every": 30, "max_new_tokens": 8}))
    assert (asked.sample_count, asked.sample_every, asked.sample_max_new, asked.samples_at_end) == (4, 30, 8, False)
    assert eval_settings(_text_job(tmp_path, samples={"count": 4, "at_end": True})).samples_at_end


def test_a_champion_metric_that_needs_the_final_samples_turns_them_on():
    base = {"task": {"name": "t"}, "train": {"samples": {"at_end": False}}}
    assert not eval_settings(config_from_dict(base)).samples_at_end
    registered = {**base, "tracking": {"register_model": "m"}}
    assert eval_settings(config_from_dict(registered)).samples_at_end
    by_eval = {**base, "tracking": {"register_model": "m", "champion_metric": "eval_exact_match"}}
    assert not eval_settings(config_from_dict(by_eval)).samples_at_end


@pytest.mark.parametrize(
    ("train", "path"),
    [
        ({"samples": {"count": -1}}, "train.samples.count"),
        ({"samples": {"every": 0}}, "train.samples.every"),
        ({"samples": {"max_new_tokens": 0}}, "train.samples.max_new_tokens"),
        ({"samples": {"cadence": 5}}, "train.samples.cadence"),
        ({"eval_tokens": 0}, "train.eval_tokens"),
    ],
)
def test_bad_evaluation_settings_are_refused_with_their_path(train, path):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"task": {"name": "t"}, "train": train})
    assert [p for p, _ in info.value.errors] == [path], info.value.errors


def test_samples_longer_than_the_models_context_are_refused_by_validation(tmp_path):
    # the case: max_seq_len equal to seq_len passes (no samples on text by default) ...
    data = {"data": {"path": "c.txt", "eval_path": "h.txt", "format": "txt", "seq_len": 64}}
    ok = config_from_dict({"task": {"name": "t"}, **data, "model": {"max_seq_len": 64}})
    assert eval_settings(ok).sample_count == 0
    # ... and asking for text samples that cannot fit is refused, naming the field and the length needed
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {"task": {"name": "t"}, **data, "model": {"max_seq_len": 64}, "train": {"samples": {"count": 4}}}
        )
    [(path, message)] = info.value.errors
    assert path == "model.max_seq_len" and "at least 71" in message, message  # 24 + 48 - 1
    config_from_dict({"task": {"name": "t"}, **data, "model": {"max_seq_len": 71}, "train": {"samples": {"count": 4}}})
    short = {"count": 4, "max_new_tokens": 41}
    config_from_dict({"task": {"name": "t"}, **data, "model": {"max_seq_len": 64}, "train": {"samples": short}})
    # data with answers: a max_new_tokens past the context cannot fit whatever the prompts
    with pytest.raises(ConfigError, match="at least 200"):
        config_from_dict({"task": {"name": "t"}, "train": {"samples": {"max_new_tokens": 200}}})
