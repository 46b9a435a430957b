"""A lost Prefect API ends the job cleanly (issue 26 §5).

Prefect's client retries a refused connection with an exponential back-off (about a minute per call) once it has
reached the server, and a process drains its queued events on exit, one failed connection after another: with the
server gone, ``kc train`` trained to the end, registered its model, then hung on the run-summary artifact forever.
Here the flow's process watches the configured API instead:

- :func:`watching` (around the flow's body) polls ``<PREFECT_API_URL>/health``; unanswered for
  ``$KC_PREFECT_API_GRACE_S`` seconds (default 15) the API is *lost*. Training in progress (the body's
  :meth:`APIWatch.interruptible` section) is stopped: the workers are ended by the launcher's own unwinding, the
  MLflow run closes as FAILED and ``<run_dir>/summary.json`` says what the run reached (:class:`PrefectAPILost`).
- the end of the flow writes ``summary.json`` first, asks :func:`before_registration` before the model is
  registered (a lost API registers nothing) and publishes the Prefect artifact with :func:`publish_summary`, whose
  call is bounded; when that fails the registration just made is undone (the version deleted, the aliases put
  back where they were).
- :func:`exit_when_lost` (``kc train``) ends the process once the body has unwound, or at most
  ``deadline_s`` after the loss, with one line naming the API, the summary and what became of the model; Prefect's
  own reporting of the flow run's final state (which cannot reach a lost API) is not waited for.

The same thread follows the flow run's own state (``<PREFECT_API_URL>/flow_runs/<id>``, every poll): a flow run
cancelled in the Prefect UI or API (``prefect flow-run cancel``: Cancelling) while ``kc train`` runs it in its own
process — no worker to kill it — stops the training the same way (the launcher cancels a Slurm job with ``scancel``
and ends every rank) and leaves the body as :class:`FlowRunCancelled`; the flow then ends Cancelled (issue 32 §3).

Without a configured ``PREFECT_API_URL`` (Prefect's ephemeral server, started by this process) nothing is watched.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kuangchao_core.errors import KuangchaoError
from kuangchao_core.obs import prefect_api as api
from kuangchao_core.obs.prefect_api import api_answers, configured_api_url
from kuangchao_core.obs.run_hooks import NO_HOOKS, RunHooks

log = logging.getLogger("kuangchao.obs.prefect_watch")

ENV_GRACE = "KC_PREFECT_API_GRACE_S"
DEFAULT_GRACE_S = 15.0
SUMMARY_FILE = "summary.json"


class PrefectAPILost(KuangchaoError):
    """The Prefect API the job reports to stopped answering during the run; the message says where the run's own
    summary is and what became of the model."""


class FlowRunCancelled(KuangchaoError):
    """The flow run was cancelled in Prefect (its state went Cancelling or Cancelled) while this process ran it."""


class _Interrupt(BaseException):
    """Raised into the flow's thread while it trains: a BaseException, so no ``except Exception`` (a task engine's
    retry included) swallows it; :func:`watching` turns it into :class:`PrefectAPILost`."""


class _Cancel(BaseException):
    """Raised into the flow's thread when its flow run was cancelled in Prefect; :func:`watching` turns it into
    :class:`FlowRunCancelled`."""


class APIWatch:
    """Polls a Prefect API and declares it lost after ``grace_s`` seconds without an answer (once; final).

    With a ``flow_run_id`` it also follows that flow run's state and declares it cancelled (once; final) when it
    goes Cancelling or Cancelled. ``record`` gathers what the run's summary needs if it ends early (:meth:`note`);
    :meth:`interruptible` marks the stretch of the flow (training) into which a loss or a cancellation is raised at
    once. ``hooks``: the Prefect client's side (its authentication, its retries, the run's artifacts)."""

    def __init__(
        self,
        url: str | None,
        grace_s: float = DEFAULT_GRACE_S,
        interval_s: float = 2.0,
        flow_run_id: str | None = None,
        hooks: RunHooks = NO_HOOKS,
    ) -> None:
        self.url, self.grace_s, self.interval_s = url, float(grace_s), float(interval_s)
        self.flow_run_id, self.hooks = flow_run_id, hooks
        self.record: dict[str, Any] = {}
        self.cancelled: str | None = None  # the flow run's state name once it was cancelled in Prefect
        self.lost_reason: str | None = None
        self.lost_at: float | None = None
        self.body_done = threading.Event()
        self._target: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def lost(self) -> bool:
        """Whether the API was declared lost."""
        return self.lost_reason is not None

    def start(self) -> APIWatch:
        """Start polling (nothing without a URL)."""
        if self.url and self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="kc-prefect-api-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling."""
        self._stop.set()

    def note(self, **fields: Any) -> None:
        """Remember facts of the run (run_dir, lineage, MLflow run …) for a summary written after a loss."""
        self.record.update({k: v for k, v in fields.items() if v is not None})

    def _poll(self) -> None:
        silent_since: float | None = None
        headers = self.hooks.auth_headers() if self.flow_run_id else {}
        while not self._stop.is_set() and not self.lost:
            problem = api_answers(self.url, timeout_s=min(3.0, self.grace_s / 2 or 1.0))
            now = time.monotonic()
            if problem is None:
                silent_since = None
                if self.flow_run_id and not self.cancelled:
                    kind, name = api.flow_run_state(self.url, self.flow_run_id, headers)
                    if kind in ("CANCELLING", "CANCELLED"):
                        self.declare_cancelled(name or kind.title())
            else:
                silent_since = silent_since or now
                if now - silent_since >= self.grace_s:
                    self.declare_lost(f"no answer for {now - silent_since:.0f} s ({problem})")
                    return
            self._stop.wait(self.interval_s)

    def declare_lost(self, reason: str) -> None:
        """Mark the API lost (the first reason stays), stop training in progress and call the loss hooks."""
        with self._lock:  # held while raising: the body cannot leave its interruptible stretch in between
            if self.lost:
                return
            self.lost_reason, self.lost_at = reason, time.monotonic()
            if self._target is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._target), ctypes.py_object(_Interrupt))
        log.error("the Prefect API at %s is lost: %s; the run ends", self.url, reason)
        self.hooks.client_fails_fast(True)
        for hook in list(_HOOKS):
            try:
                hook(self)
            except Exception:  # noqa: BLE001 - a hook must not keep the others from running
                log.exception("Prefect API loss hook failed")

    def declare_cancelled(self, state_name: str) -> None:
        """Mark the flow run cancelled in Prefect (the first time only) and stop training in progress."""
        with self._lock:
            if self.cancelled or self.lost:
                return
            self.cancelled = state_name
            if self._target is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._target), ctypes.py_object(_Cancel))
        log.warning("flow run %s was cancelled in Prefect (%s); the run stops", self.flow_run_id, state_name)

    def cancel_line(self) -> str:
        """One sentence for people: the run was cancelled in Prefect, and where its summary is."""
        summary = self.record.get("summary_path") or "not written"
        return f"the run was cancelled in Prefect (flow run {self.flow_run_id}, {self.cancelled}); summary: {summary}"

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """The stretch of the flow that a loss or a cancellation interrupts (raised into this thread); entered lost
        or cancelled, it raises."""
        self.raise_if_lost()
        with self._lock:
            self._target = threading.get_ident()
        try:
            yield
        finally:
            with self._lock:
                self._target = None

    def raise_if_lost(self) -> None:
        """Raise :class:`PrefectAPILost` when the API was declared lost, :class:`FlowRunCancelled` when the flow run
        was cancelled."""
        if self.lost:
            raise PrefectAPILost(self.line())
        if self.cancelled:
            raise FlowRunCancelled(self.cancel_line())

    def line(self) -> str:
        """One sentence for people: the API, the summary on disk, the model."""
        summary = self.record.get("summary_path") or (
            str(Path(self.record["run_dir"]) / SUMMARY_FILE) if self.record.get("run_dir") else "not written"
        )
        model = self.record.get("model") or "the model was not registered"
        return f"the Prefect API at {self.url} was lost during the run ({self.lost_reason}); the run's summary is in {summary}; {model}"


