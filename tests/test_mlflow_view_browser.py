"""The MLflow link ``kc runs compare`` prints opens the runs table with the training columns, in a real browser
(issue 27 §5): a real MLflow server on a store whose experiment carries the tags every job sets, Chromium headless
rendering the UI's JavaScript, the DOM read for the table's column ids.

Needs Chromium (Debian: ``apt-get install chromium``); skipped, saying so, where there is none.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kuangchao_core.obs.tracking import RUNS_VIEW_METRICS, experiment_tags, experiment_ui_path

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(BROWSER is None, reason="no Chromium here (apt-get install chromium)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _columns(url: str, profile: Path) -> set[str]:
    """The column ids of the runs table the UI renders at ``url`` (a fresh browser profile: no remembered view)."""
    dom = subprocess.run(
        [
            BROWSER,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            "--window-size=2400,1200",
            "--virtual-time-budget=40000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    ).stdout
    return set(re.findall(r'col-id="([^"]+)"', dom))


@pytest.mark.timeout(900)
def test_the_printed_link_opens_the_runs_table_with_the_training_columns(tmp_path):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    exp = client.create_experiment("kc-browser", tags=experiment_tags())  # what every job's experiment carries
    run = client.create_run(exp, tags={"mlflow.runName": "kc-browser-run"})
    for i, name in enumerate(RUNS_VIEW_METRICS):
        client.log_metric(run.info.run_id, name, 0.5 + i)
    client.set_terminated(run.info.run_id)

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store, "--host", "127.0.0.1"]
        + ["--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "the MLflow server did not start"
                time.sleep(1)
        base = f"http://127.0.0.1:{port}"
        wanted = {f"metrics.`{name}`" for name in RUNS_VIEW_METRICS}
        shown = _columns(base + experiment_ui_path(exp), tmp_path / "profile-link")
        assert "attributes.`Run Name`" in shown, f"no runs table at the link: {sorted(shown)}"
        assert wanted <= shown, f"missing columns {sorted(wanted - shown)} of {sorted(shown)}"
        # negative control: the runs tab without the saved view shows no metric column — the view is what adds them
        plain = _columns(f"{base}/#/experiments/{exp}/runs", tmp_path / "profile-plain")
        assert "attributes.`Run Name`" in plain and not wanted & plain, sorted(plain)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
