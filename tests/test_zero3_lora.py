"""ZeRO-3 with LoRA (issue 29 item 2): the frozen base sharded over DP, only the adapters trained, equal to one process.

The tiny model (2 layers, base initialised from the seed) fine-tuned with rank-4 adapters on four projections, in
float64, 4 steps of 4 sequences (2 micro-batches of 2 in one process, 1 × 2 per replica at dp2):

- dp2 with ``zero_stage: 3`` (:class:`~kuangchao_core.parallel.zero3_lora.LoraZero3Optimizer`), with and without
  full activation checkpointing (the recomputation gathers the unit and binds the base again), equals one process
  within ``FP64_REL`` (losses and the adapters after training; tests/tolerances.py derives it), the base is the
  seed's bit for bit, and each rank really holds half of the base (the model's own base parameters are empty);
- negative control: the first layer's adapter gradients kept per rank instead of reduce-scattered (engine_helpers
  SABOTAGE ``unreduced_zero3_unit``) fails the same comparison by ≥ ``NEGATIVE_MIN``;
- a checkpoint of step 2 holds what a ZeRO-2 LoRA run's holds (the adapters and their AdamW moments, no base) and
  resumes at ZeRO-3 dp2 bitwise equal to the uninterrupted run, and at ZeRO-2 dp2 and in one process within
  ``FP64_REL`` of it.
"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors import safe_open

from kuangchao_core.ckpt.layout import shard_name
from kuangchao_core.ckpt.lineage import new_lineage_id
from tests.engine_helpers import gather_full, run_trainers, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN, rel_norm, worst_rel

STEPS = 4
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
ZERO3 = {"data_parallel_size": 2, "zero_stage": 3, "micro_batch_size": 1}


def _job(root, parallel: dict, interval: int = 100, recompute: str = "none"):
    return tiny_job(
        str(root),
        task={"name": "z3lora", "seed": 3},
        model={"preset": "tiny", "num_layers": 2, "lora": {"rank": 4, "alpha": 8, "targets": TARGETS}},
        data={"seq_len": 16},
        parallel={"micro_batch_size": 2, "gradient_accumulation_steps": 2, **parallel},
        train={"steps": STEPS, "warmup_steps": 0, "dtype": "fp64", "activation_checkpointing": recompute},
        optimizer={"lr": 1e-2},
        checkpoint={"interval": interval},
    )


def _base_held(rank: int, world_size: int, cfg) -> dict:
    """Elements of the frozen base this rank's engine holds: in the model's parameters and in ZeRO-3's shards."""
    from tests.engine_helpers import trainer_in_process

    trainer = trainer_in_process(cfg, rank, world_size)
    in_model = sum(p.numel() for p in trainer.model.parameters() if not p.requires_grad)
    opt = trainer.sync.optimizer
    return {"in_model": in_model, "shard": opt.base.flat.numel(), "base_numel": opt.base_numel}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("z3lora")
    lineage = new_lineage_id()
    step2 = tmp / "zero3" / "ckpt" / "z3lora" / lineage / "step_00000002"
    out = {"step2": step2}
    out["ref"] = run_distributed(run_trainers, 1, args=([{"cfg": _job(tmp / "one", {})}],))[0][0]
    zero2 = {**ZERO3, "zero_stage": 2}
    jobs = [
        {"cfg": _job(tmp / "zero3", ZERO3, interval=2), "lineage": lineage},
        {"cfg": _job(tmp / "control", ZERO3), "sabotage": "unreduced_zero3_unit"},
        {"cfg": _job(tmp / "resumed3", ZERO3), "resume": str(step2)},
        {"cfg": _job(tmp / "resumed2", zero2), "resume": str(step2)},
        {"cfg": _job(tmp / "recomputed", ZERO3, recompute="full")},
    ]
    per_rank = run_distributed(run_trainers, 2, args=(jobs,), timeout=400)
    for j, label in enumerate(("zero3", "control", "resumed3", "resumed2", "recomputed")):
        out[label] = [per_rank[r][j] for r in range(2)]
    out["resumed1"] = run_distributed(run_trainers, 1, args=([{"cfg": _job(tmp / "r1", {}), "resume": str(step2)}],))
    out["resumed1"] = [out["resumed1"][0][0]]
    out["held"] = run_distributed(_base_held, 2, args=(_job(tmp / "held", ZERO3),))
    return out


