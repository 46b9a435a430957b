"""Every parallel layout, run through the real engine (Trainer in Gloo processes), trains like one process (L3.6).

Each layout trains the same global batch (micro_batch x grad_accum x dp = 8 sequences) for 5 steps. Per-step losses
must match the one-process run within 1e-5 relative, and the final parameters, reassembled from every rank's slices
through the trainer's regions, within 1e-5 relative norm per tensor. Parameters are compared by norm rather than
element-wise because AdamW divides by sqrt(v) + eps: for elements whose gradients are tiny, a last-bit difference of a
reduction order (TP all-reduce, DP averaging, pipeline micro-batch order) is amplified element-wise, while the
tensor as a whole stays equal.

Layouts of the same world size share one set of processes (tests.engine_helpers.run_trainers), so the whole module
starts 1 + 2 + 4 + 8 processes.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from kuangchao_core.errors import ConfigError
from tests.engine_helpers import gather_full, run_trainers, tiny_job
from tests.mp import run_distributed

STEPS = 5
MICRO = 2
GLOBAL_MICRO_BATCHES = 4  # micro-batches of MICRO sequences per optimizer step, over all DP ranks

# name -> (world size, parallel section, layers)
LAYOUTS: dict[str, tuple[int, dict, int]] = {
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
}


def _job(tmp: Path, name: str, parallel: dict, layers: int):
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
        train={"steps": 8},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """name -> per-rank results; "ref4"/"ref8" are the one-process runs of the 4- and 8-layer models."""
    tmp = tmp_path_factory.mktemp("engine3d")
    by_world: dict[int, list[str]] = {1: ["ref4", "ref8"]}
    jobs = {"ref4": _job(tmp, "ref4", {}, 4), "ref8": _job(tmp, "ref8", {}, 8)}
    for name, (world, parallel, layers) in LAYOUTS.items():
        by_world.setdefault(world, []).append(name)
        jobs[name] = _job(tmp, name, parallel, layers)
    out: dict[str, list[dict]] = {}
    for world, names in sorted(by_world.items()):
        batch = [{"cfg": jobs[n], "max_steps": STEPS} for n in names]
        per_rank = run_distributed(run_trainers, world, args=(batch,), timeout=400)
        for i, n in enumerate(names):
            out[n] = [per_rank[r][i] for r in range(world)]
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_one_process(runs, layout):
    world, _parallel, layers = LAYOUTS[layout]
    ref = runs[f"ref{layers}"][0]
    got = runs[layout]
    ref_losses = np.array(ref["losses"])
    assert len(ref_losses) == STEPS
    assert ref_losses[-1] < ref_losses[0]  # it does train
    for rank in range(world):  # every rank reports the global loss
        np.testing.assert_allclose(got[rank]["losses"], ref_losses, rtol=1e-5, atol=0)
    full = gather_full(got)
    assert set(full) == set(ref["params"])
    for name, want in ref["params"].items():
        diff = np.linalg.norm(full[name].astype(np.float64) - want) / np.linalg.norm(want)
        assert diff <= 1e-5, f"{layout}: {name} differs from one process by relative norm {diff:.2e}"


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
    cfg = _job(tmp_path, name, {}, 4).model_dump(mode="json")
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
