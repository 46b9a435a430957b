"""``parallel.sequence_parallel`` through the real engine (Trainer in Gloo processes) trains like one process.

tp2 with sequence parallelism, pp2×tp2 with it (stages exchange s/tp positions) and dp2×tp2 with it under ZeRO-3
train the same global batch (2 micro-batches of 2 sequences, accumulated or over DP) for 3 steps in float64 on
packed documents (``data.packing: documents``: segments and restarting positions, boundaries across the shard
boundary) as the one-process job does. Per-step losses, the first step's reduced and clipped gradients and the
final parameters (reassembled from every rank's slices; ZeRO-3 keeps no full gradients: losses and parameters
only), the held-out loss and the greedy samples (decoding lengths tp does not divide) must match within
``FP64_REL`` (derived in ``tests/tolerances.py``). Gradients are compared too because AdamW's update barely depends
on a gradient's scale, so a norm gradient summed twice would pass a parameter-only check. Negative control: the tp2
job with the norm weights' gradient sum over TP removed fails the same comparison by ≥ ``NEGATIVE_MIN``. Also:
configuration errors name ``parallel.sequence_parallel`` (tp 1) and ``data.seq_len`` (not divisible by tp).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kuangchao_core.errors import ConfigError
from tests.engine_helpers import gather_full, run_trainers, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN, max_rel_diff, worst_rel

STEPS = 3
LAYOUTS = {  # name -> (world size, parallel section)
    "tp2_sp": (2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "pp2_tp2_sp": (4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "sequence_parallel": True}),
    "dp2_tp2_sp_zero3": (
        4,
        {"data_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True, "zero_stage": 3},
    ),
}
#: layouts whose gradients live in ZeRO shards: losses and parameters compared
SHARDED_GRADS = ("dp2_tp2_sp_zero3",)
#: LoRA on column- and row-parallel projections (a row-parallel adapter's B sees a sequence shard under SP)
LORA = {"rank": 4, "targets": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}
LORA_LAYOUTS = {"tp2_sp_lora": (2, {"tensor_parallel_size": 2, "sequence_parallel": True})}
NEGATIVE = {"tp2_sp_unsummed_norm_grads": ("tp2_sp", "unsummed_sp_norm_grads")}
#: LoRA's adapters with their TP gradient sum removed (a row-parallel B on a sequence shard, a column-parallel A)
LORA_NEGATIVE = {"tp2_sp_lora_unsummed": ("tp2_sp_lora", "unsummed_lora_a")}


def _job(tmp: Path, name: str, parallel: dict, lora: dict | None = None):
    return tiny_job(
        str(tmp / name),
        task={"name": name, "seed": 7},
        model={"preset": "tiny", "num_layers": 2, **({"lora": lora} if lora else {})},
        data={"seq_len": 16, "packing": "documents"},
        parallel={"micro_batch_size": 2, "gradient_accumulation_steps": 2 // parallel.get("data_parallel_size", 1)}
        | parallel,
        train={"steps": 8, "dtype": "fp64", "eval_interval": 100},
    )


def _run_recording_stage_traffic(rank: int, world_size: int, jobs: list[dict]) -> list[dict]:
    """:func:`run_trainers`, each result also holding ``stage_shapes``: the shapes of every activation and gradient
    this rank sent to or received from another pipeline stage, and ``log``: the engine's log messages of this
    process."""
    import logging

    from kuangchao_core.parallel import pp_executor

    shapes: set[tuple[int, ...]] = set()
    real = pp_executor.PipelineExecutor.run
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    engine_log = logging.getLogger("kuangchao.engine")
    engine_log.addHandler(handler)
    level = engine_log.level
    engine_log.setLevel(logging.INFO)

    def run(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        shapes.update(ev.shape for ev in self.trace if ev.shape is not None)
        return out

    pp_executor.PipelineExecutor.run = run
    try:
        results = run_trainers(rank, world_size, jobs)
    finally:
        pp_executor.PipelineExecutor.run = real
        engine_log.removeHandler(handler)
        engine_log.setLevel(level)
    return [{**r, "stage_shapes": shapes, "log": messages} for r in results]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("sp_engine")
    by_world: dict[int, list[tuple[str, dict]]] = {
        1: [("ref", {"cfg": _job(tmp, "ref", {})}), ("ref_lora", {"cfg": _job(tmp, "ref_lora", {}, LORA)})]
    }
    for name, (world, parallel) in LAYOUTS.items():
        by_world.setdefault(world, []).append((name, {"cfg": _job(tmp, name, parallel)}))
    for name, (world, parallel) in LORA_LAYOUTS.items():
        by_world[world].append((name, {"cfg": _job(tmp, name, parallel, LORA)}))
    for name, (layout, sabotage) in NEGATIVE.items():
        world, parallel = LAYOUTS[layout]
        by_world[world].append((name, {"cfg": _job(tmp, name, parallel), "sabotage": sabotage}))
    for name, (layout, sabotage) in LORA_NEGATIVE.items():
        world, parallel = LORA_LAYOUTS[layout]
        by_world[world].append((name, {"cfg": _job(tmp, name, parallel, LORA), "sabotage": sabotage}))
    out: dict[str, list[dict]] = {}
    for world, jobs in sorted(by_world.items()):
        per_rank = run_distributed(
            _run_recording_stage_traffic, world, args=([{**j, "max_steps": STEPS} for _, j in jobs],)
        )
        for i, (name, _) in enumerate(jobs):
            out[name] = [per_rank[r][i] for r in range(world)]
    return out


def _differences(runs, got: list[dict], check_replicas: bool = True, grads: bool = True, ref: str = "ref") -> dict:
    ref = runs[ref][0]
    losses = max(max_rel_diff(r["losses"], ref["losses"]) for r in got if r["losses"])
    out = {
        "losses": ("", losses),
        "params": worst_rel(gather_full(got, check_replicas=check_replicas), ref["params"]),
    }
    if grads:
        out["grads"] = worst_rel(gather_full(got, "first_grads", check_replicas), ref["first_grads"])
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sequence_parallel_trains_like_one_process_in_fp64(runs, layout):
    ref = runs["ref"][0]
    assert len(ref["losses"]) == STEPS and ref["losses"][-1] < ref["losses"][0]
    assert ref["first_step"][0]["segment_ids"].max() > 0  # packed documents really reach the model
    diffs = _differences(runs, runs[layout], grads=layout not in SHARDED_GRADS)
    for what, (name, diff) in diffs.items():
        assert diff <= FP64_REL, f"{layout}: {what} {name} differ from one process by {diff:.2e} relative"
    print(f"{layout}: {diffs} (tolerance {FP64_REL})")


def test_lora_with_sequence_parallel_trains_like_one_process_in_fp64(runs):
    assert any("lora_B" in n for n in runs["ref_lora"][0]["first_grads"])  # only adapters train
    for layout in LORA_LAYOUTS:
        diffs = _differences(runs, runs[layout], ref="ref_lora")
        for what, (name, diff) in diffs.items():
            assert diff <= FP64_REL, f"{layout}: {what} {name} differ from one process by {diff:.2e} relative"
        print(f"{layout}: {diffs} (tolerance {FP64_REL})")


def test_pipeline_stages_exchange_s_over_tp_positions(runs):
    """pp2×tp2 with sequence parallelism: every activation and gradient between the stages is (micro-batch, s/tp,
    hidden); without it they would be (micro-batch, s, hidden)."""
    for r in runs["pp2_tp2_sp"]:
        assert r["stage_shapes"] == {(2, 16 // 2, 64)}, r["stage_shapes"]


def test_the_job_logs_that_sequence_parallelism_is_on(runs):
    assert "sequence parallel on" in runs["tp2_sp"][0]["log"]
    assert "sequence parallel on" not in runs["ref"][0]["log"]


def test_negative_controls_unsummed_gradients_fail(runs):
    for name in [*NEGATIVE, *LORA_NEGATIVE]:
        diffs = _differences(runs, runs[name], check_replicas=False, ref="ref_lora" if name in LORA_NEGATIVE else "ref")
        worst = max(d for _, d in diffs.values())
        assert worst >= NEGATIVE_MIN, f"{name}: the broken run still matches one process ({diffs})"
        print(f"{name}: {diffs} (tolerance {FP64_REL:.0e})")


@pytest.mark.parametrize(
    ("parallel", "data", "field", "numbers"),
    [
        ({"sequence_parallel": True}, {}, "parallel.sequence_parallel", "tensor_parallel_size is 1"),
        (
            {"sequence_parallel": True, "tensor_parallel_size": 2},
            {"seq_len": 15},
            "data.seq_len",
            "seq_len 15 is not divisible by tensor_parallel_size 2",
        ),
    ],
)
def test_bad_sequence_parallel_settings_name_the_field(tmp_path, parallel, data, field, numbers):
    with pytest.raises(ConfigError) as err:
        tiny_job(str(tmp_path), parallel=parallel, data={"seq_len": 16, **data})
    assert any(path == field and numbers in msg for path, msg in err.value.errors), err.value.errors


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_held_out_loss_and_greedy_samples_are_those_of_one_process(runs, layout):
    """Evaluation runs the training length; greedy decoding grows the prompt one token at a time, so most lengths
    are not divisible by tp and take the padded path."""
    ref = runs["ref"][0]
    assert ref["eval_loss"] is not None and ref["samples"] is not None
    for r in runs[layout]:
        assert abs(r["eval_loss"] - ref["eval_loss"]) <= FP64_REL * ref["eval_loss"], (r["eval_loss"], ref)
        assert r["samples"] == ref["samples"]
