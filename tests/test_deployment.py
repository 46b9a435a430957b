"""Issue 5 deployments: a real Prefect server and process worker run the ``on-demand`` deployment.

Everything is a subprocess of the real CLI against the session's Prefect server (a real server process;
``prefect server start`` itself runs in ``tests/test_cluster.py``): ``prefect work-pool create``,
``prefect deploy --all`` from ``deployments/prefect.yaml``, ``prefect worker start`` and
``prefect deployment run … --watch``, which returns when the flow run reaches a final state.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest_prefect import session_store  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).with_name("prefect"))


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
def test_on_demand_deployment_runs_to_completion(prefect_api, tmp_path, session_store):  # noqa: F811
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "KC_PROJECT_DIR": str(ROOT),
        "KC_RUNS_DIR": str(tmp_path / "runs"),
        "OMP_NUM_THREADS": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1",  # pick the run up at once instead of on the next 10 s poll
    }
    env.pop("PREFECT_PROFILES_PATH", None)
    worker = None
    try:
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
