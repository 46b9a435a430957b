"""Read a job's training metrics back from MLflow, for the monitor module and ``kc debug`` (L5.2: metrics read).

Every call first passes ``metrics_read`` on ``metrics:<task>`` through the installed guard, before any request to
the tracking store. The run must then belong to that task: a run tagged ``kuangchao.task`` with another task name
needs ``metrics_read`` on that task too, so a monitor scoped to one job cannot read another job's run by its id.
"""

from __future__ import annotations

from typing import Any

from kuangchao_core import guard_api
from kuangchao_core.errors import KuangchaoError

TASK_TAG = "kuangchao.task"


def _client_for(tracking_uri: str, run_id: str, task: str):
    guard_api.check("metrics_read", f"metrics:{task}")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        raise KuangchaoError(f"cannot read MLflow run {run_id!r} at {tracking_uri}: {exc}") from None
    owner = run.data.tags.get(TASK_TAG)
    if owner is not None and owner != task:
        guard_api.check("metrics_read", f"metrics:{owner}")
    return client, run


def read_metrics(tracking_uri: str, run_id: str, key: str, *, task: str) -> list[tuple[int, float]]:
    """The ``(step, value)`` history of metric ``key`` of run ``run_id`` of job ``task``, sorted by step.

    Raises ``PermissionDenied`` without contacting MLflow unless the guard grants ``metrics_read`` on
    ``metrics:<task>``.
    """
    client, _ = _client_for(tracking_uri, run_id, task)
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def read_run_summary(tracking_uri: str, run_id: str, *, task: str) -> dict[str, Any]:
    """Status, times, layout tag and the latest value of every metric of run ``run_id`` of job ``task``.

    Returns ``{"run_id", "task", "status", "start_time", "end_time", "layout", "attempt", "metrics"}`` with times in
    ms since the epoch (``end_time`` None while running) and ``metrics`` mapping each key to its latest value.
    Same permission rule as :func:`read_metrics`.
    """
    _, run = _client_for(tracking_uri, run_id, task)
    tags = run.data.tags
    return {
        "run_id": run.info.run_id,
        "task": tags.get(TASK_TAG, task),
        "status": run.info.status,
        "start_time": run.info.start_time,
        "end_time": run.info.end_time,
        "layout": tags.get("kuangchao.layout"),
        "attempt": tags.get("kuangchao.attempt"),
        "metrics": dict(run.data.metrics),
    }
