"""Observability: structured JSON logs, the live console view, MLflow metrics."""
