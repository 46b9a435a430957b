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
def test_the_printed_link_opens_the_runs_table_with_the_training_columns(tmp_path, capsys, monkeypatch):
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
        _a_job_on_the_server_prints_its_links_and_not_mlflows(base, capsys, monkeypatch)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def _a_job_on_the_server_prints_its_links_and_not_mlflows(base: str, capsys, monkeypatch) -> None:
    """A job's run on a tracking server ends without MLflow's "View experiment at" line, which opens the experiment
    in its GenAI view (issue 45 item 4); the job's own links are the run's page and the runs table checked above.
    Control: the same server's run ended with MLflow's printing on says it."""
    from mlflow.tracking import MlflowClient

    from kuangchao_core.config import config_from_dict
    from kuangchao_core.obs.tracking import SUPPRESS_URL_ENV, close_run, run_links

    cfg = config_from_dict({"task": {"name": "kc-links"}, "tracking": {"uri": base}})
    client = MlflowClient(base)
    exp = client.create_experiment("kc-links", tags=experiment_tags())
    control, ours = (client.create_run(exp).info.run_id for _ in range(2))
    monkeypatch.setenv(SUPPRESS_URL_ENV, "false")
    capsys.readouterr()
    client.set_terminated(control)
    assert "View experiment at" in capsys.readouterr().out  # MLflow's own line, when nothing turns it off
    monkeypatch.delenv(SUPPRESS_URL_ENV)
    close_run(cfg, ours)
    assert "View experiment at" not in capsys.readouterr().out
    assert client.get_run(ours).info.status == "FINISHED"
    assert run_links(cfg, ours) == [
        f"MLflow run: {base}/#/experiments/{exp}/runs/{ours}",
        f"MLflow runs table: {base}{experiment_ui_path(exp)}",
    ]
    local = config_from_dict({"task": {"name": "kc-links"}, "tracking": {"uri": "sqlite:///mlflow.db"}})
    assert run_links(local, ours) == []  # a local store: no server address to link