_HOOKS: list[Callable[[APIWatch], None]] = []
_CURRENT: APIWatch | None = None
_LAST: APIWatch | None = None  # the newest flow body's watch, for body_ended


def current() -> APIWatch:
    """The watch of the flow running in this process (an idle one when none is)."""
    return _CURRENT if _CURRENT is not None else APIWatch(None)


def note(**fields: Any) -> None:
    """:meth:`APIWatch.note` on the current watch."""
    if _CURRENT is not None:
        _CURRENT.note(**fields)


@contextlib.contextmanager
def watching(grace_s: float | None = None, hooks: RunHooks = NO_HOOKS) -> Iterator[APIWatch]:
    """Watch the Prefect API ``hooks`` (the flow's) name while the flow's body runs; a loss leaves
    ``<run_dir>/summary.json`` (what the run reached) and leaves the body as :class:`PrefectAPILost`. Call
    :func:`body_ended` when the flow's own clean-up (the audit seal) is done."""
    global _CURRENT, _LAST
    grace = float(grace_s if grace_s is not None else os.environ.get(ENV_GRACE, DEFAULT_GRACE_S))
    watch = APIWatch(configured_api_url(hooks), grace, flow_run_id=hooks.flow_run_id(), hooks=hooks).start()
    previous, _CURRENT, _LAST = _CURRENT, watch, watch
    try:
        yield watch
    except (_Cancel, FlowRunCancelled):
        _write_partial_summary(watch, "cancelled in Prefect", f"flow run {watch.flow_run_id}: {watch.cancelled}")
        raise FlowRunCancelled(watch.cancel_line()) from None
    except (_Interrupt, PrefectAPILost) as exc:
        watch.declare_lost(watch.lost_reason or str(exc))  # a bounded call failed: the same end
        _write_partial_summary(watch)
        raise PrefectAPILost(watch.line()) from None
    finally:
        watch.stop()
        _CURRENT = previous


