"""Prefect task ``issue_tokens``: one capability token per module of the job, before launch (SPEC L5.1).

The work is :func:`kuangchao_core.perm.issuance.issue_tokens_for_run`; this module only makes it a task.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from kuangchao_core.perm.issuance import issue_tokens_for_run
from tasks.retry_policy import TRANSIENT_RETRIES


@task(name="issue_tokens", **TRANSIENT_RETRIES)
def issue_tokens(cfg: Any, run_dir: str, attempt: int, placement: dict[str, Any] | None = None) -> dict[str, str]:
    """Prefect wrapper of :func:`issue_tokens_for_run`; returns the worker environment."""
    return issue_tokens_for_run(cfg, run_dir, attempt, placement)
