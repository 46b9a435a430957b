"""One writer per lineage (issue 26, item 1) and a full disk that ends a save cleanly (item 5).

Attacks stopped:
- after ``kill -9`` of ``kc train`` its workers kept writing the lineage that ``kc train --resume auto`` then chose:
  ``step_N`` beside ``step_N.replaced-…`` and each one's retention deleting the other's steps. Now the resumed run
  takes the lineage's lease with a new generation, and the stale writer's publish and retention are refused; a run
  that finds a live holder waits for it, or forks, and says so.
- a deterministic ENOSPC was retried twice and left three temporary step directories. Now it is ``DiskFull``: the
  temporary step is removed, the last good checkpoint stays, and the restart policy does not retry it.

The writers are the engine's real ``CheckpointWriter`` (one process); the lease file is the one the flow takes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from kuangchao_core.ckpt.integrity import find_latest_intact, verify_checkpoint
from kuangchao_core.ckpt.lineage import create_lineage, lineage_dir, plan_resume
from kuangchao_core.ckpt.lineage_hold import hold_lineage
from kuangchao_core.ckpt.lineage_lease import (
    LeaseClockFault,
    LeaseHeld,
    LeaseKeeper,
    StaleWriter,
    read_lease,
    release_lease,
    take_lease,
)
from kuangchao_core.ckpt.storage import DiskFull, LocalStorage
from kuangchao_core.ckpt.writer import CheckpointWriter
from kuangchao_core.config.settings import lineage_key
from kuangchao_core.errors import CheckpointError, WorkerFailed
from kuangchao_core.sched.recovery import RestartPolicy
from tests.engine_helpers import tiny_job

pytestmark = pytest.mark.usefixtures("trusted")


def _cfg(tmp_path: Path):
    return tiny_job(str(tmp_path), task={"name": "lease", "seed": 7})


def _writer(cfg, lineage: str, generation: int | None, keep_last: int | None = None, storage=None):
    return CheckpointWriter(
        cfg.checkpoint.dir,
        cfg.task.name,
        0,
        1,
        barrier=lambda: None,
        lineage=lineage,
        generation=generation,
        keep_last=keep_last,
        storage=storage,
        attempt_id=f"g{generation}",
    )


def _save(writer: CheckpointWriter, step: int, size: int = 4) -> Path:
    return writer.save(step, {"param.w": torch.full((size,), float(step))}, rng_state={}, state={"step": step})


def test_a_resumed_run_fences_the_stale_writer_of_its_lineage(tmp_path):
    cfg = _cfg(tmp_path)
    plan = plan_resume(lineage_key(cfg), "never")
    create_lineage(lineage_key(cfg), plan.lineage)
    path = lineage_dir(lineage_key(cfg), plan.lineage)
    first = take_lease(path, "run-A")
    stale = _writer(cfg, plan.lineage, first.generation, keep_last=1)
    _save(stale, 10)  # run A writes while it holds the lineage

    # run A's orchestrator dies (no renewal); run B resumes the same lineage once the lease is stale
    time.sleep(0.3)
    resumed = plan_resume(lineage_key(cfg), "auto")
    assert (resumed.lineage, resumed.step) == (plan.lineage, 10)
    second = take_lease(path, "run-B", stale_after_s=0.2)
    assert second.generation == first.generation + 1
    fresh = _writer(cfg, plan.lineage, second.generation, keep_last=1)
    _save(fresh, 20)

    # A's ranks are still running: their next step is refused, nothing of B's is moved aside or deleted
    with pytest.raises(StaleWriter, match=r"generation 1 .* run run-B holds it at generation 2"):
        _save(stale, 20)
    with pytest.raises(StaleWriter):
        _save(stale, 30)
    with pytest.raises(StaleWriter, match="retention refused"):
        stale.check_lease("retention")
    steps = sorted(p.name for p in path.iterdir() if p.name.startswith("step_"))
    assert [s for s in steps if ".tmp-" not in s] == ["step_00000020"], steps
    assert verify_checkpoint(path / "step_00000020") == []
    assert (read_lease(path)["owner"], read_lease(path)["generation"]) == ("run-B", 2)  # B's lease stands

    # negative control: a writer without a generation (no lease checked) would have overwritten the lineage
    unfenced = _writer(cfg, plan.lineage, None)
    _save(unfenced, 30)
    assert (path / "step_00000030").is_dir()


def test_a_run_waits_for_a_live_holder_then_forks_and_says_so(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    plan = plan_resume(lineage_key(cfg), "never")
    create_lineage(lineage_key(cfg), plan.lineage)
    _save(_writer(cfg, plan.lineage, None), 5)
    path = lineage_dir(lineage_key(cfg), plan.lineage)
    holder = take_lease(path, "run-A")
    keeper = LeaseKeeper(holder, interval_s=0.1)
    keeper.start()
    said: list[str] = []
    try:
        with pytest.raises(LeaseHeld, match="being written by run run-A"):
            take_lease(path, "run-B", stale_after_s=1.0, wait_s=1.5, say=said.append)
        assert said and "waiting up to 1.5 s" in said[0]
        resumed = plan_resume(lineage_key(cfg), "auto")
        forked, lease = hold_lineage(lineage_key(cfg), resumed, "run-B", said.append, stale_after_s=1.0, wait_s=0.5)
    finally:
        keeper.stop()
    assert forked.lineage != plan.lineage and forked.new
    assert forked.step == 5 and forked.step_dir == str(lineage_dir(lineage_key(cfg), forked.lineage) / "step_00000005")
    assert verify_checkpoint(forked.step_dir) == []  # the fork's own (linked) copy of the step it resumes
    assert any("forks a new lineage" in s for s in said)
    assert lease.path == lineage_dir(lineage_key(cfg), forked.lineage) and read_lease(lease.path)["owner"] == "run-B"
    assert read_lease(path)["owner"] == "run-A"
    # the holder released at its end: the next run takes the lineage at once, with the next generation, and says it
    # was released, not "last renewed 1.8e9 s ago" (issue 45: a released lease's renewal time is 0)
    release_lease(holder)
    with caplog.at_level(logging.INFO, logger="kuangchao.ckpt"):
        assert take_lease(path, "run-C", wait_s=0).generation == holder.generation + 1
    said = [r.getMessage() for r in caplog.records]
    assert any("run run-A released it" in m for m in said) and not any("last renewed" in m for m in said), said


def _small_tmpfs(where: Path, size: str) -> Path:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    return where


def test_a_full_disk_fails_once_removes_the_temporary_step_and_keeps_the_last_good(tmp_path):
    disk = _small_tmpfs(tmp_path / "disk", "256k")
    try:
        storage = LocalStorage(disk)
        writer = CheckpointWriter(disk, "task", 0, 1, barrier=lambda: None, storage=storage, attempt_id="a")
        good = _save(writer, 1, size=1024)  # 4 KiB of weights
        with pytest.raises(DiskFull, match="free space there") as caught:
            _save(writer, 2, size=512 * 1024)  # 2 MiB: a real ENOSPC from the kernel
        assert verify_checkpoint(good) == []
        leftovers = [p.name for p in (disk / "task").iterdir() if p.name != good.name]
        assert leftovers == [], f"the failed save left {leftovers}"
        assert find_latest_intact(disk / "task") == good
        # the worker's failure as the launcher reports it is not retried (it was retried twice before)
        failed = WorkerFailed(0, f"{type(caught.value).__name__}: {caught.value}", 1)
        assert not RestartPolicy(max_restarts=2).retryable(failed)
        assert RestartPolicy(max_restarts=2).retryable(WorkerFailed(0, "killed by SIGKILL", -9))  # control
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_the_storage_names_only_space_errors_disk_full(tmp_path):
    storage = LocalStorage(tmp_path)

    def fill(path, code):
        raise OSError(code, os.strerror(code))

    with pytest.raises(DiskFull):
        storage.write_with("a/b", lambda p: fill(p, errno.EDQUOT))
    with pytest.raises(PermissionError):
        storage.write_with("a/c", lambda p: fill(p, errno.EACCES))
    assert not list((tmp_path / "a").iterdir())


def _lease_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run-x"
    path.mkdir()
    return path


def test_a_fifo_lease_is_refused_without_hanging(tmp_path):
    import faulthandler
    import threading

    path = _lease_dir(tmp_path)
    fifo = path / "owner.json"
    os.mkfifo(fifo)
    faulthandler.dump_traceback_later(20, exit=True)  # a regression fails the run instead of hanging the suite
    try:
        with pytest.raises(CheckpointError, match="owner.json: the lineage's lease is not a regular file"):
            read_lease(path)
        with pytest.raises(CheckpointError, match="not a regular file"):
            take_lease(path, "run-B", wait_s=0)
    finally:
        faulthandler.cancel_dump_traceback_later()
    # negative control: the plain open() the lease was read with before blocks on the FIFO until a writer appears
    blocked = threading.Thread(target=lambda: open(fifo, "rb").close(), daemon=True)
    blocked.start()
    blocked.join(0.5)
    assert blocked.is_alive()
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer end: the blocked open returns, the thread ends
    blocked.join(5)
    assert not blocked.is_alive()


def test_a_symlinked_lease_is_refused(tmp_path):
    path = _lease_dir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    take_lease(elsewhere, "run-A")
    (path / "owner.json").symlink_to(elsewhere / "owner.json")
    with pytest.raises(CheckpointError, match="a symbolic link: refused"):
        read_lease(path)
    with pytest.raises(CheckpointError, match="symbolic link"):
        take_lease(path, "run-B", wait_s=0)
    # negative control: the record the link points at is a valid lease; only the link is refused
    assert read_lease(elsewhere)["owner"] == "run-A"


def test_a_renewal_in_the_future_is_a_clock_fault_not_a_live_holder(tmp_path):
    path = _lease_dir(tmp_path)
    holder = take_lease(path, "run-A")
    record = read_lease(path)
    record["renewed_ns"] = time.time_ns() + 3600 * 10**9  # the holder's clock jumped an hour ahead
    (path / "owner.json").write_text(json.dumps(record), encoding="utf-8")
    with pytest.raises(
        LeaseClockFault, match=r"owner\.json: run run-A renewed the lease at .*Z, 3[56]\d\d\.\d s after"
    ):
        take_lease(path, "run-B", wait_s=0)
    # negative control: without the check (pre-fix) the same record is a live holder, renewed "-3600 s ago"
    with pytest.raises(LeaseHeld, match="renewed -3[56]\\d\\d"):
        take_lease(path, "run-B", wait_s=0, skew_s=float("inf"))
    # within the skew allowance a renewal slightly ahead is still a live holder; its own owner takes it back
    record["renewed_ns"] = time.time_ns() + 10**9
    (path / "owner.json").write_text(json.dumps(record), encoding="utf-8")
    with pytest.raises(LeaseHeld):
        take_lease(path, "run-B", wait_s=0)
    assert take_lease(path, "run-A").generation == holder.generation + 1


def test_a_racing_resume_never_forks_from_a_step_the_live_writer_deleted(tmp_path):
    cfg = _cfg(tmp_path)
    key = lineage_key(cfg)
    plan = plan_resume(key, "never")
    create_lineage(key, plan.lineage)
    path = lineage_dir(key, plan.lineage)
    holder = take_lease(path, "run-A")
    live = _writer(cfg, plan.lineage, holder.generation, keep_last=1)
    _save(live, 5)
    keeper = LeaseKeeper(holder, interval_s=0.1)
    keeper.start()
    said: list[str] = []
    try:
        resumed = plan_resume(key, "auto")  # run B chooses step 5 before its lease wait ...
        assert resumed.step == 5
        _save(live, 10)  # ... meanwhile run A's keep_last removes it
        assert not Path(resumed.step_dir).exists()
        forked, lease = hold_lineage(key, resumed, "run-B", said.append, stale_after_s=1.0, wait_s=0.3)
        assert forked.lineage != plan.lineage and forked.step == 10
        assert Path(forked.step_dir).parent == lease.path and verify_checkpoint(forked.step_dir) == []
        _save(live, 15)  # A's retention removes step 10 too: the fork's pinned copy stays intact
        assert not (path / "step_00000010").exists() and verify_checkpoint(forked.step_dir) == []
        worker = plan_resume(key, forked.step_dir, pinned=forked.lineage)  # what the fork's ranks resume from
        assert worker.step_dir == forked.step_dir
        # negative control: the pre-fix fork (an empty lineage resuming the step chosen before the wait) resumes a
        # directory that no longer exists, which failed every attempt
        create_lineage(key, "run-20990101T000000Z-000000")
        stale = plan_resume(key, resumed.step_dir, pinned="run-20990101T000000Z-000000")
        assert not Path(stale.step_dir).exists()

        # every step of the busy lineage gone: a clear error, and no empty fork left behind
        before = {p.name for p in path.parent.iterdir()}
        shutil.rmtree(path / "step_00000015")
        with pytest.raises(CheckpointError, match="were deleted while this run tried to fork from them"):
            hold_lineage(key, resumed, "run-C", said.append, stale_after_s=1.0, wait_s=0.3)
        assert {p.name for p in path.parent.iterdir()} == before
    finally:
        keeper.stop()


def test_a_takeover_resumes_the_newest_step_once_it_holds_the_lineage(tmp_path):
    cfg = _cfg(tmp_path)
    key = lineage_key(cfg)
    plan = plan_resume(key, "never")
    create_lineage(key, plan.lineage)
    path = lineage_dir(key, plan.lineage)
    old = take_lease(path, "run-A")
    live = _writer(cfg, plan.lineage, old.generation, keep_last=1)
    _save(live, 10)
    resumed = plan_resume(key, "auto")
    _save(live, 20)  # step 10 removed between B's choice and its takeover
    time.sleep(0.3)
    said: list[str] = []
    taken, lease = hold_lineage(key, resumed, "run-B", said.append, stale_after_s=0.2, wait_s=1.0)
    assert (taken.lineage, taken.step, lease.generation) == (plan.lineage, 20, old.generation + 1)
    assert taken.step_dir == str(path / "step_00000020") and any("resuming from" in s for s in said)
    assert not Path(resumed.step_dir).exists()  # negative control: the step chosen before the wait is gone
