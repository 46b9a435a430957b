"""Checkpoints that do not stop training (issue 13, ``checkpoint.async: true``), in real Gloo processes:

- a run checkpointed in the background and resumed continues bitwise as the uninterrupted synchronous run (the
  snapshot is taken before training changes the tensors; the RNG and sampler state with it) — the control is the
  same comparison's own tolerance: exact equality;
- a rank killed while its background write is in progress leaves a temporary directory only: the newest intact
  checkpoint is the previous one;
- a background write that fails ends the run at the next step with the error;
- the save really is in the background: step 3 trains while step 2's files are still being written (the control:
  the same save run in the caller, as a synchronous save would, fails that check).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kuangchao_core.ckpt.lineage import new_lineage_id
from kuangchao_core.ckpt.reader import find_latest_intact
from tests.engine_helpers import run_trainers, tiny_job, trainer_in_process
from tests.mp import run_distributed


def _job(root: Path, name: str, asynchronous: bool):
    return tiny_job(
        str(root),
        task={"name": name, "seed": 5},
        parallel={"data_parallel_size": 2},
        train={"steps": 6},
        checkpoint={"interval": 2, "keep_last": 5, "async": asynchronous},
    )


def test_async_checkpoints_resume_bitwise_like_synchronous_ones(tmp_path):
    lineage = new_lineage_id()
    reference = _job(tmp_path / "sync", "ck", False)
    background = _job(tmp_path / "async", "ck", True)
    jobs = [
        {"cfg": reference},
        {"cfg": background, "max_steps": 4, "lineage": lineage},  # stops after its step-4 save is published
        {"cfg": background, "resume": "auto", "lineage": lineage},
    ]
    ref, first, resumed = run_distributed(run_trainers, 2, args=(jobs,), timeout=300)[0]
    steps = sorted(p.name for p in (tmp_path / "async" / "ckpt" / "ck" / lineage).glob("step_*"))
    assert steps == ["step_00000002", "step_00000004", "step_00000006"]
    assert resumed["steps_run"] == 2, "the resumed run continues after step 4"
    assert resumed["losses"][-2:] == ref["losses"][-2:]
    for name, value in ref["params"].items():
        assert np.array_equal(resumed["params"][name], value), f"{name} differs after the async resume"
    assert first["losses"] == ref["losses"][:4]


WRITE_WAIT_S = 10.0  # how long step 2's write waits for step 3 to start (a synchronous save waits it out)


def _write_while_training(rank, world_size, cfg, synchronous):
    """Train with step 2's file write held until step 3 starts (or WRITE_WAIT_S passes); what the write saw."""
    import threading
    import types

    if synchronous:  # the sabotage: the "background" thread runs in the caller before start() returns
        from kuangchao_core.ckpt import async_save

        class InCaller:
            def __init__(self, target, args=(), **_):
                self.run = lambda: target(*args)

            def start(self):
                self.run()

            def join(self):
                return None

        async_save.threading = types.SimpleNamespace(Thread=InCaller)
    trainer = trainer_in_process(cfg, rank, world_size, timeout_ms=60_000)
    step_three = threading.Event()
    seen: dict = {}
    writer, write = trainer.checkpoints.writer, trainer.checkpoints.writer.write_files

    def held(plan, _write=write):
        if plan.step == 2:
            seen["step_3_started_during_write"] = step_three.wait(WRITE_WAIT_S)
            seen["writer_thread"] = threading.current_thread().name
        _write(plan)

    step, calls = trainer.train_step, [0]

    def counting(batches, _step=step):
        calls[0] += 1
        if calls[0] == 3:
            step_three.set()
        return _step(batches)

    writer.write_files = held
    trainer.train_step = counting
    trainer.run(resume="never")
    return seen


def _assert_saved_in_the_background(seen: dict) -> None:
    assert seen["step_3_started_during_write"], f"step 3 did not start while step 2 was written: {seen}"
    assert seen["writer_thread"] != "MainThread", seen


def _background_run(tmp_path: Path, synchronous: bool) -> dict:
    cfg = tiny_job(str(tmp_path), task={"name": "bg"}, train={"steps": 4}, checkpoint={"interval": 2, "async": True})
    [seen] = run_distributed(_write_while_training, 1, args=(cfg, synchronous), timeout=180)
    return seen


def test_an_async_save_writes_while_the_next_steps_train(tmp_path):
    _assert_saved_in_the_background(_background_run(tmp_path, synchronous=False))


def test_negative_control_a_synchronous_save_fails_the_background_check(tmp_path):
    seen = _background_run(tmp_path, synchronous=True)
    with pytest.raises(AssertionError):
        _assert_saved_in_the_background(seen)


def _killed_mid_write(rank, world_size, cfg, how):
    import os
    import signal

    from kuangchao_core.errors import CheckpointError

    trainer = trainer_in_process(cfg, rank, world_size, timeout_ms=60_000)
    writer = trainer.checkpoints.writer
    write = writer.write_files

    def failing(plan, _write=write):
        if plan.step == 4:
            _write(plan)  # the shard is on disk, the step is not published
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError("disk full")
        _write(plan)

    writer.write_files = failing
    try:
        trainer.run(resume="never")
    except CheckpointError as exc:
        return {"error": str(exc), "step": trainer.state.step}
    return {"error": None, "step": trainer.state.step}


@pytest.mark.parametrize("how", ["kill", "error"])
def test_a_background_write_that_dies_or_fails_leaves_the_previous_checkpoint(tmp_path, how):
    cfg = tiny_job(
        str(tmp_path), task={"name": f"ck-{how}"}, train={"steps": 6}, checkpoint={"interval": 2, "async": True}
    )
    if how == "kill":
        with pytest.raises(RuntimeError):  # the rank is gone
            run_distributed(_killed_mid_write, 1, args=(cfg, how), timeout=180)
    else:
        [out] = run_distributed(_killed_mid_write, 1, args=(cfg, how), timeout=180)
        # the failure surfaces at a step's check or, at the latest, at the next save (step 6), which waits for it
        assert out["error"] and "disk full" in out["error"] and out["step"] in (4, 5, 6), out
    [lineage] = [p for p in (tmp_path / "ckpt" / f"ck-{how}").iterdir() if p.is_dir()]
    newest = find_latest_intact(lineage)
    assert newest is not None and newest.name == "step_00000002", newest
    assert any(".tmp-" in p.name for p in lineage.iterdir()), "the torn step stays a temporary directory"