def _adapters(params: dict) -> dict:
    return {n: v for n, v in params.items() if ".lora_" in n}


@pytest.mark.parametrize("label", ["zero3", "recomputed"])
def test_lora_dp2_zero3_trains_like_one_process_in_fp64(runs, label):
    ref, got = runs["ref"], runs[label]
    assert rel_norm(got[0]["losses"], ref["losses"]) <= FP64_REL, (got[0]["losses"], ref["losses"])
    want = _adapters(ref["params"])
    assert len(want) == 2 * len(TARGETS) * 2
    name, worst = worst_rel(_adapters(gather_full(got)), want)
    assert worst <= FP64_REL, f"{name} differs by {worst:.2e}"
    assert rel_norm(want["model.layers.0.self_attn.q_proj.lora_B.weight"], np.zeros(1)) > 0  # B left zero: trained
    full = gather_full(got)
    for n, v in ref["params"].items():
        if ".lora_" not in n:  # the base stays the seed's, bit for bit
            np.testing.assert_array_equal(full[n], v, err_msg=n)


def test_negative_control_unreduced_adapter_gradients_fail_the_comparison(runs):
    got = _adapters(gather_full(runs["control"], check_replicas=False))
    _, worst = worst_rel(got, _adapters(runs["ref"]["params"]))
    assert worst >= NEGATIVE_MIN, worst


def test_each_rank_holds_half_of_the_frozen_base(runs):
    adapters = sum(v.size for v in _adapters(runs["ref"]["params"]).values())
    for held, res in zip(runs["held"], runs["zero3"], strict=True):
        assert held["in_model"] == 0  # the model's base parameters are emptied: the shards are all there is
        n = held["base_numel"]
        assert n == sum(v.size for k, v in runs["ref"]["params"].items() if ".lora_" not in k)
        assert n / 2 <= held["shard"] <= n / 2 + 5, held  # half, plus at most one padding element in each of 5 units
        mem = res["memory"]  # the optimizer's own report: fp64 base and adapters, 1/2 each, beside its formula
        assert mem["numel"] == adapters and mem["base_numel"] == n
        assert mem["formula"]["params"] == 8 * (adapters + n) / 2
        assert 0 <= mem["measured"]["params"] - mem["formula"]["params"] <= 8 * 2 * 5


def test_checkpoint_holds_the_adapters_and_their_optimizer_state_only(runs):
    keys: set[str] = set()
    for r in range(2):
        path = runs["step2"] / shard_name(r)
        if path.is_file():
            with safe_open(str(path), framework="pt") as shard:
                keys |= set(shard.keys())
    adapters = set(_adapters(runs["ref"]["params"]))
    assert {k.removeprefix("param.") for k in keys if k.startswith("param.")} == adapters
    assert {k.removeprefix("optim.").rsplit(".", 1)[0] for k in keys if k.startswith("optim.")} == adapters


def test_zero3_lora_resumes_bitwise(runs):
    resumed, whole = runs["resumed3"], runs["zero3"]
    assert resumed[0]["steps_run"] == STEPS - 2
    assert resumed[0]["losses"] == whole[0]["losses"]
    got, want = _adapters(gather_full(resumed)), _adapters(gather_full(whole))
    for n, v in want.items():
        np.testing.assert_array_equal(got[n], v, err_msg=n)


@pytest.mark.parametrize("target", ["resumed2", "resumed1"])
def test_zero3_lora_checkpoint_resumes_at_zero2_and_in_one_process(runs, target):
    resumed, ref = runs[target], runs["ref"]
    assert resumed[0]["steps_run"] == STEPS - 2
    assert rel_norm(resumed[0]["losses"], ref["losses"]) <= FP64_REL
    _, worst = worst_rel(_adapters(gather_full(resumed)), _adapters(ref["params"]))
    assert worst <= FP64_REL
