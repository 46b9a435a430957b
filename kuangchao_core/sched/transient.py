"""Which failures of a lifecycle task a retry can cure (issue 44 item 4): :func:`classify_failure`.

A task is retried only for a failure that is named here as transient — a timeout, a refused or reset connection, a
port in use, a locked store, an S3 endpoint that did not answer or asked to slow down — and never for a permanent
one: a bad config, refused data, a denied permission, a worker failure (the flow's recovery answers those with a new
attempt). A failure this module cannot name is permanent: retrying what we do not understand only delays the error.

The exception's whole chain is read (``__cause__``, ``__context__``, SQLAlchemy's ``orig``): a permanent error
anywhere in it wins over a transient one (``ConfigError`` raised while handling a refused connection is still a bad
config). A raiser that knows better states the kind on the exception itself (:func:`mark_failure`): the launch task
marks every failure after its workers started as not retriable, whatever the cause.

No Prefect here: ``tasks/retry_policy.py`` turns the answer into Prefect's ``retry_condition_fn``; the doctor's
service probes use it to mark a failed check ``transient``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections.abc import Iterator
from pathlib import Path

from kuangchao_core.errors import (
    CheckpointCorrupt,
    CommTimeout,
    ConfigError,
    DataError,
    PermissionDenied,
    TrackingStoreError,
    WorkerFailed,
)
from kuangchao_core.obs import tracking_store

#: errno values of an ``OSError`` that a later try may not meet again
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EADDRINUSE,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EAGAIN,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EPIPE,
        errno.EINTR,
    }
)

#: exception classes of optional clients (botocore, urllib3, requests, httpx), matched by name anywhere in the
#: class's MRO so that none of them is imported here
TRANSIENT_CLASS_NAMES = frozenset(
    {
        # botocore
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        # urllib3 / requests (requests' ConnectionError is no builtin ConnectionError)
        "ConnectionError",
        "NewConnectionError",
        "ProtocolError",
        "ConnectTimeout",
        "ReadTimeout",
        # httpx (``TimeoutException`` covers its connect, read, write and pool timeouts)
        "TimeoutException",
        "ConnectError",
        "ReadError",
        "WriteError",
        "RemoteProtocolError",
        # a subprocess that outlived its timeout (``sbatch``, ``srun`` against a busy controller)
        "TimeoutExpired",
    }
)

#: error codes of an S3 (botocore ``ClientError``) answer that ask to come back later
TRANSIENT_S3_CODES = frozenset(
    {"SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError", "Throttling", "RequestTimeTooSkewed"}
)
#: HTTP statuses (httpx ``HTTPStatusError``, MLflow's REST errors) that ask to come back later
TRANSIENT_HTTP_STATUS = frozenset({408, 429, 502, 503, 504})

#: a tracking store's ``unreachable`` problem that is the network (not a directory that cannot be opened)
_NETWORK_SIGNS = ("connection refused", "failed to establish a new connection", "max retries exceeded", "timed out")

#: refusals of the permission layer, which sits above this package (matched by name, not imported)
PERMANENT_CLASS_NAMES = frozenset({"ConfigRefused", "DocumentRejected"})

_FAILURE_ATTR = "kc_failure_kind"
#: the log record attribute holding the failure a task did not retry (``kuangchao/cli/failure_lines.py`` reads it)
NOT_RETRIED = "kc_not_retried"


def mark_failure(exc: BaseException, transient: bool, reason: str) -> BaseException:
    """State ``exc``'s kind on it (read first by :func:`classify_failure`); returns ``exc`` for ``raise``."""
    setattr(exc, _FAILURE_ATTR, (bool(transient), str(reason)))
    return exc


