"""A whole job under NCCL's rules (``KC_COMM_RULES=nccl``): every layout, replayed under NCCL's stream model.

The job test runs the worker entry point as ``kc train``'s workers run it — start, resume plan, steps, evaluation
and greedy samples, a checkpoint save, a followed global-config change, the final evaluation, then a second run
that resumes — in every layout the engine has. Each rank's device-group operations are recorded and replayed under
NCCL's execution rules after every step and at the end (``comm.stream_model``). Negative controls: the host
coordination sent on the world group fails at the resume plan's broadcast with the error a CUDA job gave; the
pre-fix pipeline order (receives posted early, sends apart) is named as a deadlock cycle through both ranks' receives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.engine_helpers import tiny_job
from tests.mp import run_distributed

RULES = {"KC_COMM_RULES": "nccl"}


# ---------------------------------------------------------------------- a whole job under the rules
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"]}
VISION = {
    "image_size": 16,
    "patch_size": 8,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "intermediate_size": 64,
}
#: layout -> the parallel section, and the world size and model/data changes where they differ
LAYOUTS = {
    "dp2": {"data_parallel_size": 2},
    "dp2_zero1": {"data_parallel_size": 2, "zero_stage": 1},
    "dp2_zero2": {"data_parallel_size": 2, "zero_stage": 2},
    "dp2_zero3": {"data_parallel_size": 2, "zero_stage": 3},
    "tp2": {"tensor_parallel_size": 2},
    "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
    "tp2_lora": ({"tensor_parallel_size": 2}, 2, {"lora": LORA}),
    "cp2": {"context_parallel_size": 2},  # issue 30: the ring's exchanges and the dp×cp reductions
    "pp2": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
    "pp2_afab_m4": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 4, "pipeline_schedule": "afab"},
    "pp2_interleaved": (
        {
            "pipeline_parallel_size": 2,
            "virtual_pipeline_size": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "gradient_accumulation_steps": 4,
        },
        2,
        {"num_layers": 4},
    ),
    "pp2_dp2_zero3": (
        {"pipeline_parallel_size": 2, "data_parallel_size": 2, "zero_stage": 3, "gradient_accumulation_steps": 2},
        4,
        {},
    ),
    "vlm_pp2_tp2": (
        {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "gradient_accumulation_steps": 2},
        4,
        {"vision": VISION},
    ),
}


def _layout(name: str) -> tuple[dict, int, dict]:
    spec = LAYOUTS[name]
    return (spec, 2, {}) if isinstance(spec, dict) else spec


def _config(tmp_path: Path, parallel: dict, model: dict | None = None) -> str:
    data = {}
    if model and "vision" in model:  # image records: the VLM's data
        from kuangchao_core.data.shapes import make_shape_set

        shapes = tmp_path / "shapes"
        make_shape_set(shapes, num_train=16, num_heldout=4, seed=1, size=16)
        data = {
            "format": "sft",
            "path": str(shapes / "train.jsonl"),
            "eval_path": str(shapes / "heldout.jsonl"),
            "seq_len": 64,
            "images": {"decode_workers": 0},
        }
    cfg = tiny_job(
        str(tmp_path),
        model={"preset": "tiny", "num_layers": 2, **(model or {})},
        data=data,
        parallel={"micro_batch_size": 2, **parallel},
        train={"steps": 6, "eval_interval": 3, "log_interval": 1},
        checkpoint={"interval": 3, "resume": "auto"},
    ).model_dump(mode="json")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return str(path)


def _job(rank: int, world_size: int, config: str, global_config: str, sabotage: str | None) -> dict:
    import os

    from kuangchao_core.comm import order_check
    from kuangchao_core.engine import trainer as trainer_mod
    from kuangchao_core.engine import worker
    from kuangchao_core.hal import stand_in

    os.environ["KC_GLOBAL_CONFIG"] = global_config
    steps: list[tuple[int, int]] = []  # (step before, host reads in the step)
    applied: list[float] = []
    plain_step = trainer_mod.Trainer.train_step

    def counted(self, batches):
        before = stand_in.host_reads()
        out = plain_step(self, batches)
        steps.append((out.step - 1, stand_in.host_reads() - before))
        applied.append(self.lr_scale)
        return out

    trainer_mod.Trainer.train_step = counted
    if sabotage == "host_on_world":  # the pre-fix code path: host coordination on the world (device) group
        from kuangchao_core.comm.group import world_group

        trainer_mod.host_group = world_group
    elif sabotage == "ungrouped_p2p":  # the pre-fix pipeline order: receives posted early, each on its own
        from kuangchao_core.parallel import pp_executor

        pp_executor.GROUP_P2P = False
    codes = [worker.main(["--config", config, "--max-steps", "3"]), worker.main(["--config", config])]
    replay = order_check._replay["model"]
    return {
        "codes": codes,
        "steps": steps,
        "lr_scale": applied,
        "stand_in": stand_in.active(),
        "replayed": dict(replay.replayed) if replay is not None else {},
        "in_flight": replay.in_flight() if replay is not None else None,
    }


def _global_config(tmp_path: Path) -> str:
    from kuangchao_core.perm import guard_api
    from kuangchao_core.perm.audit import AuditLog
    from kuangchao_core.perm.global_config import GlobalConfig

    gc = tmp_path / "global_config.json"
    before = guard_api.current_guard()
    guard_api.install_guard(guard_api.AllowAll())  # a trusted-mode job takes an unsigned change
    try:
        GlobalConfig(gc, "t", audit=AuditLog(tmp_path / "audit.jsonl", "t")).set(
            "lr_scale", 0.5
        )  # `kc config set lr_scale 0.5`, followed from the first step
    finally:
        guard_api.install_guard(before)
    return str(gc)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_whole_job_keeps_nccl_rules(tmp_path, layout):
    parallel, world, model = _layout(layout)
    config = _config(tmp_path, parallel, model)
    gc = _global_config(tmp_path)
    got = run_distributed(_job, world, args=(config, gc, None), init_pg=False, env=RULES, timeout=300)
    for r in got:
        assert r["stand_in"] and r["codes"] == [0, 0]
        assert [s for s, _ in r["steps"]] == [0, 1, 2, 3, 4, 5]  # the second run resumed at step 3
        # the step reads device values once (loss, gradient norm and the finite flag together)
        assert all(reads == 1 for _, reads in r["steps"]), r["steps"]
        # NCCL's stream model replayed the whole job (setup, steps, evaluations, saves, the resume), nothing left
        assert r["replayed"]["collective"] > 0 and r["replayed"]["host"] > 0 and r["in_flight"] == 0, r["replayed"]
        if "pipeline_parallel_size" in parallel or "context_parallel_size" in parallel:
            assert r["replayed"]["grouped"] > 0, r["replayed"]  # the pipeline's exchanges, the ring's
    assert got[0]["lr_scale"] == [0.5] * 6  # the followed change, from the first step of each run
    step_dirs = sorted(p.name for p in (tmp_path / "ckpt").rglob("step_*") if p.is_dir())
    assert step_dirs == ["step_00000003", "step_00000006"]


def test_the_pre_fix_pipeline_order_deadlocks_in_the_stream_model(tmp_path):
    """Receives posted one compute early and sends issued apart (the pre-fix executor) pass on Gloo but would hang
    NCCL at 1F1B's first exchange in both directions: the replay names both ranks and their two receives."""
    config = _config(tmp_path, LAYOUTS["pp2"])
    with pytest.raises(RuntimeError) as info:
        run_distributed(_job, 2, args=(config, _global_config(tmp_path), "ungrouped_p2p"), init_pg=False, env=RULES)
    text = str(info.value)
    assert "NCCL would deadlock" in text and "wait on each other in a cycle" in text, text[-2000:]
    assert "rank 0: recv from rank 1" in text and "rank 1: recv from rank 0" in text, text[-2000:]
    assert "is queued behind" in text, text[-2000:]


def test_host_coordination_on_the_world_group_fails_under_the_rules(tmp_path):
    config = _config(tmp_path, LAYOUTS["dp2"])
    gc = tmp_path / "global_config.json"
    with pytest.raises(RuntimeError) as info:
        run_distributed(_job, 2, args=(config, str(gc), "host_on_world"), init_pg=False, env=RULES, timeout=300)
    assert "broadcast on NCCL group 'world': a (1,) torch.int64 tensor is on cpu" in str(info.value)
