"""Issue 5 deployments: a real local Prefect server and process worker run the ``on-demand`` deployment.

Everything is a subprocess of the real CLI: ``prefect server start`` (own PREFECT_HOME and port),
``prefect work-pool create``, ``prefect deploy --all`` from ``deployments/prefect.yaml``, ``prefect worker start``
and ``prefect deployment run … --watch``, which returns when the flow run reaches a final state.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest_prefect import session_store  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).with_name("prefect"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _cli(args: list[str], env: dict, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [PREFECT, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_on_demand_deployment_runs_to_completion(tmp_path, session_store):  # noqa: F811
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}",
        "KC_PROJECT_DIR": str(ROOT),
        "KC_RUNS_DIR": str(tmp_path / "runs"),
        "OMP_NUM_THREADS": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1",  # pick the run up at once instead of on the next 10 s poll
    }
    env.pop("PREFECT_PROFILES_PATH", None)
    logs = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=logs,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    worker = None
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prefect server did not come up in 120 s"
            time.sleep(1)

        _cli(["work-pool", "create", "kuangchao-process", "--type", "process"], env, 120)
        deployed = _cli(["--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"], env, 180)
        assert "on-demand" in deployed.stdout and "nightly-finetune" in deployed.stdout
        worker = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", "kuangchao-process", "--limit", "1"],
            env=env,
            cwd=tmp_path,
            stdout=open(tmp_path / "worker.log", "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        overrides = [
            "task.name=kc-deploy-test",
            "train.steps=8",
            "train.warmup_steps=2",
            "checkpoint.interval=4",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"tracking.uri=sqlite:///{session_store / 'mlflow.db'}",  # the session's store: migrated once
            f"permission.audit_log={tmp_path / 'audit'}",
        ]
        run = _cli(
            [
                "deployment",
                "run",
                "kuangchao-train/on-demand",
                "--param",
                f"config_path={ROOT / 'configs' / 'tiny.yaml'}",
                "--param",
                f"overrides={json.dumps(overrides)}",
                "--watch",
                "--watch-interval",
                "1",
                "--watch-timeout",
                "300",
            ],
            env,
            330,
        )
        assert "Completed" in run.stdout, run.stdout[-3000:]
        assert glob.glob(str(tmp_path / "ckpt" / "kc-deploy-test" / "run-*" / "step_00000008" / "manifest.json"))
        assert list((tmp_path / "runs" / "kc-deploy-test").glob("*/attempt_0"))
    finally:
        if worker is not None:
            _stop(worker)
        _stop(server)
        logs.close()
