"""Activation checkpointing (``train.activation_checkpointing``): the same gradients, less activation memory.

Recomputing a layer's forward in the backward runs the same CPU kernels on the same inputs (with the RNG state
restored for dropout), so gradients are bitwise equal to keeping the activations; the negative control recomputes
without restoring the RNG state and must differ. Activation memory is what the C heap holds after the forward
(where CPU tensors live) minus what it held before, measured after a warm-up step (first calls allocate caches).
"""

from __future__ import annotations

import pytest
import torch

from kuangchao_core.hal.heap import heap_in_use_bytes
from kuangchao_core.models import recompute
from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss
from tests.engine_helpers import run_trainers, tiny_job
from tests.fixtures import tiny_llama
from tests.mp import run_distributed

CFG = dict(intermediate_size=172, num_layers=4)  # the tiny model, deeper


def _step(mode: str, dropout: float = 0.0, seq: int = 64, batch: int = 4) -> tuple[dict, int]:
    """Gradients of one forward/backward of a fresh model, and the heap bytes the forward left held."""
    cfg = tiny_llama(**CFG, max_seq_len=256, dropout=dropout)
    model = LlamaForCausalLM(cfg)
    model.init_weights(3)
    model.activation_checkpointing = mode
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(11)  # dropout masks
    before = heap_in_use_bytes()
    loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    held = (heap_in_use_bytes() - before) if before is not None else -1
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, held


def _differing(a: dict, b: dict) -> list[str]:
    return [n for n in a if not torch.equal(a[n], b[n])]


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradients_are_bitwise_those_without_checkpointing(mode, dropout):
    ref, _ = _step("none", dropout)
    got, _ = _step(mode, dropout)
    assert not _differing(ref, got)


def test_negative_control_a_recomputation_without_the_rng_state_changes_the_gradients(monkeypatch):
    real = recompute.checkpoint

    def forgetful(*args, **kwargs):
        return real(*args, **{**kwargs, "preserve_rng_state": False})

    ref, _ = _step("none", 0.1)
    monkeypatch.setattr(recompute, "checkpoint", forgetful)
    got, _ = _step("full", 0.1)
    assert len(_differing(ref, got)) >= CFG["num_layers"]  # every layer's weights saw other dropout masks


def test_no_recomputation_without_autograd():
    calls = []
    real = recompute.checkpoint
    model = LlamaForCausalLM(tiny_llama(**CFG, max_seq_len=64))
    model.activation_checkpointing = "full"
    recompute.checkpoint = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with torch.no_grad():
            model(torch.zeros(1, 8, dtype=torch.long))
        assert not calls
        model(torch.zeros(1, 8, dtype=torch.long))
        assert len(calls) == CFG["num_layers"]
    finally:
        recompute.checkpoint = real


@pytest.mark.skipif(heap_in_use_bytes() is None, reason="needs glibc's mallinfo2 to measure CPU tensor memory")
def test_activation_memory_drops_full_below_half_selective_below_three_quarters():
    """The issue's goals (benchmark `precision_memory.py` reports the same figures): full ≤ 0.5×, selective ≤ 0.75×
    of the activations kept without checkpointing; full keeps less than selective."""
    modes = ("none", "full", "selective")
    for mode in modes:  # warm-up: the first step of each mode fills allocator and kernel caches
        _step(mode, seq=128, batch=8)
    held = {mode: _step(mode, seq=128, batch=8)[1] for mode in modes}
    print("activation bytes held after the forward:", held)
    assert held["none"] > 8 * 2**20  # the measurement sees the activations at all (4 layers, 8x128 tokens)
    assert held["full"] <= 0.5 * held["none"], held
    assert held["selective"] <= 0.75 * held["none"], held
    assert held["full"] < held["selective"], held


# ------------------------------------------------------------------- through the engine: TP and PP, 2 Gloo ranks

ENGINE_JOBS = {
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
}


def test_the_engine_trains_bitwise_alike_with_and_without_checkpointing_at_tp2_and_pp2(tmp_path):
    jobs, names = [], []
    for layout, parallel in ENGINE_JOBS.items():
        for mode in ("none", "full", "selective"):
            names.append((layout, mode))
            cfg = tiny_job(
                str(tmp_path / f"{layout}-{mode}"),
                task={"name": f"ac-{layout}-{mode}", "seed": 7},
                parallel=parallel,
                train={"steps": 3, "activation_checkpointing": mode},
            )
            jobs.append({"cfg": cfg})
    per_rank = run_distributed(run_trainers, 2, args=(jobs,), timeout=300)
    result = {name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(names)}
    for layout in ENGINE_JOBS:
        ref = result[(layout, "none")]
        for mode in ("full", "selective"):
            got = result[(layout, mode)]
            for r in range(2):
                assert got[r]["losses"] == ref[r]["losses"], (layout, mode, r)
                grads = got[r]["first_grads"]
                assert grads.keys() == ref[r]["first_grads"].keys() and grads
                for name, g in grads.items():
                    assert (g == ref[r]["first_grads"][name]).all(), (layout, mode, r, name)
