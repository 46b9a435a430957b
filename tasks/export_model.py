"""Prefect task ``export-model``: the job's final checkpoint exported, logged to MLflow as the run's model and
registered when configured (:func:`kuangchao_core.job.model_export.export_and_register_model`). A transient failure
(the tracking store locked, a server that did not answer) is retried; a model the publishing gate refused
(``NotPublishable``) is permanent and never retried (:mod:`tasks.retry_policy`)."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from kuangchao_core.job.model_export import export_and_register_model
from tasks.retry_policy import TRANSIENT_RETRIES


@task(name="export-model", **TRANSIENT_RETRIES)
def export_and_register(
    cfg: Any, run_id: str, step_dir: str, run_dir: str, final_loss: float | None = None
) -> dict[str, Any]:
    """Prefect task: see :func:`export_and_register_model` (the registry's decision goes to the run's log)."""
    return export_and_register_model(cfg, run_id, step_dir, run_dir, final_loss, get_run_logger())
