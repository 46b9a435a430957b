"""Run lineages (issue 15): checkpoints of one run never mix with another's; resume picks the right one.

These tests write real checkpoints with the engine's writer (one process) and ask the same planner the flow and
the trainer use. The flow-level tests of a second run are in tests/test_second_run.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kuangchao_core.ckpt.layout import task_of_dir, task_of_step_dir
from kuangchao_core.ckpt.lineage import (
    LEGACY,
    create_lineage,
    list_lineages,
    new_lineage_id,
    plan_resume,
)
from kuangchao_core.ckpt.retention import apply_retention
from kuangchao_core.ckpt.writer import CheckpointWriter
from kuangchao_core.config.settings import lineage_key
from kuangchao_core.errors import CheckpointError
from tests.engine_helpers import tiny_job

pytestmark = pytest.mark.usefixtures("trusted")


def _cfg(tmp_path: Path, **model):
    return tiny_job(str(tmp_path), task={"name": "lin", "seed": 7}, model={"preset": "tiny", **model})


def _save(cfg, lineage: str | None, step: int) -> Path:
    """One intact checkpoint of ``step`` in ``lineage`` (None: the pre-lineage layout)."""
    writer = CheckpointWriter(cfg.checkpoint.dir, cfg.task.name, 0, 1, barrier=lambda: None, lineage=lineage)
    return writer.save(step, {"param.w": torch.full((2,), float(step))}, rng_state={}, state={"step": step})


def _run(cfg, resume: str, steps: list[int]) -> str:
    """What one run does with its checkpoints: plan, create its lineage if new, save ``steps``."""
    plan = plan_resume(lineage_key(cfg), resume)
    if plan.new:
        create_lineage(lineage_key(cfg), plan.lineage, started_from=plan.step_dir)
    for s in steps:
        _save(cfg, plan.lineage, s)
    return plan.lineage


def test_two_runs_with_resume_never_keep_their_checkpoints_apart(tmp_path):
    cfg = _cfg(tmp_path)
    first = _run(cfg, "never", [20, 40])
    second = _run(cfg, "never", [10, 20, 30])
    assert first != second
    task = Path(cfg.checkpoint.dir) / cfg.task.name
    # oldest first by creation time, even when both started within the same second
    assert [lin.name for lin in list_lineages(task)] == [first, second]
    assert [lin.steps() for lin in list_lineages(task)] == [[20, 40], [10, 20, 30]]
    # nothing was moved aside: the second run's step 20 did not touch the first run's step 20
    assert not list(task.glob("**/*.replaced-*"))
    # auto continues the newest lineage (the second run), from its own newest step, not the first run's 40
    plan = plan_resume(lineage_key(cfg), "auto")
    assert (plan.lineage, plan.step, plan.new) == (second, 30, False)
    assert plan.step_dir == str(task / second / "step_00000030")


def test_auto_starts_a_new_lineage_when_model_or_data_changed(tmp_path):
    cfg = _cfg(tmp_path)
    old = _run(cfg, "never", [10])
    other = _cfg(tmp_path, num_layers=3)
    assert lineage_key(other).fingerprint != lineage_key(cfg).fingerprint
    plan = plan_resume(lineage_key(other), "auto")
    assert plan.new and plan.lineage != old and plan.step_dir is None
    assert "fingerprint" in plan.reason
    # steps and lr are not part of the fingerprint: raising train.steps continues the lineage
    longer = tiny_job(str(tmp_path), task={"name": "lin", "seed": 7}, model={"preset": "tiny"}, train={"steps": 99})
    assert plan_resume(lineage_key(longer), "auto").lineage == old


def test_explicit_older_step_forks_instead_of_overwriting_later_steps(tmp_path):
    cfg = _cfg(tmp_path)
    lineage = _run(cfg, "never", [10, 20])
    task = Path(cfg.checkpoint.dir) / cfg.task.name
    newest = plan_resume(lineage_key(cfg), str(task / lineage / "step_00000020"))
    assert (newest.lineage, newest.new) == (lineage, False)
    older = plan_resume(lineage_key(cfg), str(task / lineage / "step_00000010"))
    assert older.new and older.lineage != lineage and older.step == 10
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        plan_resume(lineage_key(cfg), str(task / lineage / "step_00000030"))


def test_pinned_lineage_resumes_only_inside_itself(tmp_path):
    cfg = _cfg(tmp_path)
    other = _run(cfg, "never", [10, 20])
    pinned = new_lineage_id()
    # a flow run's attempt that crashed before its first checkpoint restarts from scratch, not from another run
    plan = plan_resume(lineage_key(cfg), "never", pinned=pinned)
    assert (plan.lineage, plan.step_dir) == (pinned, None)
    # ... or from the checkpoint the run started from
    start = str(Path(cfg.checkpoint.dir) / cfg.task.name / other / "step_00000010")
    assert plan_resume(lineage_key(cfg), start, pinned=pinned).step_dir == start
    create_lineage(lineage_key(cfg), pinned, started_from=start)
    _save(cfg, pinned, 12)
    plan = plan_resume(lineage_key(cfg), start, pinned=pinned)
    assert (plan.lineage, plan.step, plan.new) == (pinned, 12, False)
    info = json.loads((Path(cfg.checkpoint.dir) / cfg.task.name / pinned / "lineage.json").read_text())
    assert info["started_from"] == start and info["fingerprint"] == lineage_key(cfg).fingerprint


def test_pre_lineage_layout_is_read_and_continued_in_a_new_lineage(tmp_path):
    cfg = _cfg(tmp_path)
    legacy_step = _save(cfg, None, 40)
    task = Path(cfg.checkpoint.dir) / cfg.task.name
    assert [lin.name for lin in list_lineages(task)] == [LEGACY]
    plan = plan_resume(lineage_key(cfg), "auto")
    assert plan.new and plan.lineage != LEGACY and plan.step_dir == str(legacy_step) and plan.step == 40


def test_retention_counts_one_lineage_and_never_deletes_the_step_just_written(tmp_path):
    cfg = _cfg(tmp_path)
    first = _run(cfg, "never", [300, 400])
    second = _run(cfg, "never", [20])
    task = Path(cfg.checkpoint.dir) / cfg.task.name
    result = apply_retention(task / second, keep_last=2, protect="step_00000020")
    assert result.deleted == [] and (task / second / "step_00000020").is_dir()
    assert [lin.steps() for lin in list_lineages(task) if lin.name == first] == [[300, 400]]
    # within a lineage the protected step survives even where keep_last would drop it
    _save(cfg, first, 100)
    result = apply_retention(task / first, keep_last=1, protect="step_00000100")
    assert sorted(result.deleted) == ["step_00000300"] and sorted(result.kept) == ["step_00000100", "step_00000400"]


def test_guard_resources_name_the_task_through_a_lineage():
    lineage = new_lineage_id()
    assert task_of_step_dir(f"/ck/demo/{lineage}/step_00000010") == "demo"
    assert task_of_step_dir("/ck/demo/step_00000010") == "demo"
    assert task_of_dir(f"/ck/demo/{lineage}") == "demo" and task_of_dir("/ck/demo") == "demo"
