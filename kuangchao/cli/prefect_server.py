"""Prefect's temporary API server under ``kc train``, guarded so that it dies with ``kc train`` (issue 38 §5).

Without ``PREFECT_API_URL`` a flow runs on Prefect's *ephemeral* API: Prefect's ``SubprocessASGIServer`` starts
``python -m uvicorn … prefect.server.api.server:create_app`` as a plain child and stops it only from ``atexit``, so
a ``kill -9`` or SIGTERM of ``kc train`` left the server running (about 200 MB and its port) for as long as the
machine ran. :class:`GuardedASGIServer` is that same server, started through
:func:`~kuangchao_core.sched.group_guard.start_guarded`: the uvicorn command (the same command, environment and
port choice as Prefect's) runs in the guard's own process group, which the guard stops when its standard input —
a pipe from ``kc train`` — reads end-of-file, whatever ended ``kc train``. Everything else is Prefect's: the flow
still runs on the ephemeral API (``PREFECT_API_URL`` stays unset, so the watch of a configured server,
:mod:`kuangchao_core.obs.prefect_watch`, keeps its meaning), the startup timeout, the port retry and the normal
stop at exit (``terminate`` of the guard stops the group).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import prefect
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings

from kuangchao_core.sched.group_guard import start_guarded


def uvicorn_command(port: int) -> tuple[list[str], dict[str, str]]:
    """The command and environment Prefect's ``SubprocessASGIServer`` runs its server with on ``port`` (Prefect
    3.x ``_run_uvicorn_command``)."""
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(prefect.__module_path__.parent),
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",  # used to turn off serving the UI
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        **get_current_settings().to_environment_variables(exclude_unset=True),
    }
    return argv, env


class GuardedASGIServer(SubprocessASGIServer):
    """Prefect's temporary server whose process group ends with this process: ``server_process`` is the guard
    (its ``poll`` reads the server's exit code, its ``terminate`` stops the server and its children)."""

    def _run_uvicorn_command(self) -> Any:
        argv, env = uvicorn_command(self.port)
        return start_guarded(argv, env=env)


_STARTED: list[GuardedASGIServer] = []


def temporary_api_url() -> str | None:
    """The API URL of the temporary server this process started (None: none started, or not yet answering)."""
    server = _STARTED[0] if _STARTED else None
    return server.api_url if server is not None and server.running else None


def start_temporary_server() -> threading.Thread:
    """Without ``PREFECT_API_URL`` the flow runs on Prefect's temporary server, which takes seconds to start: start
    it now in a thread (returned; join it before the flow starts) while this process imports the flow, instead of
    when the flow's client first asks for it. Call it only when no API is configured.

    The guarded server takes the place of the instance Prefect's client uses (``SubprocessASGIServer()``, the one
    without a port; Prefect's own test harness swaps it the same way), before anything starts one."""
    server = GuardedASGIServer()  # the instance for port None: every later SubprocessASGIServer() is this one
    _STARTED.append(server)

    def start() -> None:
        try:
            server.start()  # start is once per process
        except Exception:  # noqa: BLE001 - the flow's own start says what is wrong (and retries)
            pass

    thread = threading.Thread(target=start, name="kc-prefect-server", daemon=True)
    thread.start()
    return thread
