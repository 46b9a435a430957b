"""Prefect task ``recover``: after a failed attempt, pick the checkpoint to resume from and record the restart."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import task

from kuangchao_core.ckpt.reader import find_latest_intact
from kuangchao_core.obs import tracking

log = logging.getLogger("kuangchao.tasks.recover")


def plan_recovery(cfg: Any, failed_attempt: int, cause: str, mlflow_run_id: str | None = None) -> dict[str, Any]:
    """Newest intact checkpoint (or a fresh start), with the cause logged and tagged on the MLflow run."""
    task_dir = Path(cfg.checkpoint.dir) / cfg.task.name
    step_dir = find_latest_intact(task_dir) if task_dir.exists() else None
    plan = {
        "failed_attempt": failed_attempt,
        "next_attempt": failed_attempt + 1,
        "cause": cause,
        "resume_from": str(step_dir) if step_dir else None,
    }
    log.warning("attempt %d failed (%s); resuming from %s", failed_attempt, cause, plan["resume_from"] or "scratch")
    if mlflow_run_id:
        tracking.set_tags(
            cfg,
            mlflow_run_id,
            {
                "kuangchao.attempt": str(failed_attempt + 1),
                f"kuangchao.restart.{failed_attempt + 1}.cause": cause[:5000],
            },
        )
        tracking.log_metrics(cfg, mlflow_run_id, {"restarts": failed_attempt + 1}, step=failed_attempt + 1)
    return plan


@task(name="recover", retries=0)
def recover(cfg: Any, failed_attempt: int, cause: str, mlflow_run_id: str | None = None) -> dict[str, Any]:
    """Prefect task: see :func:`plan_recovery`."""
    return plan_recovery(cfg, failed_attempt, cause, mlflow_run_id)
