"""The retry policy of every lifecycle task (issue 44 item 4): transient failures retried with backoff, permanent
ones never, and the task run's log says which it was.

``@task(name=..., **TRANSIENT_RETRIES)`` gives a task :data:`RETRIES` retries after :data:`RETRY_DELAYS_S` and
Prefect's ``retry_condition_fn`` :func:`retry_if_transient`, which asks
:func:`kuangchao_core.sched.transient.classify_failure` and logs one line through the task run's logger:
``retrying <task>: transient (<reason>)`` or ``<task> not retried: permanent (<reason>)``. Prefect calls the
condition only while retries are left; after the last one it logs ``Retries are exhausted`` itself.
"""

from __future__ import annotations

from typing import Any

from prefect.logging.loggers import task_run_logger

from kuangchao_core.sched.transient import NOT_RETRIED, classify_failure

#: retries of a transient failure (so at most 1 + RETRIES tries)
RETRIES = 3
#: the wait before each retry: an exponential backoff, short because a task's own calls wait already (the
#: tracking store for ``tracking.store_wait_s``, S3 with botocore's retries); tests shorten it with ``with_options``
RETRY_DELAYS_S = [1.0, 2.0, 4.0]


def failure_of(state: Any) -> BaseException | None:
    """The exception a failed Prefect ``state`` holds (None when it holds none, e.g. a failed result)."""
    data = getattr(state, "data", None)
    if isinstance(data, BaseException):  # the engine hands the condition the exception itself
        return data
    try:
        held = state.result(raise_on_failure=False)
    except BaseException as exc:  # noqa: BLE001 - a result that cannot be read is the failure to judge
        return exc
    return held if isinstance(held, BaseException) else None


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: True (retry) for a transient failure, False for a permanent one; one line
    in the task run's log says which and why."""
    exc = failure_of(state)
    transient, reason = classify_failure(exc) if exc is not None else (False, f"a failed state: {state.message}")
    name = getattr(task, "name", "task")
    logger = task_run_logger(task_run, task=task)
    if transient:
        logger.warning("retrying %s: transient (%s)", name, reason)
    else:
        # the failure rides along so that kc train's console can leave out a deliberate error it says itself
        logger.error("%s not retried: permanent (%s)", name, reason, extra={NOT_RETRIED: exc})
    return transient


#: the keyword arguments of ``@task`` for a lifecycle task
TRANSIENT_RETRIES: dict[str, Any] = {
    "retries": RETRIES,
    "retry_delay_seconds": RETRY_DELAYS_S,
    "retry_condition_fn": retry_if_transient,
}
