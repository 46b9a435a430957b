"""Context parallelism through the real engine (Trainer in Gloo processes) trains like one process (issue 30).

Each layout trains the same global batch (micro_batch 2 × 4 micro-batches, over the DP replicas) for 3 steps in
float64: every CP rank of a DP replica reads the same micro-batches and keeps its load-balanced shard of each
sequence (``parallel.context.shard_inputs``), attention runs around the CP ring, the loss is weighed by the
global batch's labelled tokens counted over dp×cp, and gradients (ZeRO's shards too) are reduced over dp×cp.
Per-step losses, the final parameters (reassembled from every rank through the trainer's regions), the held-out
loss and the greedy samples must match the one-process run within ``FP64_REL`` (the derivation is in
``tests/tolerances.py``; the ring adds one more blocked sum per attention row, the same rounding order of
magnitude, see tests/test_ring_attention.py).

Negative controls (``tests.cp_sabotage`` and ``engine_helpers.SABOTAGE``) break one CP piece each — rotary
positions local to the shard, the first gradient bucket not reduced over CP, the loss denominator from the local
token count, the ring ignoring packed documents, a ZeRO-3 unit not reduced over dp×cp, and under cp2×tp2 with
sequence parallelism the norm weights' gradients not summed over TP (which shows SP is on) — and must fail the
same comparison by at least ``NEGATIVE_MIN``.

A cp2 checkpoint (written at step 2 of 4) resumes at cp1 and at dp2, and a one-process checkpoint at dp2×cp2, and
each continues the same losses and ends at the same parameters within ``FP64_REL``.

Layouts of the same world size share one set of processes (tests.engine_helpers.run_trainers): 1 + 2 + 4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kuangchao_core.ckpt.lineage import new_lineage_id
from tests.engine_helpers import gather_full, run_trainers, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN, max_rel_diff, worst_rel

STEPS = 3
MICRO = 2
GLOBAL_MICRO_BATCHES = 4
SEQ = 32  # 2·cp chunks of 4 tokens at cp4

# name -> (world size, parallel section, packed documents)
LAYOUTS: dict[str, tuple[int, dict, bool]] = {
    "cp2": (2, {"context_parallel_size": 2}, False),
    "cp2_packed": (2, {"context_parallel_size": 2}, True),
    "cp4": (4, {"context_parallel_size": 4}, False),
    "cp2_pp2": (4, {"context_parallel_size": 2, "pipeline_parallel_size": 2}, False),
    "dp2_cp2_zero3": (4, {"data_parallel_size": 2, "context_parallel_size": 2, "zero_stage": 3}, False),
    "cp2_tp2_sp": (4, {"context_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True}, False),
}
#: negative control -> (the layout it breaks, the sabotage)
NEGATIVE: dict[str, tuple[str, str]] = {
    "cp2_local_rotary_positions": ("cp2", "local_rotary_positions"),
    "cp2_unreduced_over_cp": ("cp2", "unreduced_dp_bucket"),
    "cp2_packed_ring_without_documents": ("cp2_packed", "ring_without_documents"),
    "cp4_local_token_count": ("cp4", "local_token_count"),
    "cp2_packed_local_token_count": ("cp2_packed", "local_token_count"),
    "cp2_pp2_local_rotary_positions": ("cp2_pp2", "local_rotary_positions"),
    "dp2_cp2_zero3_unreduced_unit": ("dp2_cp2_zero3", "unreduced_zero3_unit"),
    "cp2_tp2_sp_unreduced_over_cp": ("cp2_tp2_sp", "unreduced_dp_bucket"),
    # SP is really on in that layout: its norm weights' gradients must be summed over TP
    "cp2_tp2_sp_unsummed_norm_grads": ("cp2_tp2_sp", "unsummed_sp_norm_grads"),
}
RESUME_STEPS, INTERVAL = 4, 2


def _job(root: Path, parallel: dict, packed: bool, steps: int = 8, **checkpoint):
    dp = parallel.get("data_parallel_size", 1)
    return tiny_job(
        str(root),
        task={"name": "cp", "seed": 7},
        model={"preset": "tiny", "num_layers": 2},
        data={"seq_len": SEQ, "packing": "documents" if packed else "concat"},
        parallel={"micro_batch_size": MICRO, "gradient_accumulation_steps": GLOBAL_MICRO_BATCHES // dp, **parallel},
        train={"steps": steps, "dtype": "fp64"},
        **({"checkpoint": checkpoint} if checkpoint else {}),
    )


def _resume_job(root: Path, parallel: dict):
    return _job(root, parallel, False, steps=RESUME_STEPS, interval=INTERVAL, keep_last=3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """name -> per-rank results of every layout, control, reference and resumed run."""
    tmp = tmp_path_factory.mktemp("engine_cp")
    by_world: dict[int, list[tuple[str, dict]]] = {1: [], 2: [], 4: []}
    for packed in (False, True):
        name = "ref_packed" if packed else "ref"
        by_world[1].append((name, {"cfg": _job(tmp / name, {}, packed), "max_steps": STEPS}))
    for name, (world, parallel, packed) in LAYOUTS.items():
        by_world[world].append((name, {"cfg": _job(tmp / name, parallel, packed), "max_steps": STEPS}))
    for name, (layout, sabotage) in NEGATIVE.items():
        world, parallel, packed = LAYOUTS[layout]
        job = {"cfg": _job(tmp / name, parallel, packed), "max_steps": STEPS, "sabotage": sabotage}
        by_world[world].append((name, job))
    # resume: cp2 writes steps 2 and 4 (lineage pinned); dp2 (same processes, after it) and cp1 resume at step 2
    lineage = new_lineage_id()
    step_dir = tmp / "resume_cp2" / "ckpt" / "cp" / lineage / f"step_{INTERVAL:08d}"
    by_world[2].append(
        ("resume_cp2", {"cfg": _resume_job(tmp / "resume_cp2", {"context_parallel_size": 2}), "lineage": lineage})
    )
    by_world[2].append(
        ("resume_dp2", {"cfg": _resume_job(tmp / "resume_dp2", {"data_parallel_size": 2}), "resume": str(step_dir)})
    )
    # and back: a one-process run writes step 2 of 4 (lineage pinned), dp2×cp2 resumes it
    back = new_lineage_id()
    back_dir = tmp / "resume_one" / "ckpt" / "cp" / back / f"step_{INTERVAL:08d}"
    by_world[1].append(("resume_one", {"cfg": _resume_job(tmp / "resume_one", {}), "lineage": back}))
    dp2_cp2 = {"data_parallel_size": 2, "context_parallel_size": 2}
    by_world[4].append(
        ("resume_dp2_cp2", {"cfg": _resume_job(tmp / "resume_dp2_cp2", dp2_cp2), "resume": str(back_dir)})
    )
    fresh = {"cfg": _resume_job(tmp / "resume_fresh", dp2_cp2), "resume": str(back_dir)}
    by_world[4].append(("resume_dp2_cp2_fresh_optimizer", {**fresh, "sabotage": "fresh_optimizer_on_resume"}))
    out: dict[str, list[dict]] = {}
    for world in (2, 1, 4):  # cp1 resumes what the two-process batch wrote, dp2×cp2 what the one process wrote
        if world == 1:
            by_world[1].append(("resume_cp1", {"cfg": _resume_job(tmp / "resume_cp1", {}), "resume": str(step_dir)}))
        names = [n for n, _ in by_world[world]]
        per_rank = run_distributed(run_trainers, world, args=([j for _, j in by_world[world]],), timeout=400)
        for i, n in enumerate(names):
            out[n] = [per_rank[r][i] for r in range(world)]
    return out


def _differences(runs, layout: str, got: list[dict], check_replicas: bool = True) -> tuple[float, str, float]:
    ref = runs["ref_packed" if LAYOUTS[layout][2] else "ref"][0]
    loss_diff = max(max_rel_diff(r["losses"], ref["losses"]) for r in got)
    name, param_diff = worst_rel(gather_full(got, check_replicas=check_replicas), ref["params"])
    return loss_diff, name, param_diff


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp_layout_trains_like_one_process_in_fp64(runs, layout):
    ref = runs["ref_packed" if LAYOUTS[layout][2] else "ref"][0]
    assert len(ref["losses"]) == STEPS and ref["losses"][-1] < ref["losses"][0]
    loss_diff, name, param_diff = _differences(runs, layout, runs[layout])
    assert loss_diff <= FP64_REL, f"{layout}: losses differ from one process by {loss_diff:.2e} relative"
    assert param_diff <= FP64_REL, f"{layout}: {name} differs from one process by relative norm {param_diff:.2e}"
    for rank, r in enumerate(runs[layout]):  # held-out loss over the CP shards, greedy samples on full prompts
        assert abs(r["eval_loss"] - ref["eval_loss"]) <= FP64_REL * ref["eval_loss"], (layout, rank, r["eval_loss"])
        assert r["samples"] == ref["samples"], (layout, rank)
    print(f"{layout}: losses within {loss_diff:.1e}, worst parameter {name} {param_diff:.1e} (tolerance {FP64_REL})")


@pytest.mark.parametrize("control", list(NEGATIVE))
def test_cp_negative_control_fails_the_same_comparison(runs, control):
    layout, _ = NEGATIVE[control]
    loss_diff, name, param_diff = _differences(runs, layout, runs[control], check_replicas=False)
    assert max(loss_diff, param_diff) >= NEGATIVE_MIN, (
        f"{control}: the broken run still matches one process (losses {loss_diff:.2e}, {name} {param_diff:.2e})"
    )
    print(f"{control}: losses differ by {loss_diff:.2e}, {name} by {param_diff:.2e}")


@pytest.mark.parametrize(
    ("target", "source"), [("resume_cp1", "resume_cp2"), ("resume_dp2", "resume_cp2"), ("resume_dp2_cp2", "resume_one")]
)
def test_a_checkpoint_resumes_across_cp_layouts_and_continues_the_same_losses(runs, target, source):
    """cp2 → cp1 and cp2 → dp2, and back: one process → dp2×cp2."""
    want = np.array(runs[source][0]["losses"])
    assert len(want) == RESUME_STEPS
    for r in runs[target]:
        assert r["steps_run"] == RESUME_STEPS - INTERVAL  # it really started from the step-2 checkpoint
        got = np.array(r["losses"])
        np.testing.assert_array_equal(got[:INTERVAL], want[:INTERVAL])
        np.testing.assert_allclose(got[INTERVAL:], want[INTERVAL:], rtol=FP64_REL, atol=0, err_msg=target)
    name, diff = worst_rel(gather_full(runs[target]), gather_full(runs[source]))
    assert diff <= FP64_REL, f"{target}: {name} differs by relative norm {diff:.2e}"


def _worker_main(rank: int, world_size: int, config: str) -> int:
    from kuangchao_core.engine import worker

    return worker.main(["--config", config, "--max-steps", "1"])


def test_worker_entry_point_finishes_a_cp2_job(tmp_path):
    """The worker path (the plan check before launch, then the final greedy evaluation on full prompts) runs a cp2
    job to the end (trusted mode: the tokens' group lists are checked in tests/test_mesh_axes.py)."""
    import yaml

    cfg = _job(tmp_path, {"context_parallel_size": 2}, False).model_dump(mode="json")
    path = tmp_path / "cp2.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    assert run_distributed(_worker_main, 2, args=(str(path),), timeout=120) == [0, 0]


def test_the_resume_comparison_fails_when_the_optimizer_state_is_not_restored(runs):
    """Negative control of the resume test: dp2×cp2 resumed with fresh AdamW moments."""
    want = runs["resume_one"][0]["losses"][INTERVAL:]
    got = runs["resume_dp2_cp2_fresh_optimizer"][0]["losses"][INTERVAL:]
    assert max_rel_diff(got, want) >= NEGATIVE_MIN, (got, want)
