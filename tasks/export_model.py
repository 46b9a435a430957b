"""Prefect task ``export-model``: the job's final checkpoint exported, logged to MLflow as the run's model and
registered when configured (:func:`kuangchao_core.job.model_export.export_and_register_model`). A model the
publishing gate refused (``NotPublishable``) is not retried."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from kuangchao_core.job.model_export import export_and_register_model
from kuangchao_core.obs.publish_gate import NotPublishable


def _retry_unless_refused(_task: Any, _run: Any, state: Any) -> bool:
    """Retry an export that failed, except one the publishing gate refused (it would be refused again)."""
    try:
        state.result()
    except NotPublishable:
        return False
    except BaseException:  # noqa: BLE001 - any other failure may be transient
        return True
    return True


@task(name="export-model", retries=1, retry_delay_seconds=2, retry_condition_fn=_retry_unless_refused)
def export_and_register(
    cfg: Any, run_id: str, step_dir: str, run_dir: str, final_loss: float | None = None
) -> dict[str, Any]:
    """Prefect task: see :func:`export_and_register_model` (the registry's decision goes to the run's log)."""
    return export_and_register_model(cfg, run_id, step_dir, run_dir, final_loss, get_run_logger())
