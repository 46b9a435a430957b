"""The dataset check before any worker starts (the work of the Prefect task ``validate_data``): the report of
:func:`kuangchao_core.data.validation.validate_dataset`, logged to the job's MLflow run (``data_validation/report.json``
artifact, ``data_valid`` metric 1/0 and tag) and turned into a ``DataError`` with the readable summary on failure."""

from __future__ import annotations

from typing import Any

from kuangchao_core.data.validation import ValidationReport
from kuangchao_core.errors import DataError


def log_to_mlflow(report: ValidationReport, run_id: str, tracking_uri: str | None = None) -> None:
    """Log the report JSON, a ``data_valid`` metric and tag to the MLflow run ``run_id``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    client.log_dict(run_id, report.to_dict(), "data_validation/report.json")
    client.log_metric(run_id, "data_valid", 1.0 if report.success else 0.0)
    client.set_tag(run_id, "data_valid", str(report.success).lower())


def record_validation(
    cfg: Any, report: ValidationReport, mlflow_run_id: str | None = None, tracking_uri: str | None = None
) -> dict:
    """Log ``report`` to the MLflow run (given one; ``tracking_uri`` defaults to ``tracking.uri``); raise
    ``DataError`` with the summary when it failed, else return it as a dict."""
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
