"""``kc server``: a local Prefect server kept alive between runs (issue 45 item 2). ``kc train`` in the same
``PREFECT_HOME`` runs its flow on it (no temporary server started, the flow run is on the kept server) and ``kc server
stop`` ends it. Which server ``kc train`` takes is decided before Prefect is imported: a configured API wins, a stale
record falls back to the temporary server with one line — each checked against a real HTTP server."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kuangchao.cli import kept_server
from tests.fixtures import free_port

ROOT = Path(__file__).resolve().parent.parent
KC = [sys.executable, "-m", "kuangchao.cli.main"]


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/api/health" else 404)
        self.end_headers()
        self.wfile.write(b"true")

    def log_message(self, *args):
        pass


@pytest.fixture
def home(tmp_path, monkeypatch):
    """This test's own PREFECT_HOME, no configured API; ``PREFECT_API_URL`` as it was afterwards, whatever
    :func:`kept_server.use_kept_server` set (monkeypatch would put back the value a test set it over)."""
    saved = os.environ.pop("PREFECT_API_URL", None)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.delenv("PREFECT_PROFILE", raising=False)
    (tmp_path / "prefect-home").mkdir()
    try:
        yield tmp_path / "prefect-home"
    finally:
        monkeypatch.undo()
        os.environ.pop("PREFECT_API_URL", None)
        if saved is not None:
            os.environ["PREFECT_API_URL"] = saved


def _record(home: Path, api_url: str) -> None:
    (home / kept_server.RECORD).write_text(json.dumps({"api_url": api_url, "pid": 999999, "log": ""}))


def test_kc_train_takes_the_kept_server_only_when_it_answers_and_no_api_is_configured(home):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/api"
        assert kept_server.use_kept_server() == (None, None)  # no record: the temporary server
        _record(home, url)
        assert kept_server.use_kept_server() == (url, None)
        assert os.environ["PREFECT_API_URL"] == url

        os.environ["PREFECT_API_URL"] = "http://127.0.0.1:9/api"  # configured: it wins, even unreachable
        assert kept_server.use_kept_server() == (None, None)
        assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:9/api"
    finally:
        server.shutdown()
        server.server_close()

    del os.environ["PREFECT_API_URL"]
    stale = f"http://127.0.0.1:{free_port()}/api"  # the control: a record whose server no longer answers
    _record(home, stale)
    kept, note = kept_server.use_kept_server()
    assert kept is None and stale in note and "kc server stop" in note
    assert "PREFECT_API_URL" not in os.environ


def _kc(*args: str, cwd: Path = ROOT, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*KC, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(420)
def test_kc_train_runs_its_flow_on_the_kept_server_and_stop_ends_it(home, tmp_path):
    port = free_port()
    started = _kc("server", "start", "--port", str(port))
    assert started.returncode == 0, started.stderr
    record = kept_server.read_record(home)
    api = f"http://127.0.0.1:{port}/api"
    try:
        assert record is not None and record.api_url == api and kept_server.answers(api)
        assert _kc("server", "status").returncode == 0

        overrides = {
            "task.name": "kc-kept",
            "train.steps": "2",
            "train.warmup_steps": "1",
            "checkpoint.dir": str(tmp_path / "ckpt"),
            "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "permission.audit_log": str(tmp_path / "audit"),
        }
        sets = [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
        out = _kc("train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--resume", "never", *sets, cwd=tmp_path)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-4000:]
        assert f"on the kept Prefect server {api}" in text
        assert "temporary server" not in text, text[-4000:]  # Prefect's "Starting/Stopping temporary server"
        request = urllib.request.Request(f"{api}/flow_runs/filter", data=b"{}", method="POST")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=10) as response:
            runs = json.loads(response.read())
        assert [r["state"]["type"] for r in runs] == ["COMPLETED"], runs  # the run is the kept server's
    finally:
        stopped = _kc("server", "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert kept_server.read_record(home) is None
    deadline = time.monotonic() + 15
    while kept_server.answers(api) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not kept_server.answers(api)
    assert _kc("server", "status").returncode == 1
