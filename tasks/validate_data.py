"""Prefect task ``validate_data``: the great-expectations suite over the dataset, before any worker starts.

No retries: bad data does not get better by waiting. On failure it raises ``DataError`` with the readable
summary. The report is published as a markdown artifact and, given an MLflow run id, logged to that run
(``data_validation/report.json`` artifact, ``data_valid`` metric 1/0 and tag).
"""

from __future__ import annotations

from typing import Any

from prefect import task

from kuangchao_core.data.validation import (
    DEFAULT_MAX_DUPLICATE_SHARE,
    DEFAULT_MAX_EPOCHS,
    DEFAULT_MAX_RECORD_BYTES,
    ValidationReport,
    validate_dataset,
)
from kuangchao_core.errors import DataError


def _publish_artifact(report: ValidationReport) -> None:
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(
        markdown=report.to_markdown() + "\n```\n" + report.summary + "\n```\n",
        key="kc-data-validation",
        description="great-expectations data validation",
    )


def log_to_mlflow(report: ValidationReport, run_id: str, tracking_uri: str | None = None) -> None:
    """Log the report JSON, a ``data_valid`` metric and tag to the MLflow run ``run_id``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    client.log_dict(run_id, report.to_dict(), "data_validation/report.json")
    client.log_metric(run_id, "data_valid", 1.0 if report.success else 0.0)
    client.set_tag(run_id, "data_valid", str(report.success).lower())


@task(name="validate_data", retries=0)
def validate_data(
    cfg: Any,
    mlflow_run_id: str | None = None,
    tracking_uri: str | None = None,
    max_epochs: float = DEFAULT_MAX_EPOCHS,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    max_duplicate_share: float = DEFAULT_MAX_DUPLICATE_SHARE,
    allow_control_chars: bool = False,
) -> dict:
    """Validate ``cfg.data`` against the job's planned tokens; raise ``DataError`` with the summary on failure.
    NUL and control characters in text fail it unless ``allow_control_chars``."""
    report = validate_dataset(
        cfg,
        max_epochs=max_epochs,
        max_record_bytes=max_record_bytes,
        max_duplicate_share=max_duplicate_share,
        allow_control_chars=allow_control_chars,
    )
    _publish_artifact(report)
    if mlflow_run_id:
        uri = tracking_uri or getattr(getattr(cfg, "tracking", None), "uri", None)
        log_to_mlflow(report, mlflow_run_id, uri)
    if not report.success:
        failed = ", ".join(r.name for r in report.failed)
        raise DataError(
            f"dataset failed validation ({failed}); fix the data or the config (data.path, train.steps, "
            f"data.seq_len) before training:\n{report.summary}"
        )
    return report.to_dict()


validate_data_task = validate_data
