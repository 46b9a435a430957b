"""L4 observability: structured JSON logs, the live console view, MLflow metrics.

May import: ``errors``, ``config``; the guard interface ``guard_api`` (beside ``errors``).
"""