def body_ended() -> None:
    """The flow's body and its clean-up are over: a pending :func:`exit_when_lost` may end the process now."""
    if _LAST is not None:
        _LAST.body_done.set()
        _LAST.hooks.client_fails_fast(False)


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> Path:
    """``<run_dir>/summary.json``, written atomically (temporary file, fsync, rename); its path."""
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_name(f".{SUMMARY_FILE}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _newest_checkpoint(lineage_dir: str | None) -> str | None:
    if not lineage_dir:
        return None
    steps = sorted(p.parent for p in Path(lineage_dir).glob("step_*/manifest.json"))
    return str(steps[-1]) if steps else None


def _write_partial_summary(watch: APIWatch, outcome: str | None = None, reason: str | None = None) -> None:
    rec = watch.record
    if rec.get("summary_path") or not rec.get("run_dir"):
        return
    summary = {
        "task": rec.get("task"),
        "outcome": outcome or "failed: the Prefect API was lost",
        "reason": reason or f"the Prefect API at {watch.url}: {watch.lost_reason}",
        "lineage": rec.get("lineage"),
        "newest_checkpoint": _newest_checkpoint(rec.get("lineage_dir")),
        "model_version": None,
        "mlflow_run_id": rec.get("mlflow_run_id"),
        "flow_run_id": rec.get("flow_run_id"),
        "run_dir": rec["run_dir"],
    }
    try:
        watch.note(summary_path=str(write_summary(rec["run_dir"], summary)))
    except OSError as exc:
        log.error("run summary not written to %s: %s", rec["run_dir"], exc)


def _bounded(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` in a daemon thread; TimeoutError when it has not returned after ``timeout_s`` (it is abandoned)."""
    box: dict[str, Any] = {}
    context = contextvars.copy_context()  # the flow run's context: an artifact is attached to it

    def run() -> None:
        try:
            box["value"] = context.run(fn)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="kc-bounded-prefect-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def before_registration(cfg: Any) -> dict[str, int | None]:
    """Called just before the model is registered: raises :class:`PrefectAPILost` when the API is lost (nothing is
    registered), else returns where the aliases of ``tracking.register_model`` point now (for an undo)."""
    watch = current()
    if watch.url and not watch.lost:
        problem = api_answers(watch.url)
        if problem is not None:
            watch.declare_lost(problem)
    watch.raise_if_lost()
    name = getattr(cfg.tracking, "register_model", None)
    if not name:
        return {}
    from mlflow.tracking import MlflowClient

    from kuangchao_core.obs.champion import ALIAS_CHAMPION, ALIAS_NEWEST
    from kuangchao_core.obs.tracking import tracking_uri

    client = MlflowClient(tracking_uri(cfg))
    snapshot: dict[str, int | None] = {}
    for alias in (ALIAS_NEWEST, ALIAS_CHAMPION):
        try:
            snapshot[alias] = int(client.get_model_version_by_alias(name, alias).version)
        except Exception:  # noqa: BLE001 - no such model or alias yet
            snapshot[alias] = None
    return snapshot


def undo_registration(cfg: Any, registered: dict[str, Any], aliases_before: dict[str, int | None]) -> str:
    """Delete the model version just registered and put its aliases back where they were; what was done."""
    from mlflow.tracking import MlflowClient

    from kuangchao_core.obs.tracking import tracking_uri

    client = MlflowClient(tracking_uri(cfg))
    name, version = registered["name"], str(registered["version"])
    client.delete_model_version(name, version)
    restored = []
    for alias in registered.get("aliases") or []:
        before = aliases_before.get(alias)
        if before is not None:
            client.set_registered_model_alias(name, alias, str(before))
            restored.append(f"{alias} -> v{before}")
    return f"the registration of {name} version {version} was undone" + (
        f" ({', '.join(restored)})" if restored else ""
    )


def publish_summary(
    cfg: Any,
    summary: dict[str, Any],
    run_dir: str | os.PathLike,
    markdown: str,
    exported: dict[str, Any] | None = None,
    aliases_before: dict[str, int | None] | None = None,
    timeout_s: float = 20.0,
) -> Path:
    """The run's bookkeeping: ``<run_dir>/summary.json`` first, then the Prefect artifact ``kuangchao-run-summary``
    within ``timeout_s``. When that call fails the API is declared lost, the model registered by this run
    (``exported['registered']``) is unregistered and :class:`PrefectAPILost` raised; returns the summary's path."""
    watch = current()
    path = write_summary(run_dir, summary)
    watch.note(summary_path=str(path))
    registered = (exported or {}).get("registered")
    if registered:
        watch.note(model=f"model registered as {registered['name']} version {registered['version']}")
    if watch.hooks.in_run():
        try:
            if watch.lost:
                raise PrefectAPILost(watch.line())
            _bounded(lambda: watch.hooks.artifact(markdown, "kuangchao-run-summary", "training run summary"), timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure of the API here is its loss
            watch.declare_lost(watch.lost_reason or f"the run-summary artifact failed: {exc}")
            if registered:
                try:
                    watch.note(model=undo_registration(cfg, registered, aliases_before or {}))
                except Exception as undo_exc:  # noqa: BLE001 - say so; the summary names the version
                    watch.note(
                        model=f"{registered['name']} version {registered['version']} stays registered "
                        f"(undoing it failed: {undo_exc})"
                    )
                summary = {**summary, "model_version": None, "outcome": f"failed: {watch.record['model']}"}
                write_summary(run_dir, summary)
            raise PrefectAPILost(watch.line()) from None
    return path


@contextlib.contextmanager
def exit_when_lost(echo: Callable[[str], None], deadline_s: float = 25.0, code: int = 1) -> Iterator[None]:
    """For a process that runs one flow (``kc train``), around that run: once the API is declared lost, wait for
    the flow's body to unwind (:func:`body_ended`) for at most ``deadline_s``, print :meth:`APIWatch.line` with
    ``echo`` and end the process with ``code`` (Prefect's final state report and its event queue cannot reach a lost
    API). Leaving the block removes the hook: a later loss in the same process (a test runner's) ends nothing."""

    def on_lost(watch: APIWatch) -> None:
        def finish() -> None:
            watch.body_done.wait(deadline_s)
            if not watch.record.get("summary_path"):
                _write_partial_summary(watch)
            echo(f"kc train: {watch.line()}")
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)

        threading.Thread(target=finish, name="kc-exit-on-api-loss", daemon=True).start()

    _HOOKS.append(on_lost)
    try:
        yield
    finally:
        _HOOKS.remove(on_lost)
