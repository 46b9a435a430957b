"""The flow run's own Prefect log (issue 27 §5, moved out of the core by issue 43 item 6): the task runs named in
the records the API stores, and a logger into the run's log only (:mod:`kuangchao_core.job.flow_log` holds the
formatter and the progress listener, which import no Prefect)."""

from __future__ import annotations

import logging
from typing import Any

from kuangchao_core.job.flow_log import TaskRunNameFormatter


def name_task_runs_in_api_logs() -> int:
    """Give the Prefect API handlers of the task-run logger :class:`TaskRunNameFormatter` (idempotent); returns how
    many handlers it set. The console keeps Prefect's own format (which names the task run already)."""
    from prefect.logging.handlers import APILogHandler

    changed = 0
    for handler in logging.getLogger("prefect.task_runs").handlers:
        if isinstance(handler, APILogHandler) and not isinstance(handler.formatter, TaskRunNameFormatter):
            handler.setFormatter(TaskRunNameFormatter())
            changed += 1
    return changed


def run_logger_or_none() -> Any:
    """A logger into the current Prefect run's log only — the API, not the console, where the live view already
    shows the same lines — or None outside a flow or task run (scripts, tests of the launcher)."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger
    from prefect.logging.handlers import APILogHandler

    try:
        run_logger = get_run_logger()
    except MissingContextError:
        return None
    name_task_runs_in_api_logs()
    api_only = logging.getLogger("kuangchao.flow_log")
    api_only.propagate = False  # never Prefect's console handler
    api_only.setLevel(logging.INFO)
    for handler in logging.getLogger("prefect.task_runs").handlers:
        if isinstance(handler, APILogHandler) and handler not in api_only.handlers:
            api_only.addHandler(handler)
    # the run's ids and names (flow_run_id, task_run_id, task_run_name) travel with each record: the events arrive
    # on the launcher's reader threads, outside the run's context
    return logging.LoggerAdapter(api_only, dict(getattr(run_logger, "extra", {}) or {}))
