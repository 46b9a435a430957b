"""Prefect task ``recover``: after a failed attempt, pick the checkpoint to resume from and record the restart
(:func:`kuangchao_core.job.recovery.plan_recovery`)."""

from __future__ import annotations

from typing import Any

from prefect import task

from kuangchao_core.job.recovery import plan_recovery
from tasks.retry_policy import TRANSIENT_RETRIES


@task(name="recover", **TRANSIENT_RETRIES)
def recover(
    cfg: Any,
    failed_attempt: int,
    cause: str,
    mlflow_run_id: str | None = None,
    lineage: str | None = None,
    started_from: str | None = None,
) -> dict[str, Any]:
    """Prefect task: see :func:`plan_recovery`."""
    return plan_recovery(cfg, failed_attempt, cause, mlflow_run_id, lineage, started_from)
