"""``kc train`` interrupted (Ctrl-C, SIGTERM): one line, exit ``128 + N``, no traceback (issue 45 §1).

:func:`one_line_on_interrupt` wraps the whole command: it takes the signals (:mod:`kuangchao_core.sched.interrupt`),
silences Prefect's console at the first one (its reports of the stop stay in the flow run's log in the API), and
turns an :class:`~kuangchao_core.sched.interrupt.Interrupted` that reaches the command into the line. The flow ends
its run *Cancelled* with that line as the state's message (``flows/train.py``); the command prints it
(:func:`say_interrupted`). A second signal ends the process at once, the ranks killed first, with the same line
(the flow run marked Cancelled in the API directly, within 2 s).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from kuangchao.cli.failure_lines import console_handlers
from kuangchao_core.sched import interrupt


class _Silent(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def silence_prefect_console() -> None:
    """From now on, nothing of Prefect's on this process's console (the records still reach the API's log)."""
    for handler in console_handlers():
        handler.addFilter(_Silent())


def _line(config: str, overrides: list[str]) -> str:
    from kuangchao_core.job.interrupted import interrupted_line
    from kuangchao_core.obs import prefect_watch

    return interrupted_line(prefect_watch.current().record, config, overrides)


def say_interrupted(config: str, overrides: list[str], message: str | None = None) -> None:
    """Print the line (the flow's own ``message`` when it ended its run Cancelled) and exit ``128 + N``: the exit
    handlers run (Prefect's last logs, its temporary server's stop), the interpreter's teardown of torch, MLflow and
    Prefect (seconds on a loaded machine, nothing to save) is skipped."""
    from kuangchao_core.obs import voice

    voice.result(message or _line(config, overrides), "WARNING")
    _flush()
    _drain_prefect(timeout_s=3.0)  # as the interpreter's exit does before its exit handlers
    atexit._run_exitfuncs()
    _flush()
    os._exit(interrupt.exit_code())


def _drain_prefect(timeout_s: float) -> None:
    """Prefect's log and event workers: what they hold sent to the API within ``timeout_s`` each."""
    if "prefect.logging.handlers" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout_s)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _mark_cancelled(text: str) -> None:
    """The flow run Cancelled in the API it runs on (configured, or the temporary server), within 2 s."""
    from kuangchao.cli.prefect_server import temporary_api_url
    from kuangchao_core.obs import prefect_api, prefect_watch

    watch = prefect_watch.current()  # the flow's, with its Prefect client's settings (RunHooks)
    url = prefect_api.configured_api_url(watch.hooks) or temporary_api_url()
    if watch.flow_run_id and url:
        prefect_api.mark_cancelled(url, watch.flow_run_id, text, watch.hooks.auth_headers(), timeout_s=2.0)


def _end_now(config: str, overrides: list[str], _signum: int) -> None:
    """The second signal (the ranks are already killed): the line and exit, not waiting for the flow; its run is
    marked Cancelled directly in the API."""
    try:
        text = _line(config, overrides)
    except Exception:  # noqa: BLE001 - the line without its numbers rather than no exit
        text = interrupt.line(interrupt.last_step(), None, config, overrides)
    with contextlib.suppress(Exception):
        _mark_cancelled(text)
    _flush()
    from kuangchao_core.obs.voice import render

    os.write(2, (render(text, "WARNING") + "\n").encode())
    os._exit(interrupt.exit_code())


@contextlib.contextmanager
def one_line_on_interrupt(config: str, overrides: list[str]) -> Iterator[None]:
    """Around ``kc train``'s work: Ctrl-C and SIGTERM stop the job as :mod:`kuangchao_core.sched.interrupt` says
    and end the command with one line."""
    with interrupt.installed(on_second=lambda signum: _end_now(config, overrides, signum)):
        interrupt.on_request(silence_prefect_console)
        try:
            yield
        except interrupt.Interrupted:
            say_interrupted(config, overrides)
