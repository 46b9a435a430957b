"""After a failed attempt (the work of the Prefect task ``recover``, ``tasks/recover.py``): pick the checkpoint to resume from and record the restart.

The restart's cause is logged, tagged on the MLflow run (``kuangchao.restart.<n>.cause``, ``kuangchao.attempt``) and
counted in the ``restarts`` metric. Per-step losses that the dead attempt computed but whose MLflow batch died with
it are filled in from the resume checkpoint (its ``state.json`` carries the loss of every step), so the run keeps
exactly one ``loss`` value per step.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from kuangchao_core.ckpt.lineage import plan_resume, task_dir
from kuangchao_core.ckpt.reader import read_state
from kuangchao_core.config.settings import lineage_key
from kuangchao_core.obs import tracking

log = logging.getLogger("kuangchao.tasks.recover")


def backfill_losses(cfg: Any, run_id: str, step_dir: Path) -> list[int]:
    """Log the checkpoint's per-step losses that the MLflow run lacks; returns the steps added."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    losses = list(read_state(step_dir).get("losses") or [])
    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg))
    present = {m.step for m in client.get_metric_history(run_id, "loss")}
    now = int(time.time() * 1000)
    missing = [Metric("loss", float(v), now, i + 1) for i, v in enumerate(losses) if i + 1 not in present]
    for i in range(0, len(missing), 900):
        client.log_batch(run_id, metrics=missing[i : i + 900])
    return [m.step for m in missing]


def plan_recovery(
    cfg: Any,
    failed_attempt: int,
    cause: str,
    mlflow_run_id: str | None = None,
    lineage: str | None = None,
    started_from: str | None = None,
) -> dict[str, Any]:
    """The newest intact checkpoint of the run's ``lineage`` (else the checkpoint the run ``started_from``, else a
    fresh start), with the cause logged and recorded on the MLflow run. Without a lineage: the task's newest."""
    if lineage is not None:
        plan = plan_resume(lineage_key(cfg), started_from or "never", pinned=lineage)
        step_dir = Path(plan.step_dir) if plan.step_dir else None
    else:
        key = lineage_key(cfg)
        found = plan_resume(key, "auto") if task_dir(key).exists() else None
        step_dir = Path(found.step_dir) if found and found.step_dir else None
    plan: dict[str, Any] = {
        "failed_attempt": failed_attempt,
        "next_attempt": failed_attempt + 1,
        "cause": cause,
        "resume_from": str(step_dir) if step_dir else None,
        "backfilled_steps": [],
    }
    log.warning(
        "attempt %d failed (%s); restarting as attempt %d from %s",
        failed_attempt,
        cause,
        failed_attempt + 1,
        plan["resume_from"] or "scratch",
    )
    if mlflow_run_id:
        if step_dir is not None:
            plan["backfilled_steps"] = backfill_losses(cfg, mlflow_run_id, step_dir)
        tracking.set_tags(
            cfg,
            mlflow_run_id,
            {
                "kuangchao.attempt": str(failed_attempt + 1),
                f"kuangchao.restart.{failed_attempt + 1}.cause": cause[:5000],
                f"kuangchao.restart.{failed_attempt + 1}.resume_from": plan["resume_from"] or "scratch",
            },
        )
        tracking.log_metrics(cfg, mlflow_run_id, {"restarts": failed_attempt + 1}, step=failed_attempt + 1)
    return plan
