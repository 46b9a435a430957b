"""Prefect tasks around checkpoints (the work is in :mod:`kuangchao_core.job.checkpoints`).

``checkpoint`` (after the last attempt) verifies the lineage's newest checkpoint, mirrors the lineage's intact steps
to ``checkpoint.uri`` and records each one in MLflow; ``restore_checkpoint`` (before planning a resume) downloads
the newest intact S3 checkpoint when no local lineage has one.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from kuangchao_core.job.checkpoints import restore_and_tag, verify_and_record
from tasks.retry_policy import TRANSIENT_RETRIES


@task(name="checkpoint", **TRANSIENT_RETRIES)
def checkpoint(cfg: Any, mlflow_run_id: str | None = None, settings: Any = None, lineage: str | None = None) -> dict:
    """Prefect task: verify the lineage's newest checkpoint, mirror to S3, record in MLflow (:func:`verify_and_record`)."""
    return verify_and_record(cfg, mlflow_run_id, settings, lineage)


@task(name="restore_checkpoint", **TRANSIENT_RETRIES)
def restore_checkpoint(cfg: Any, mlflow_run_id: str | None = None, settings: Any = None) -> dict[str, Any]:
    """Prefect task: :func:`restore_and_tag` (restore from S3; skipped corrupt checkpoints tagged on the run)."""
    return restore_and_tag(cfg, mlflow_run_id, settings)
