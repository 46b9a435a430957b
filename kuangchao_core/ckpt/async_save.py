"""Checkpoints that do not stop training (``checkpoint.async: true``).

:meth:`AsyncSaver.start` snapshots the rank's tensors into host memory of their own, creates the step's temporary
directory (one barrier, the only collective), and returns; a background thread then writes the rank's files
(fsynced) and a marker ``.done/rank_<r>`` beside them. Rank 0's thread waits until every rank's marker is there,
writes the manifest — last, as in a synchronous save — and publishes the step with the atomic rename, then applies
retention and calls ``on_commit``. There are no collectives in the background (they would race the training's), and
at most one save is in flight: the next :meth:`start` (and :meth:`wait`) first waits for the previous one. A failed
background write is raised by the rank's next :meth:`check` / :meth:`start` / :meth:`wait`, which ends that rank and
with it the job; a rank killed mid-write leaves only a temporary directory, never a step, so the newest intact
checkpoint is still the previous one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kuangchao_core.ckpt.layout import step_dir_name
from kuangchao_core.ckpt.lineage_lease import StaleWriter
from kuangchao_core.ckpt.storage import DiskFull
from kuangchao_core.ckpt.writer import CheckpointWriter, SavePlan
from kuangchao_core.errors import CheckpointError

log = logging.getLogger("kuangchao.ckpt.async_save")


DONE = ".done"  # the markers' directory, removed before the manifest lists the step's files


def _marker(rank: int) -> str:
    return f"{DONE}/rank_{rank:05d}"


class AsyncSaver:
    """Background saves through ``writer`` (its ``barrier`` is used once per save, in :meth:`start`)."""

    def __init__(self, writer: CheckpointWriter, commit_timeout_s: float = 3600.0):
        self.writer = writer
        self.commit_timeout_s = commit_timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stall_s: list[float] = []  # time each start() kept the caller, for the benchmark and the logs

    def start(self, step: int, tensors, rng_state, *, on_commit: Callable[[Path], Any] | None = None, **kw) -> None:
        """Snapshot and begin writing checkpoint ``step`` (arguments as ``CheckpointWriter.save``); collective."""
        t0 = time.perf_counter()
        self.wait()
        plan = self.writer.plan_save(step, tensors, rng_state, copy=True, **kw)
        self.writer.open_step(plan)
        if self.writer.rank == 0:
            self.writer.storage.make_dir(f"{plan.tmp_key}/{DONE}")
        self.writer.barrier()
        self._thread = threading.Thread(target=self._write, args=(plan, on_commit), name=f"kc-ckpt-{step}", daemon=True)
        self._thread.start()
        self.stall_s.append(time.perf_counter() - t0)

    def _write(self, plan: SavePlan, on_commit) -> None:
        w, st = self.writer, self.writer.storage
        try:
            w.write_files(plan)
            st.write_bytes(f"{plan.tmp_key}/{_marker(w.rank)}", b"")
            if w.rank != 0:
                return
            deadline = time.monotonic() + self.commit_timeout_s
            while not all(st.exists(f"{plan.tmp_key}/{_marker(r)}") for r in range(w.world_size)):
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"step {plan.step}: not every rank finished writing in {self.commit_timeout_s}s"
                    )
                time.sleep(0.01)
            st.remove_tree(f"{plan.tmp_key}/{DONE}")
            w.commit(plan)
            w.retain(plan)
            if on_commit is not None:
                on_commit(w.task_dir / step_dir_name(plan.step))
        except BaseException as exc:  # raised in the training thread at its next check
            log.error("background checkpoint of step %d failed: %s", plan.step, exc)
            if isinstance(exc, DiskFull):
                w.abandon(plan)
            self._error = exc

    def check(self) -> None:
        """Raise the error of a failed background save (call once per step)."""
        if self._error is not None:
            exc, self._error = self._error, None
            if isinstance(exc, (DiskFull, StaleWriter)):  # their kind decides that the job is not retried
                raise exc
            raise CheckpointError(f"background checkpoint failed: {exc}") from exc

    def wait(self) -> None:
        """Wait for the save in flight (if any) and raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()
