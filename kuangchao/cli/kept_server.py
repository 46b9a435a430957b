"""A local Prefect server kept alive between runs (issue 45 item 2): ``kc server start`` starts it once, and every
``kc train`` in the same ``PREFECT_HOME`` runs its flow on it instead of starting Prefect's temporary server (seconds
of every start: the server's imports, its app and its database) and stopping it at the end.

The server's record, ``$PREFECT_HOME/kc-server.json`` (its API URL and process group), is what ``kc train``,
``kc server status`` and ``kc server stop`` read. A record whose server no longer answers is stale: ``kc train``
falls back to the temporary server and says so once; ``kc server status`` and ``stop`` remove it. A configured API
(``PREFECT_API_URL`` in the environment or the active profile) always wins over the kept server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kuangchao_core.sched.heartbeat import pid_alive

RECORD = "kc-server.json"
LOG = "kc-server.log"
#: how long ``kc train`` waits for the kept server's /health before it starts its own
HEALTH_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class KeptServer:
    """A kept server's record: its API URL and the process group ``kc server stop`` ends."""

    api_url: str
    pid: int
    log: str


def prefect_home() -> Path:
    """``$PREFECT_HOME``, Prefect's default ``~/.prefect`` when unset."""
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


def read_record(home: Path | None = None) -> KeptServer | None:
    """The record in ``home`` (default :func:`prefect_home`), or None when there is none or it is unreadable."""
    path = (home or prefect_home()) / RECORD
    try:
        data = json.loads(path.read_text(encoding="utf-8")[:4096])
        return KeptServer(str(data["api_url"]), int(data["pid"]), str(data.get("log", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def answers(api_url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether the Prefect API at ``api_url`` answers ``/health`` within ``timeout_s``."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout_s):
            return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def configured_api_url() -> str | None:
    """The Prefect API the user configured (environment, then the active profile), read without importing Prefect."""
    from kuangchao_core.sched.service_checks import profile_api_url

    return os.environ.get("PREFECT_API_URL") or profile_api_url()


def use_kept_server() -> tuple[str | None, str | None]:
    """For ``kc train``, before Prefect is imported: with no configured API and a kept server that answers, its URL
    is put in ``PREFECT_API_URL`` for this process (returned first); a record whose server does not answer gives
    one line to say (returned second) and the temporary server is used."""
    if configured_api_url():
        return None, None
    record = read_record()
    if record is None:
        return None, None
    if not answers(record.api_url):
        return None, (
            f"the kept Prefect server at {record.api_url} (kc server start) does not answer: this run starts its own; "
            "`kc server stop` removes the stale record"
        )
    os.environ["PREFECT_API_URL"] = record.api_url
    return record.api_url, None


def start(port: int, host: str = "127.0.0.1", timeout_s: float = 120.0) -> KeptServer:
    """Start ``prefect server start`` on ``host:port`` in its own process group, wait until it answers, write its
    record. Raises ``RuntimeError`` with one line when it ends or does not answer in ``timeout_s``."""
    home = prefect_home()
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / LOG
    env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": os.environ.get("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
    }
    env.pop("PREFECT_API_URL", None)  # the server itself is no client of another one
    prefect = str(Path(sys.executable).with_name("prefect"))
    argv = [prefect, "server", "start", "--host", host, "--port", str(port)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    api_url = f"http://{host}:{port}/api"
    deadline = time.monotonic() + timeout_s
    while not answers(api_url, timeout_s=2.0):
        if proc.poll() is not None:
            raise RuntimeError(
                f"the Prefect server ended with code {proc.returncode} before it answered (log: {log_path})"
            )
        if time.monotonic() > deadline:
            _end_group(proc.pid)
            raise RuntimeError(
                f"the Prefect server did not answer on {api_url} within {timeout_s:.0f} s (log: {log_path})"
            )
        time.sleep(0.3)
    record = KeptServer(api_url, proc.pid, str(log_path))
    tmp = home / f".{RECORD}.tmp"
    tmp.write_text(json.dumps({"api_url": api_url, "pid": proc.pid, "log": str(log_path)}), encoding="utf-8")
    os.replace(tmp, home / RECORD)
    return record


def stop(record: KeptServer) -> None:
    """End the kept server's process group and remove its record."""
    _end_group(record.pid)
    (prefect_home() / RECORD).unlink(missing_ok=True)


def _end_group(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM to the process group led by ``pid``; SIGKILL after ``grace_s`` if its leader still runs."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (another kc process started it): poll its existence
            done = pid if not pid_alive(pid) else 0
        if done:
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
