"""Prefect task ``validate_data``: the great-expectations suite over the dataset, before any worker starts. The
report is published as a markdown artifact, then :func:`kuangchao_core.job.data_check.record_validation` logs it to
the MLflow run and raises ``DataError`` on failure: refused data is never retried (bad data does not get better by
waiting), a tracking store that was busy is (:mod:`tasks.retry_policy`)."""

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
from kuangchao_core.job.data_check import record_validation
from tasks.retry_policy import TRANSIENT_RETRIES


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


@task(name="validate_data", **TRANSIENT_RETRIES)
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
    return record_validation(cfg, report, mlflow_run_id, tracking_uri)


validate_data_task = validate_data
