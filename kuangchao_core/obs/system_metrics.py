"""CPU, memory (and GPU, where there is one) of each node of a job in its MLflow run (issue 13, item 6), through
MLflow's own system-metrics monitor: one monitor per node (the node's first rank), its metrics named
``system/<node>/<metric>`` (``cpu_utilization_percentage``, ``system_memory_usage_megabytes``, …)."""

from __future__ import annotations

import logging
from typing import Any

from kuangchao_core import guard_api

log = logging.getLogger("kuangchao.obs.system_metrics")


def start_system_metrics(tracking_uri: str, run_id: str, node: str, task: str, interval_s: float = 10.0) -> Any:
    """Start sampling this machine into run ``run_id`` as ``node`` (``metrics_write`` on ``metrics:<task>`` first);
    returns the monitor (call ``finish()`` at the end) or None when MLflow cannot sample here."""
    guard_api.check("metrics_write", f"metrics:{task}")
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    except ImportError as exc:  # psutil missing: the run goes on without them
        log.warning("system metrics not logged: %s", exc)
        return None
    monitor = SystemMetricsMonitor(
        run_id, sampling_interval=max(0.1, float(interval_s)), node_id=node, tracking_uri=tracking_uri
    )
    monitor.start()
    return monitor