@contextlib.contextmanager
def permanent_once_exists(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Any exception from the block, raised once ``path`` exists, is marked permanent (``what`` had happened, e.g.
    the workers' start: a retry would repeat work that may have left results) and re-raised."""
    try:
        yield
    except Exception as exc:
        if Path(path).exists():
            mark_failure(exc, False, f"{type(exc).__name__} after {what} ({Path(path).name} exists): {_line(exc)}")
        raise


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < 32:
        cur = todo.pop(0)
        if not isinstance(cur, BaseException) or any(cur is s for s in seen):
            continue
        seen.append(cur)
        todo += [cur.__cause__, cur.__context__, getattr(cur, "orig", None)]
    return seen


def _line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())  # a multi-line message (ConfigError's list) on one line
    return f"{type(exc).__name__}: {text[:240]}" if text else type(exc).__name__


@functools.cache
def _permanent_classes() -> tuple[tuple[type[BaseException], str], ...]:
    """(class, what it is) of the failures no retry cures; those that subclass a transient base come first."""
    from kuangchao_core.obs.publish_gate import NotPublishable
    from kuangchao_core.sched.store_gate import GateRefused

    return (
        (GateRefused, "the store gate refused the job's key"),  # a ConnectionError that no retry opens
        (ConfigError, "a bad config"),
        (DataError, "refused data"),
        (NotPublishable, "a model the publishing gate refused"),
        (PermissionDenied, "a denied permission"),
        (PermissionError, "a denied permission"),
        (CheckpointCorrupt, "a corrupt checkpoint"),
        (WorkerFailed, "a worker failure (the flow's recovery starts a new attempt)"),
    )


def _permanent(exc: BaseException) -> str | None:
    for cls, what in _permanent_classes():
        if isinstance(exc, cls):
            return f"{what}: {_line(exc)}"
    if any(k.__name__ in PERMANENT_CLASS_NAMES for k in type(exc).__mro__):
        return f"a denied permission: {_line(exc)}"
    if isinstance(exc, TrackingStoreError) and exc.kind in (tracking_store.CORRUPT, tracking_store.SCHEMA):
        return f"a tracking store MLflow cannot use: {_line(exc)}"
    return None


def _status(exc: BaseException) -> int | str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        return (response.get("Error") or {}).get("Code")
    code = getattr(response, "status_code", None)  # httpx / requests
    return code if isinstance(code, int) else None


def _transient(exc: BaseException) -> str | None:
    if isinstance(exc, (TimeoutError, ConnectionError, CommTimeout)):  # socket.timeout is TimeoutError
        return _line(exc)
    if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}: {_line(exc)}"
    if isinstance(exc, TrackingStoreError):
        if exc.kind == tracking_store.LOCKED:
            return f"tracking store locked: {_line(exc)}"
        if exc.kind == tracking_store.UNREACHABLE and any(s in exc.problem.lower() for s in _NETWORK_SIGNS):
            return f"tracking server not answering: {_line(exc)}"
        return None
    if any(k.__name__ in TRANSIENT_CLASS_NAMES for k in type(exc).__mro__):
        return _line(exc)
    status = _status(exc)
    if status in TRANSIENT_S3_CODES or status in TRANSIENT_HTTP_STATUS:
        return f"{status}: {_line(exc)}"
    problem = tracking_store.classify(exc) if not isinstance(exc, TrackingStoreError) else None
    if problem is not None and problem.kind == tracking_store.LOCKED:
        return f"store locked: {problem.detail}"
    return None


def classify_failure(exc: BaseException) -> tuple[bool, str]:
    """``(transient, reason)`` of a task's failure ``exc``: transient only when its chain names a failure that a
    later try may not meet (see the module's docstring); ``reason`` is one line naming the kind and the error."""
    chain = _chain(exc)
    for cur in chain:
        stated = getattr(cur, _FAILURE_ATTR, None)
        if isinstance(stated, tuple) and len(stated) == 2:
            return bool(stated[0]), str(stated[1])
    for cur in chain:
        why = _permanent(cur)
        if why is not None:
            return False, why
    for cur in chain:
        why = _transient(cur)
        if why is not None:
            return True, why
    return False, f"not a failure known to pass on a retry: {_line(exc)}"
