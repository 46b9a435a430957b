"""ZeRO-3 with pipeline parallelism (issue 29 item 2): each stage's units sharded over its DP group, equal to one process.

Four Gloo processes, dp2 × pp2, the tiny model (4 layers) in float64, 3 steps of 8 sequences (4 micro-batches of 1
per replica; one process: 4 of 2). ``zero_stage: 3`` with the 1F1B, interleaved 1F1B (2 chunks per stage) and
all-forward-all-backward schedules, and with LoRA (the frozen base sharded too), equals one process within
``FP64_REL`` (losses and every parameter; tests/tolerances.py). Negative control: a stage's first unit keeps its
own gradient chunk instead of the reduce-scattered one (SABOTAGE ``unreduced_zero3_unit``) and misses by
≥ ``NEGATIVE_MIN``. Memory, from the optimizers' tensors: each rank's parameter bytes at ZeRO-3 are half of
ZeRO-2's under the same pipeline (plus the padding of its units), and ``kc plan`` is within 5 % of both. bf16
parameters (fp32 masters) at dp2 × pp2 with ZeRO-3 track the fp32 run within the bf16 bound.
"""

from __future__ import annotations

import pytest

from kuangchao_core.engine.plan import rank_memory
from tests.engine_helpers import gather_full, run_trainers, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN, rel_norm, worst_rel

LORA = {"rank": 4, "targets": ["q_proj", "down_proj"]}
PP = {"data_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 3}
LAYOUTS = {
    "1f1b": PP,
    "interleaved": {**PP, "pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_size": 2},
    "afab": {**PP, "pipeline_schedule": "afab"},
}


def _job(root, parallel: dict, lora: dict | None = None, dtype: str = "fp64", param_dtype: str = "fp32"):
    return tiny_job(
        str(root),
        task={"name": "z3pp", "seed": 3},
        model={"preset": "tiny", "num_layers": 4, "lora": lora},
        data={"seq_len": 16},
        parallel={"micro_batch_size": 1, "gradient_accumulation_steps": 4, **parallel},
        train={"steps": 3, "warmup_steps": 0, "dtype": dtype, "param_dtype": param_dtype},
        optimizer={"lr": 1e-2},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("z3pp")
    one = {"micro_batch_size": 2}
    refs = [{"cfg": _job(tmp / "one", one)}, {"cfg": _job(tmp / "one_lora", one, LORA)}]
    out = dict(zip(("ref", "ref_lora"), run_distributed(run_trainers, 1, args=(refs,))[0], strict=True))
    jobs = {name: {"cfg": _job(tmp / name, par)} for name, par in LAYOUTS.items()}
    jobs["lora"] = {"cfg": _job(tmp / "lora", PP, LORA)}
    jobs["control"] = {"cfg": _job(tmp / "control", PP), "sabotage": "unreduced_zero3_unit"}
    jobs["zero2"] = {"cfg": _job(tmp / "zero2", {**PP, "zero_stage": 2})}
    jobs["fp32"] = {"cfg": _job(tmp / "fp32", PP, dtype="fp32")}
    jobs["bf16p"] = {"cfg": _job(tmp / "bf16p", PP, dtype="bf16", param_dtype="bf16")}
    per_rank = run_distributed(run_trainers, 4, args=(list(jobs.values()),), timeout=400)
    for j, name in enumerate(jobs):
        out[name] = [per_rank[r][j] for r in range(4)]
    out["cfgs"] = {name: job["cfg"] for name, job in jobs.items()}
    return out


@pytest.mark.parametrize("layout", [*LAYOUTS, "lora"])
def test_dp2_pp2_zero3_trains_like_one_process_in_fp64(runs, layout):
    ref = runs["ref_lora" if layout == "lora" else "ref"]
    results = runs[layout]
    assert all(r["memory"]["stage"] == 3 for r in results)  # really ZeRO-3, not ZeRO-2
    assert rel_norm(results[-1]["losses"], ref["losses"]) <= FP64_REL  # the last stage reports the loss
    name, worst = worst_rel(gather_full(results), ref["params"])
    assert worst <= FP64_REL, f"{layout}: {name} differs by {worst:.2e}"


def test_bf16_parameters_under_pp_and_zero3_track_fp32(runs):
    """bf16 parameters with fp32 masters (Zero3Optimizer under a master policy, per stage) within tests/test_bf16_params.py's bound
    of the fp32 run, 2 % (5u, u = 2^-8), at every step."""
    got, want = runs["bf16p"][-1], runs["fp32"][-1]
    assert got["memory"]["stage"] == 3 and got["losses"] != want["losses"]
    assert max(abs(g - w) / abs(w) for g, w in zip(got["losses"], want["losses"], strict=True)) <= 0.02


def test_negative_control_unreduced_unit_fails_the_comparison(runs):
    _, worst = worst_rel(gather_full(runs["control"], check_replicas=False), runs["ref"]["params"])
    assert worst >= NEGATIVE_MIN, worst


def test_each_rank_holds_half_of_zero2s_parameters_and_the_plan_agrees(runs):
    for rank in range(4):
        z2, z3 = runs["zero2"][rank]["memory"]["measured"], runs["1f1b"][rank]["memory"]
        units = z3["num_buckets"]
        assert z2["params"] / 2 <= z3["measured"]["params"] <= z2["params"] / 2 + 8 * units, (rank, z2, z3)
        for name, measured in (("zero2", z2), ("1f1b", z3["measured"])):
            plan = rank_memory(runs["cfgs"][name], [rank])[0]["memory_bytes"]
            for key, got in (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer_state")):
                assert abs(plan[key] - measured[got]) <= 0.05 * measured[got], (name, rank, key, plan, measured)
