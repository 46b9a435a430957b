"""The MLflow tracking store failing, as an error a user can act on (issue 38 item 8).

Before, a locked or corrupt ``mlflow.db`` ended ``kc train`` with SQLAlchemy's traceback (hundreds of lines), and a
tracking server that did not answer cost MLflow's own HTTP retries (minutes) first. Here every failure of a store
call is classified (:func:`classify`):

- ``locked``: SQLite's ``database is locked`` (another process holds a write lock, e.g. a long ``BEGIN
  EXCLUSIVE``, a backup, an ``mlflow gc``): the call is retried with a bounded backoff for ``tracking.store_wait_s``
  seconds, the wait said to the user every :data:`SAY_EVERY_S`; then :class:`~kuangchao_core.errors.TrackingStoreError`;
- ``corrupt`` (``file is not a database``, ``database disk image is malformed``, a store with no MLflow tables),
  ``schema`` (an Alembic revision this MLflow does not know, an out-of-date schema) and ``unreachable`` (a server
  that refuses the connection, a database file that cannot be opened): no retry, at once one line naming
  ``tracking.uri``, the store and what to do.

A write that fails this way never touches a checkpoint: the workers write those to disk themselves, and the flow
logs their metadata to MLflow only after they are committed. :class:`StoreClient` is an ``MlflowClient`` whose
every call goes through :func:`call`; :func:`preflight` opens the store before the job computes anything (a new
SQLite store is first seeded from an empty one, ``obs/store_seed.py``);
:func:`probe_sqlite` reads a SQLite store's header and tables with the standard library (``kc doctor``).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kuangchao_core.errors import TrackingStoreError
from kuangchao_core.obs.store_seed import seed_new_store

log = logging.getLogger("kuangchao.obs.tracking")

T = TypeVar("T")

LOCKED, CORRUPT, SCHEMA, UNREACHABLE = "locked", "corrupt", "schema", "unreachable"
#: how long a job waits for a locked store by default (``tracking.store_wait_s``)
DEFAULT_WAIT_S = 60.0
#: the wait is said to the user at its start and then this often
SAY_EVERY_S = 10.0
_FIRST_DELAY_S, _MAX_DELAY_S = 0.25, 4.0

# (kind, lower-case text anywhere in the error chain); the first that matches wins
_SIGNS: tuple[tuple[str, str], ...] = (
    (LOCKED, "database is locked"),
    (LOCKED, "database table is locked"),
    (LOCKED, "database is busy"),
    (CORRUPT, "file is not a database"),
    (CORRUPT, "file is encrypted or is not a database"),
    (CORRUPT, "database disk image is malformed"),
    (CORRUPT, "malformed database schema"),
    (CORRUPT, "no such table"),
    (SCHEMA, "can't locate revision"),
    (SCHEMA, "out-of-date database schema"),
    (SCHEMA, "no such revision"),
    (UNREACHABLE, "unable to open database file"),
    (UNREACHABLE, "max retries exceeded"),
    (UNREACHABLE, "failed to establish a new connection"),
    (UNREACHABLE, "connection refused"),
    (UNREACHABLE, "name or service not known"),
    (UNREACHABLE, "read timed out"),
)
_SQLITE_DETAIL = re.compile(r"\(sqlite3\.\w+\) ([^\n\[]+)")


@dataclass(frozen=True)
class StoreProblem:
    """A classified store failure: its kind and a short detail (the database's own words, one line)."""

    kind: str
    detail: str


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < 20:
        cur = todo.pop(0)
        if cur is None or any(cur is s for s in seen):
            continue
        seen.append(cur)
        todo += [cur.__cause__, cur.__context__, getattr(cur, "orig", None)]
    return seen


def _detail(text: str, sign: str) -> str:
    found = _SQLITE_DETAIL.search(text)
    if found:
        return found.group(1).strip()
    return sign


def classify(exc: BaseException) -> StoreProblem | None:
    """The kind of store failure ``exc`` is (looking through its causes), or None when it is not one (a bug, a
    missing run: raised as it is)."""
    if isinstance(exc, TrackingStoreError):
        return StoreProblem(exc.kind, exc.problem)
    for cur in _chain(exc):
        text = str(cur)
        low = text.lower()
        for kind, sign in _SIGNS:
            if sign in low:
                return StoreProblem(kind, _detail(text, sign))
        if type(cur).__name__ in ("ConnectionError", "ConnectTimeout", "NewConnectionError"):
            return StoreProblem(UNREACHABLE, f"{type(cur).__name__}: {text.splitlines()[0][:160] if text else ''}")
    return None


def sqlite_path(uri: str) -> str | None:
    """The database file of a ``sqlite:///`` URI (None for another scheme or an in-memory store)."""
    if not uri.startswith("sqlite:"):
        return None
    path = uri.split("sqlite:///", 1)[1] if "sqlite:///" in uri else ""
    path = path.split("?", 1)[0]
    return None if path in ("", ":memory:") else path


def store_error(uri: str, problem: StoreProblem, waited_s: float = 0.0) -> TrackingStoreError:
    """The one-line error of ``problem`` in the store ``uri``, with what to do about it."""
    path = sqlite_path(uri)
    another = "or point tracking.uri at another store (e.g. sqlite:///mlflow.db in another directory)"
    if problem.kind == LOCKED:
        holder = f" (see which with `fuser {path}`)" if path else ""
        return TrackingStoreError(
            LOCKED,
            uri,
            f"stayed locked by another process for {waited_s:.0f} s ({problem.detail})",
            f"end or wait out the process holding it{holder}, raise tracking.store_wait_s to wait longer, {another}",
        )
    if problem.kind == CORRUPT:
        move = f"move it aside (mv {path} {path}.broken) to start a new store there" if path else "repair it"
        return TrackingStoreError(
            CORRUPT,
            uri,
            f"is not a database MLflow can read ({problem.detail})",
            f"restore it from a backup, {move}, {another}; the checkpoints are untouched (--resume auto continues)",
        )
    if problem.kind == SCHEMA:
        return TrackingStoreError(
            SCHEMA,
            uri,
            f"has a schema this MLflow does not know ({problem.detail})",
            f"back it up and run `mlflow db upgrade {uri}` with this MLflow, {another}",
        )
    if path:
        fix = f"create the directory of {path} or make it writable, {another}"
    else:
        fix = f"start the server (mlflow server --host 0.0.0.0 --port 5000), check the address, {another}"
    return TrackingStoreError(UNREACHABLE, uri, f"cannot be reached ({problem.detail})", fix)


def reason(uri: str, exc: BaseException) -> str:
    """``exc`` in one line for a warning: a store failure as its :func:`store_error` line (not SQLAlchemy's
    statement and parameters), anything else as its first line."""
    problem = classify(exc)
    if problem is not None:
        return str(exc) if isinstance(exc, TrackingStoreError) else str(store_error(uri, problem))
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def call(
    uri: str,
    fn: Callable[[], T],
    *,
    wait_s: float = DEFAULT_WAIT_S,
    say: Callable[[str], Any] | None = None,
    what: str = "",
) -> T:
    """``fn()`` against the store ``uri``: retried while the store is locked, for at most ``wait_s`` seconds (backoff
    from 0.25 s to 4 s; the wait said through ``say``, default a warning in this module's log); any other store
    failure, or a lock that outlasts the wait, raises :class:`TrackingStoreError` at once; other errors pass."""
    say = say or log.warning
    start = time.monotonic()
    delay, said_at = _FIRST_DELAY_S, None
    while True:
        try:
            return fn()
        except Exception as exc:
            problem = classify(exc)
            if problem is None:
                raise
            waited = time.monotonic() - start
            if problem.kind != LOCKED or waited >= wait_s:
                raise store_error(uri, problem, waited) from exc
            if said_at is None or waited - said_at >= SAY_EVERY_S:
                doing = f" ({what})" if what else ""
                say(
                    f"the MLflow store {uri} is locked by another process{doing}: waiting, {waited:.0f} s of at most "
                    f"{wait_s:.0f} s (tracking.store_wait_s)"
                )
                said_at = waited
            time.sleep(min(delay, max(0.0, wait_s - waited)))
            delay = min(delay * 2, _MAX_DELAY_S)


class StoreClient:
    """An ``MlflowClient`` of ``uri`` whose every method goes through :func:`call` (its creation too: opening a
    SQLite store reads and may migrate its tables)."""

    def __init__(self, uri: str, wait_s: float = DEFAULT_WAIT_S, say: Callable[[str], Any] | None = None):
        from mlflow.tracking import MlflowClient

        self.uri, self.wait_s, self._say = uri, float(wait_s), say
        self._client = call(uri, lambda: MlflowClient(tracking_uri=uri), wait_s=self.wait_s, say=say, what="opening")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def retried(*args: Any, **kwargs: Any) -> Any:
            return call(self.uri, lambda: attr(*args, **kwargs), wait_s=self.wait_s, say=self._say, what=name)

        return retried


def preflight(uri: str, wait_s: float = DEFAULT_WAIT_S, say: Callable[[str], Any] | None = None) -> StoreClient:
    """Open the store ``uri`` and read from it before the job computes anything: a store locked at the start is
    waited for (bounded), a corrupt, foreign or unreachable one raises :class:`TrackingStoreError` within seconds.
    A server is asked ``/health`` first (a few seconds), not through MLflow's client, which retries for minutes; a
    SQLite file is read by :func:`probe_sqlite` first."""
    if uri.startswith(("http://", "https://")):
        _health(uri)
    path = sqlite_path(uri)
    if path:
        seed_new_store(path)  # a new store: a copy of an empty one, not MLflow's migrations run again
    problem = probe_sqlite(path) if path else None
    if problem is not None and problem.kind != LOCKED:  # said in a second, before MLflow is even imported
        raise store_error(uri, problem)
    client = StoreClient(uri, wait_s, say)
    client.search_experiments(max_results=1)
    return client


def _health(uri: str, timeout_s: float = 5.0) -> None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError as exc:
        if exc.code < 500:  # an answering server (an auth proxy, an old MLflow): its own calls say more
            return
        detail = f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        detail = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
    raise store_error(uri, StoreProblem(UNREACHABLE, detail))


def probe_sqlite(path: str, timeout_s: float = 0.5) -> StoreProblem | None:
    """A SQLite store's file read with the standard library: None when it is absent (MLflow creates it), empty, or
    a database whose tables can be listed (MLflow's, or none yet); else the problem — ``corrupt`` (not a database,
    malformed), ``locked`` (a lock held past ``timeout_s``), ``unreachable`` (cannot be opened)."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s)
        try:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if tables and "alembic_version" not in tables:
                return StoreProblem(CORRUPT, f"its tables ({', '.join(sorted(tables)[:3])}…) are not MLflow's")
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return classify(exc) or StoreProblem(CORRUPT, str(exc))
    return None
