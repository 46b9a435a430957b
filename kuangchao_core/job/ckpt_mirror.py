"""Checkpoints mirrored to S3 while the job runs: every checkpoint a job saves reaches ``checkpoint.uri`` soon after,
so a job that dies has its last checkpoint there (not only a job that finished).

The orchestrator holds the S3 credentials (workers never get them): the launch task's event listener
(:class:`~kuangchao_core.job.job_events.JobEvents`) hands each ``checkpoint`` event of the ranks to the run's
:class:`CheckpointMirror`, whose one background thread uploads every intact step of the lineage that S3 does not
hold yet (:func:`~kuangchao_core.job.checkpoints.upload_intact`: idempotent, a torn step is never sent). The flow owns the mirror
across attempts and drains it before its final ``checkpoint`` task and when it fails.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

log = logging.getLogger("kuangchao.tasks.ckpt_mirror")
_MIRRORS: dict[str, CheckpointMirror] = {}
_SWEEP = -1  # a queued request for every intact step, announced or not


class CheckpointMirror:
    """Uploads the lineage's new intact checkpoints in the background, one request at a time."""

    def __init__(self, cfg: Any, lineage: str, settings: Any = None):
        self.cfg = cfg
        self.lineage = lineage
        self.settings = settings
        self.uploaded: dict[int, str] = {}
        self.errors: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="kc-ckpt-mirror", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        """A checkpoint of ``step`` was saved: mirror it (and any earlier one S3 lacks)."""
        self._queue.put(int(step))

    def _work(self) -> None:
        from kuangchao_core.job.checkpoints import upload_intact

        while True:
            step = self._queue.get()
            if step is None:
                return
            try:
                self.uploaded.update(upload_intact(self.cfg, self.settings, lineage=self.lineage))
                if step != _SWEEP:
                    log.info(
                        "checkpoint step %d mirrored to %s", step, self.uploaded.get(step, self.cfg.checkpoint.uri)
                    )
            except Exception as exc:  # the job goes on; the flow's final checkpoint task tries again
                self.errors.append(f"step {step}: {exc}")
                log.warning("checkpoint step %d not mirrored to S3 yet: %s", step, exc)

    def close(self, timeout_s: float = 600.0) -> None:
        """Finish the uploads queued so far, upload every intact step S3 still lacks (a rank killed right after a
        save never announced it), and stop (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(_SWEEP)
            self._queue.put(None)
            self._thread.join(timeout=timeout_s)


def register_mirror(run_dir: str, mirror: CheckpointMirror | None) -> None:
    """Remember (or, with None, forget) the mirror of the run in ``run_dir`` for the tasks of this process."""
    if mirror is None:
        _MIRRORS.pop(str(run_dir), None)
    else:
        _MIRRORS[str(run_dir)] = mirror


def mirror_for(run_dir: str) -> CheckpointMirror | None:
    """The mirror registered for ``run_dir`` in this process, if any."""
    return _MIRRORS.get(str(run_dir))
