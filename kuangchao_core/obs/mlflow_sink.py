"""Per-step metrics to MLflow from rank 0, batched on a background thread (off the step's critical path).

The metric names are a contract: ``loss``, ``lr``, ``tokens_per_s``, ``grad_norm``, ``mem_bytes``, ``comm_share``;
``step`` is the optimizer step. A resumed attempt logs each step once: steps already in the run are skipped.
A store locked by another process is waited for (``KC_TRACKING_WAIT_S``, the job's ``tracking.store_wait_s``): the
batch stays queued and every step reaches the run once the lock is gone; a store unusable past that (still locked,
corrupt, unreachable) costs the batch and one warning, never the training or its checkpoints.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

from kuangchao_core import guard_api
from kuangchao_core.errors import TrackingStoreError
from kuangchao_core.obs.tracking_store import DEFAULT_WAIT_S, StoreClient, reason

log = logging.getLogger("kuangchao.obs.mlflow")

METRIC_KEYS = ("loss", "lr", "tokens_per_s", "grad_norm", "mem_bytes", "comm_share")


class MlflowMetricSink:
    """Queues step metrics and logs them with ``MlflowClient.log_batch`` from one background thread.

    Every ``flush_every_s`` the thread writes what is queued in ``log_batch`` calls of whole steps, each of at most
    ``max_metrics`` values (MLflow's limit is 1000 a call): a store's cost is mostly per call (its transaction and
    the run's read), so few large calls keep rank 0's extra work, and the step its peers wait for, small (issue 39).
    Creating a sink needs ``metrics_write`` on ``metrics:<task>`` (raises ``PermissionDenied`` otherwise).
    """

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        *,
        task: str,
        flush_every_s: float = 10.0,
        max_metrics: int = 1000,
        wait_s: float | None = None,
    ):
        guard_api.check("metrics_write", f"metrics:{task}")
        if wait_s is None:
            wait_s = float(os.environ.get("KC_TRACKING_WAIT_S") or DEFAULT_WAIT_S)
        self._wait_s = wait_s  # for a locked store, per write

        self._tracking_uri = tracking_uri
        self._client = None  # made on the thread: importing MLflow and opening its store take seconds
        self.run_id = run_id
        self._queue: queue.Queue = queue.Queue()
        self._flush_every_s = flush_every_s
        self._max_metrics = max_metrics
        self._held: list | None = None  # a step's metrics that did not fit in the last batch: the next one's first
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.last_logged_step = -1  # the run's last logged step, known once the thread has read it
        self._thread = threading.Thread(target=self._loop, name="kc-mlflow-sink", daemon=True)
        self._thread.start()

    def _open(self) -> None:
        """The client and the run's last logged step (the thread's first work, while the job starts)."""
        try:
            self._client = StoreClient(self._tracking_uri, self._wait_s)
            self.last_logged_step = self._last_step_in_run()
        finally:
            self._ready.set()

    def _last_step_in_run(self) -> int:
        try:
            history = self._client.get_metric_history(self.run_id, "loss")
        except Exception as exc:  # an unreachable store must not stop training
            log.warning("could not read metric history of run %s: %s", self.run_id, exc)
            return -1
        return max((m.step for m in history), default=-1)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """Queue one step's metrics; a step already present in the run (from an earlier attempt) is skipped when
        the thread logs it."""
        self._queue.put((step, int(time.time() * 1000), dict(metrics), False))

    def log_final(self, metrics: dict[str, float], step: int) -> None:
        """Queue end-of-run metrics (evaluation results) at ``step``, whatever was logged before."""
        self._queue.put((step, int(time.time() * 1000), dict(metrics), True))

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` as the run's artifact ``artifact_file`` (evaluation samples); a failure is logged, never
        raised (the run goes on)."""
        self._ready.wait(timeout=120 + self._wait_s)
        if self._client is None:
            log.warning("%s not logged: the MLflow store %s was not opened", artifact_file, self._tracking_uri)
            return
        try:
            self._client.log_text(self.run_id, text, artifact_file)
        except Exception as exc:
            log.warning("mlflow log_text %s failed: %s", artifact_file, reason(self._tracking_uri, exc))

    def log_image(self, image: Any, artifact_file: str) -> None:
        """Store ``image`` (uint8 H x W x 3) as the run's artifact ``artifact_file`` (a vision job's evaluation
        samples); a failure is logged, never raised."""
        self._ready.wait(timeout=120 + self._wait_s)
        if self._client is None:
            log.warning("%s not logged: the MLflow store %s was not opened", artifact_file, self._tracking_uri)
            return
        try:
            self._client.log_image(self.run_id, image, artifact_file=artifact_file)
        except Exception as exc:
            log.warning("mlflow log_image %s failed: %s", artifact_file, reason(self._tracking_uri, exc))

    def _drain(self) -> list:
        from mlflow.entities import Metric

        batch: list = []
        while True:
            if self._held is not None:
                step_metrics, self._held = self._held, None
            else:
                try:
                    step, ts, metrics, final = self._queue.get_nowait()
                except queue.Empty:
                    break
                if step <= self.last_logged_step and not final:
                    continue
                step_metrics = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None]
            if batch and len(batch) + len(step_metrics) > self._max_metrics:
                self._held = step_metrics
                break
            batch.extend(step_metrics)
        return batch

    def _loop(self) -> None:
        try:
            self._open()
        except Exception as exc:  # an unreachable store must not stop training
            log.warning("MLflow store %s not opened, no step metrics logged: %s", self._tracking_uri, exc)
            return
        while not self._stop.is_set():
            self._stop.wait(self._flush_every_s)
            self._flush()
        self._flush()

    def _flush(self) -> None:
        while True:
            batch = self._drain()
            if not batch:
                return
            try:  # a locked store: retried until it frees or the wait is over
                self._client.log_batch(self.run_id, metrics=batch)
            except TrackingStoreError as exc:
                log.warning("%d metrics not logged: %s", len(batch), exc)
                return
            except Exception as exc:
                log.warning(
                    "mlflow log_batch failed (%d metrics dropped): %s", len(batch), reason(self._tracking_uri, exc)
                )
                return

    def close(self) -> None:
        """Flush everything queued and stop the thread."""
        self._stop.set()
        self._thread.join(timeout=60 + self._wait_s)
