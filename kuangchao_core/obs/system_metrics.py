"""CPU, memory (and GPU, where there is one) of each node of a job in its MLflow run (issue 13, item 6), through
MLflow's own system-metrics monitor: one monitor per node (the node's first rank), its metrics named
``system/<node>/<metric>`` (``cpu_utilization_percentage``, ``system_memory_usage_megabytes``, …). Its first sample
waits for a locked store (``KC_TRACKING_WAIT_S``); a store unusable past that costs the system metrics and one
warning, never the run."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from kuangchao_core import guard_api
from kuangchao_core.obs.tracking_store import DEFAULT_WAIT_S, call, reason

log = logging.getLogger("kuangchao.obs.system_metrics")


class SystemMetrics:
    """MLflow's monitor, started on a thread of its own (importing MLflow takes seconds the job's start-up need
    not wait for); :meth:`finish` stops it."""

    def __init__(self, tracking_uri: str, run_id: str, node: str, interval_s: float):
        self._args = (tracking_uri, run_id, node, max(0.1, float(interval_s)))
        self._monitor: Any = None
        self._starter = threading.Thread(target=self._start, name="kc-system-metrics", daemon=True)
        self._starter.start()

    def _start(self) -> None:
        uri, run_id, node, interval = self._args
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        except ImportError as exc:  # psutil missing: the run goes on without them
            log.warning("system metrics not logged: %s", exc)
            return
        wait_s = float(os.environ.get("KC_TRACKING_WAIT_S") or DEFAULT_WAIT_S)

        def first_sample() -> Any:
            monitor = SystemMetricsMonitor(run_id, sampling_interval=interval, node_id=node, tracking_uri=uri)
            # a first sample now: MLflow's loop logs only after an interval, which a short job may not outlive
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            return monitor

        try:
            monitor = call(uri, first_sample, wait_s=wait_s, say=log.warning, what="system metrics")
        except Exception as exc:  # the store unusable (TrackingStoreError) or MLflow's monitor failing: not the run
            log.warning("system metrics not logged: %s", reason(uri, exc))
            return
        monitor.start()
        self._monitor = monitor

    def finish(self) -> None:
        """Stop sampling (after the start, if it is still under way)."""
        self._starter.join(timeout=120)
        if self._monitor is not None:
            self._monitor.finish()


def start_system_metrics(
    tracking_uri: str, run_id: str, node: str, task: str, interval_s: float = 10.0
) -> SystemMetrics:
    """Start sampling this machine into run ``run_id`` as ``node`` (``metrics_write`` on ``metrics:<task>`` first,
    at once); returns the monitor (call ``finish()`` at the end)."""
    guard_api.check("metrics_write", f"metrics:{task}")
    return SystemMetrics(tracking_uri, run_id, node, interval_s)
