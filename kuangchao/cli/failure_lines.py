"""One clear line per failure of ``kc train`` (issue 27 §3).

An expected refusal (``NothingToTrain``, ``ConfigError``, ``PlanError``) is one line per problem, with its fix, and
exit code 2; any other deliberate error (``KuangchaoError``: a failed doctor check, workers that failed every attempt)
is one ``kc train failed: …`` line and exit code 1. Prefect's own reports of such an error on the console — the
``Encountered exception during execution`` / ``Task run failed with exception`` tracebacks, the ``Finished in state
Failed(…)`` repeats, the flow's ``kuangchao-train failed`` line — are left out of the console by
:func:`quiet_expected_failures`; they still reach the flow run's log in the Prefect API (``prefect flow-run logs``),
and the workers' full output stays in the run directory (``attempt_<n>/launcher.log`` and ``logs/``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

from kuangchao_core.errors import ConfigError, KuangchaoError, NothingToTrain
from kuangchao_core.sched.transient import NOT_RETRIED

_FINISHED_FAILED = re.compile(r"^Finished in state (Failed|Crashed)\(")


def _error_names() -> set[str]:
    names, todo = set(), [KuangchaoError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _deliberate(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, KuangchaoError):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class ExpectedFailureFilter(logging.Filter):
    """Drops from a console handler Prefect's tracebacks and state lines of a deliberate Kuangchao error."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for the records that repeat a ``KuangchaoError`` the CLI says in one line."""
        if record.exc_info and _deliberate(record.exc_info[1]):
            return False
        if _deliberate(getattr(record, NOT_RETRIED, None)):  # a task's "not retried: permanent" line (issue 44)
            return False
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is not ours to judge
            return True
        if message.startswith("kuangchao-train failed:"):
            return False
        if _FINISHED_FAILED.match(message):
            return not any(f"{name}:" in message or f"{name}(" in message for name in _error_names())
        return True


def console_handlers() -> list[logging.Handler]:
    """Prefect's console handlers of this process's loggers (kc's :class:`~kuangchao_core.obs.voice.ConsoleHandler`
    where Prefect's logging config is kc's, Prefect's own where the user set another)."""
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    out: list[logging.Handler] = []
    for lg in loggers:
        for handler in lg.handlers:
            if type(handler).__name__ in ("PrefectConsoleHandler", "ConsoleHandler") and handler not in out:
                out.append(handler)
    return out


@contextmanager
def quiet_expected_failures() -> Iterator[None]:
    """While inside, Prefect's console handlers leave out the reports of deliberate errors (see the module)."""
    quiet = ExpectedFailureFilter()
    handlers = console_handlers()
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)


def one_line(text: str) -> str:
    """A multi-line message as one line (its lines stripped and joined)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def failure_lines(exc: BaseException, config: str) -> tuple[list[str], int]:
    """The console lines and the exit code of ``kc train`` for an error the flow raised."""
    if isinstance(exc, NothingToTrain):
        return [f"kc train: {msg}" for _, msg in exc.errors], 2
    if isinstance(exc, ConfigError):
        return [f"kc train: {exc.source or config}: {path}: {one_line(msg)}" for path, msg in exc.errors], 2
    return [f"kc train failed: {one_line(str(exc))}"], 1
