"""Bounded restarts of a worker group (L4.4): the one recovery policy, used by the ``kuangchao-train`` flow.

``supervise`` calls ``launch_fn(attempt)`` for attempts ``0..max_restarts`` (each attempt gets a fresh rendezvous
port and heartbeat directory from the launcher), retries only worker failures, and never retries a configuration,
data or permission error: those fail the same way every time. Nor is a fault that repeats identically: when an
attempt fails with the error and at the step its rank reported in the attempt before (``WorkerFailed.fault``), it
is deterministic and a third attempt would only repeat it (issue 39 item 4). Between attempts ``on_restart`` records the cause and
picks the resume checkpoint (the flow's ``recover`` task).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kuangchao_core.errors import ConfigError, DataError, PermissionDenied, WorkerFailed

NEVER_RETRY: tuple[type[BaseException], ...] = (ConfigError, DataError, PermissionDenied)


@dataclass(frozen=True)
class RestartPolicy:
    """At most ``max_restarts`` restarts after the first attempt, for exceptions in ``retry_on`` only.

    ``backoff_s`` is slept before each restart (0 in tests). ``NEVER_RETRY`` errors are never retried,
    whatever ``retry_on`` says.
    """

    max_restarts: int = 2
    retry_on: tuple[type[BaseException], ...] = (WorkerFailed,)
    backoff_s: float = 0.0
    setting: str = "max_restarts"  # the config field to name in messages (``cluster.max_restarts``)

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ConfigError([("max_restarts", f"must be >= 0, got {self.max_restarts}")])

    def retryable(self, exc: BaseException) -> bool:
        """Whether ``exc`` may be answered with a restart."""
        cause = str(getattr(exc, "cause", "")) if isinstance(exc, WorkerFailed) else ""
        if any(
            f"{kind}:" in cause
            for kind in ("PermissionDenied", "ConfigError", "AnomalyStop", "BadStepsStop", "DiskFull", "StaleWriter")
        ):
            # denied by its token, given a job that cannot run, stopped on purpose, diverged, out of disk or
            # replaced by another writer of its lineage: never again
            return False
        return not isinstance(exc, NEVER_RETRY) and isinstance(exc, self.retry_on)


@dataclass
class SupervisionResult:
    """``result`` of the successful attempt, ``attempts`` made in all, and the ``failures`` that caused restarts."""

    result: Any
    attempts: int
    failures: list[BaseException] = field(default_factory=list)

    @property
    def causes(self) -> list[str]:
        """One line per failed attempt: rank and cause."""
        return [_describe(e) for e in self.failures]


def _repeated(failures: list[BaseException]) -> str | None:
    """The fault of the last two failures when they are the same one (the error and step their rank reported)."""
    if len(failures) < 2:
        return None
    last, before = (getattr(e, "fault", None) for e in failures[-2:][::-1])
    return last if last is not None and last == before else None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, WorkerFailed):
        return f"rank {exc.rank}: {exc.cause}"
    return f"{type(exc).__name__}: {exc}"


def supervise(
    launch_fn: Callable[[int], Any],
    policy: RestartPolicy,
    on_restart: Callable[[int, BaseException], None] | None = None,
) -> SupervisionResult:
    """Run ``launch_fn(attempt)`` until it returns, restarting on retryable failures at most ``policy.max_restarts`` times.

    ``on_restart(next_attempt, exc)`` is called before each restart (log it, record it in MLflow, find the resume
    checkpoint). Returns a ``SupervisionResult``. When every attempt failed, raises a ``WorkerFailed`` naming the
    last failed rank and cause and how many attempts were made (chained to the last failure); a non-retryable
    error propagates unchanged at once.
    """
    failures: list[BaseException] = []
    total = 1 + policy.max_restarts
    for attempt in range(total):
        try:
            result = launch_fn(attempt)
        except BaseException as exc:
            if not policy.retryable(exc):
                raise
            failures.append(exc)
            repeated = _repeated(failures)
            if repeated is not None:
                raise WorkerFailed(
                    getattr(exc, "rank", None),
                    f"{_describe(exc)}; attempt {attempt} repeated attempt {attempt - 1}'s fault identically "
                    f"({repeated}), so it is not retried again ({policy.setting}={policy.max_restarts}). Fix the "
                    "cause named above, then rerun: it resumes from the newest intact checkpoint",
                    getattr(exc, "exit_code", None),
                    fault=repeated,
                ) from exc
            if attempt + 1 >= total:
                history = "; ".join(f"attempt {i}: {_describe(e)}" for i, e in enumerate(failures))
                last = exc if isinstance(exc, WorkerFailed) else None
                raise WorkerFailed(
                    last.rank if last else None,
                    f"{_describe(exc)}; gave up after {total} attempts (1 + {policy.setting}={policy.max_restarts}); "
                    f"history: {history}. Fix the cause named above, then rerun: it resumes from the newest intact "
                    "checkpoint",
                    last.exit_code if last else None,
                ) from exc
            if on_restart is not None:
                on_restart(attempt + 1, exc)
            if policy.backoff_s > 0:
                time.sleep(policy.backoff_s)
            continue
        return SupervisionResult(result=result, attempts=attempt + 1, failures=failures)
    raise AssertionError("unreachable")  # pragma: no cover
