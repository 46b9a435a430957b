"""Every parallel layout, run through the real engine (Trainer in Gloo processes), trains like one process (L3.6).

Each layout trains the same global batch (micro_batch x grad_accum x dp = 8 sequences) for 3 steps in float64
(``train.dtype: fp64``): per-step losses and the final parameters, reassembled from every rank's slices through the
trainer's regions, must match the one-process run within ``FP64_REL`` = 1e-10 relative (per tensor, relative norm;
the derivation is in ``tests/tolerances.py``). A smaller fp32 set checks what fp32 arithmetic bounds: losses within
1e-5 and the first step's gradients within 1e-4 (never parameters after several AdamW steps, whose ``eps``
amplifies rounding differences that depend on the CPU). Four negative controls break one reduction each (TP, PP,
DP, ZeRO) and must fail the same comparison by orders of magnitude.

ZeRO-3 layouts (dp2, dp2 with full recomputation, dp4, dp2×tp2) also check their memory report against 16Ψ/N (the
bytes really held are measured in tests/test_zero3_memory.py) and that the next block's gather is issued before the
current block's forward ends.

Layouts of the same world size share one set of processes (tests.engine_helpers.run_trainers), so the whole module
starts 1 + 2 + 4 + 8 processes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kuangchao_core.errors import ConfigError
from tests.engine_helpers import gather_full, run_trainers, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP32_GRAD_REL, FP32_LOSS_REL, FP64_REL, NEGATIVE_MIN, max_rel_diff, worst_rel

STEPS = 3
MICRO = 2
GLOBAL_MICRO_BATCHES = 4  # micro-batches of MICRO sequences per optimizer step, over all DP ranks

# name -> (world size, parallel section, layers)
LAYOUTS: dict[str, tuple[int, dict, int]] = {
    "dp2": (2, {"data_parallel_size": 2}, 4),
    "tp2": (2, {"tensor_parallel_size": 2}, 4),
    "pp2_1f1b": (2, {"pipeline_parallel_size": 2}, 4),
    "pp2_interleaved": (
        2,
        {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "pipeline_schedule": "interleaved_1f1b"},
        4,
    ),
    "dp2_zero1": (2, {"data_parallel_size": 2, "zero_stage": 1}, 4),
    "dp2_zero2": (2, {"data_parallel_size": 2, "zero_stage": 2}, 4),
    "tp4": (4, {"tensor_parallel_size": 4}, 4),
    "pp4_1f1b": (4, {"pipeline_parallel_size": 4}, 4),
    "pp4_interleaved": (
        4,
        {"pipeline_parallel_size": 4, "virtual_pipeline_size": 2, "pipeline_schedule": "interleaved_1f1b"},
        8,
    ),
    "dp2_tp2": (4, {"data_parallel_size": 2, "tensor_parallel_size": 2}, 4),
    "dp2_pp2": (4, {"data_parallel_size": 2, "pipeline_parallel_size": 2}, 4),
    "tp2_pp2": (4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 4),
    "dp2_tp2_pp2": (8, {"data_parallel_size": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 4),
    "dp2_tp2_zero1": (4, {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1}, 4),
    "dp2_pp2_zero2": (4, {"data_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 2}, 4),
    "dp2_zero3": (2, {"data_parallel_size": 2, "zero_stage": 3}, 4),
    "dp2_zero3_full_recompute": (2, {"data_parallel_size": 2, "zero_stage": 3}, 4),
    "dp4_zero3": (4, {"data_parallel_size": 4, "zero_stage": 3}, 4),
    "dp2_tp2_zero3": (4, {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3}, 4),
}
#: layouts that also set train fields
TRAIN_EXTRA: dict[str, dict] = {"dp2_zero3_full_recompute": {"activation_checkpointing": "full"}}
#: ZeRO-3 layouts also run in fp32 (losses compared: their gradients live in shards)
FP32_ZERO3 = ("dp2_zero3", "dp4_zero3", "dp2_tp2_zero3")
#: fp32 runs: losses and first-step gradients only, one per family without ZeRO (whose gradients live in shards);
#: their combinations are covered in fp64 above.
FP32_LAYOUTS = ("dp2", "tp2", "pp2_1f1b")
#: negative control -> (the layout it breaks, the sabotage in tests.engine_helpers.SABOTAGE)
NEGATIVE: dict[str, tuple[str, str]] = {
    "tp2_missing_row_parallel_all_reduce": ("tp2", "missing_row_parallel_all_reduce"),
    "pp2_skipped_micro_batch": ("pp2_1f1b", "skipped_micro_batch"),
    "dp2_unreduced_bucket": ("dp2", "unreduced_dp_bucket"),
    "dp2_zero2_unreduced_bucket": ("dp2_zero2", "unreduced_zero_bucket"),
    "dp2_zero3_unreduced_unit": ("dp2_zero3", "unreduced_zero3_unit"),
}


def _job(tmp: Path, name: str, parallel: dict, layers: int, dtype: str = "fp64", train: dict | None = None):
    dp = parallel.get("data_parallel_size", 1)
    par = {
        "micro_batch_size": MICRO,
        "gradient_accumulation_steps": GLOBAL_MICRO_BATCHES // dp,
        **parallel,
    }
    return tiny_job(
        str(tmp / name),
        task={"name": name, "seed": 7},
        model={"preset": "tiny", "num_layers": layers},
        data={"seq_len": 16},
        parallel=par,
        train={"steps": 8, "dtype": dtype, **(train or {})},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """name -> per-rank results: every layout in fp64, ``<layout>@fp32`` for FP32_LAYOUTS, the negative controls;
    "ref4"/"ref8" (and "ref4@fp32") are the one-process runs of the 4- and 8-layer models."""
    tmp = tmp_path_factory.mktemp("engine3d")
    by_world: dict[int, list[str]] = {1: ["ref4", "ref8", "ref4@fp32"]}
    jobs = {
        "ref4": {"cfg": _job(tmp, "ref4", {}, 4)},
        "ref8": {"cfg": _job(tmp, "ref8", {}, 8)},
        "ref4@fp32": {"cfg": _job(tmp, "ref4_fp32", {}, 4, "fp32")},
    }
    for name, (world, parallel, layers) in LAYOUTS.items():
        by_world.setdefault(world, []).append(name)
        jobs[name] = {"cfg": _job(tmp, name, parallel, layers, train=TRAIN_EXTRA.get(name)), "trace": True}
        if name in FP32_LAYOUTS or name in FP32_ZERO3:
            by_world[world].append(f"{name}@fp32")
            jobs[f"{name}@fp32"] = {"cfg": _job(tmp, f"{name}_fp32", parallel, layers, "fp32")}
    for name, (layout, sabotage) in NEGATIVE.items():
        world, parallel, layers = LAYOUTS[layout]
        by_world[world].append(name)  # after the honest runs: a sabotage is undone, but run it last all the same
        cfg = _job(tmp, name, parallel, layers, train=TRAIN_EXTRA.get(layout))
        jobs[name] = {"cfg": cfg, "sabotage": sabotage}
    out: dict[str, list[dict]] = {}
    for world, names in sorted(by_world.items()):
        batch = [{**jobs[n], "max_steps": STEPS} for n in names]
        per_rank = run_distributed(run_trainers, world, args=(batch,), timeout=400)
        for i, n in enumerate(names):
            out[n] = [per_rank[r][i] for r in range(world)]
    return out


def _fp64_differences(runs, layout: str, got: list[dict], check_replicas: bool = True) -> tuple[float, str, float]:
    """(worst loss difference over ranks and steps, worst parameter, its relative-norm difference) vs one process."""
    layers = LAYOUTS[layout][2]
    ref = runs[f"ref{layers}"][0]
    loss_diff = max(max_rel_diff(r["losses"], ref["losses"]) for r in got)
    name, param_diff = worst_rel(gather_full(got, check_replicas=check_replicas), ref["params"])
    return loss_diff, name, param_diff


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_one_process_in_fp64(runs, layout):
    ref = runs[f"ref{LAYOUTS[layout][2]}"][0]
    assert len(ref["losses"]) == STEPS
    assert ref["losses"][-1] < ref["losses"][0]  # it does train
    assert all(p.dtype.name == "float64" for p in ref["params"].values())
    loss_diff, name, param_diff = _fp64_differences(runs, layout, runs[layout])
    assert loss_diff <= FP64_REL, f"{layout}: losses differ from one process by {loss_diff:.2e} relative"
    assert param_diff <= FP64_REL, f"{layout}: {name} differs from one process by relative norm {param_diff:.2e}"
    print(f"{layout}: losses within {loss_diff:.1e}, worst parameter {name} {param_diff:.1e} (tolerance {FP64_REL})")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_held_out_loss_is_the_same_in_every_layout(runs, layout):
    ref = runs[f"ref{LAYOUTS[layout][2]}"][0]["eval_loss"]
    assert ref is not None and 0 < ref < 10
    for rank, r in enumerate(runs[layout]):  # every rank reports the DP-summed, token-weighted mean
        assert abs(r["eval_loss"] - ref) <= FP64_REL * ref, (layout, rank, r["eval_loss"], ref)


@pytest.mark.parametrize("layout", FP32_LAYOUTS)
def test_layout_matches_one_process_in_fp32_where_fp32_bounds_it(runs, layout):
    ref = runs["ref4@fp32"][0]
    got = runs[f"{layout}@fp32"]
    assert all(p.dtype.name == "float32" for p in ref["params"].values())
    loss_diff = max(max_rel_diff(r["losses"], ref["losses"]) for r in got)
    assert loss_diff <= FP32_LOSS_REL, f"{layout}: fp32 losses differ by {loss_diff:.2e} relative"
    name, grad_diff = worst_rel(gather_full(got, key="first_grads"), ref["first_grads"])
    assert grad_diff <= FP32_GRAD_REL, f"{layout}: first-step gradient of {name} differs by {grad_diff:.2e}"
    print(f"{layout} fp32: losses within {loss_diff:.1e}, first-step gradient {name} {grad_diff:.1e}")


@pytest.mark.parametrize("layout", FP32_ZERO3)
def test_zero3_losses_match_one_process_in_fp32(runs, layout):
    ref = runs["ref4@fp32"][0]
    loss_diff = max(max_rel_diff(r["losses"], ref["losses"]) for r in runs[f"{layout}@fp32"])
    assert loss_diff <= FP32_LOSS_REL, f"{layout}: fp32 losses differ by {loss_diff:.2e} relative"


@pytest.mark.parametrize("layout", ["dp2_zero3", "dp4_zero3", "dp2_tp2_zero3"])
def test_zero3_memory_report_states_its_share_of_parameters_gradients_and_adamw_state(runs, layout):
    """ZeRO-3's own memory report (what ``kc debug memory`` and the logs show): 16Ψ/N bytes per rank in fp32 (8
    bytes per element here: the runs are fp64, so 32Ψ/N), plus only the padding of each unit to a multiple of N.
    This reads the optimizer's bookkeeping; the memory the process really holds is measured, with a leak as the
    negative control, in tests/test_zero3_memory.py."""
    for r in runs[layout]:
        mem = r["memory"]
        n, psi, padded = mem["dp_size"], mem["numel"], mem["padded_numel"]
        assert mem["stage"] == 3 and n == LAYOUTS[layout][1]["data_parallel_size"]
        measured, formula = mem["measured"], mem["formula"]
        assert formula["total"] == 4 * 8 * psi / n
        assert measured["params"] == measured["grads"] == 8 * padded // n  # no full parameter left after the step
        assert measured["optimizer_state"] == 2 * 8 * padded // n
        assert 0 <= measured["total"] - formula["total"] <= 4 * 8 * (padded - psi) / n
        assert padded - psi < n * mem["num_buckets"]


def test_zero3_prefetches_the_next_block_before_the_current_forward_ends(runs):
    trace = runs["dp2_zero3"][0]["zero3_trace"]
    units = 1 + 4 + 2  # embedding, four layers, norm, head
    first_forward = trace[: trace.index(("forward_end", units - 1)) + 1]
    for i in range(units - 1):
        assert first_forward.index(("gather", i + 1)) < first_forward.index(("forward_end", i)), first_forward
    # the backward gathers again (reshard after forward): every layer's parameters are gathered twice per step
    one_step = trace[: trace.index(("forward_end", units - 1), len(first_forward))]
    for i in range(1, 5):
        assert one_step.count(("gather", i)) >= 2, (i, one_step)


@pytest.mark.parametrize("control", list(NEGATIVE))
def test_negative_control_fails_the_same_comparison(runs, control):
    layout, _ = NEGATIVE[control]
    loss_diff, name, param_diff = _fp64_differences(runs, layout, runs[control], check_replicas=False)
    assert max(loss_diff, param_diff) >= NEGATIVE_MIN, (
        f"{control}: the broken run still matches one process (losses {loss_diff:.2e}, {name} {param_diff:.2e})"
    )
    print(f"{control}: losses differ by {loss_diff:.2e}, {name} by {param_diff:.2e} (tolerance {FP64_REL:.0e})")


def test_each_layout_holds_only_its_slices(runs):
    """The comparison above is not vacuous: TP ranks hold halves/quarters, PP ranks disjoint layers."""
    tp2 = runs["tp2"]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert tp2[0]["params"][q].shape[0] * 2 == runs["ref4"][0]["params"][q].shape[0]
    pp4 = runs["pp4_1f1b"]
    owned = [{n for n in r["params"] if n.startswith("model.layers.")} for r in pp4]
    assert all(owned) and sum(len(o) for o in owned) == len(set().union(*owned))
    assert "model.embed_tokens.weight" in pp4[0]["params"] and "lm_head.weight" in pp4[3]["params"]
    assert "lm_head.weight" not in pp4[0]["params"]


# ---------------------------------------------------------------------- bad plans through the worker path
def _yaml(tmp_path: Path, name: str, **parallel) -> str:
    cfg = _job(tmp_path, name, {}, 4, "fp32").model_dump(mode="json")
    cfg["parallel"].update(parallel)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return str(path)


def _worker_main(rank: int, world_size: int, config: str) -> int:
    from kuangchao_core.engine import worker

    return worker.main(["--config", config, "--max-steps", "1"])


@pytest.mark.parametrize(
    ("parallel", "numbers"),
    [
        (
            {
                "pipeline_parallel_size": 2,
                "virtual_pipeline_size": 2,
                "pipeline_schedule": "interleaved_1f1b",
                "gradient_accumulation_steps": 3,
            },
            ["gradient_accumulation_steps 3", "pipeline_parallel_size 2"],
        ),
        ({"tensor_parallel_size": 3}, ["tensor_parallel_size 3"]),
        ({"pipeline_parallel_size": 3}, ["num_layers 4", "3"]),
    ],
    ids=["interleaved_m_not_multiple_of_p", "tp_not_dividing_heads", "layers_not_divisible_by_pp"],
)
def test_worker_refuses_bad_plan_before_building_anything(tmp_path, parallel, numbers):
    from kuangchao_core.engine import worker

    with pytest.raises(ConfigError) as info:
        worker.main(["--config", _yaml(tmp_path, "bad", **parallel)])
    text = str(info.value)
    for n in numbers:
        assert n in text, text


def test_worker_refuses_world_size_mismatch_with_numbers(tmp_path):
    config = _yaml(tmp_path, "mismatch", data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(RuntimeError) as info:
        run_distributed(_worker_main, 2, args=(config,), timeout=120)
    text = str(info.value)
    assert "PlanError" in text or "plan" in text.lower()
    assert re.search(r"2 x tensor_parallel_size 2 x pipeline_parallel_size 1 = 4", text), text
    assert "world size is 2" in text, text


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_worker_entry_point_finishes_a_model_parallel_job(tmp_path, parallel):
    # the worker's end-of-run evaluation needs the whole model; TP/PP ranks must skip it, not fail the job
    config = _yaml(tmp_path, "mp_job", **parallel)
    assert run_distributed(_worker_main, 2, args=(config,), timeout=120) == [0, 0]
