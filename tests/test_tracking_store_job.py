"""``kc train`` against a tracking store that fails (issue 38 item 8), end to end: real ``kc train`` processes of the
tiny model, a real MLflow SQLite store, a real ``BEGIN EXCLUSIVE`` held by another process.

Before: a locked store ended the job with SQLAlchemy's traceback (~600 lines) once MLflow opened it; a corrupt one
the same after the doctor, the topology probe and MLflow's retries; an unreachable server after MLflow's HTTP
retries (minutes). Now: a lock is waited for (the job says so) and the run has every step; with the wait off
(``tracking.store_wait_s: 0``, the negative control) the same lock is one line; a corrupt store is one line in
seconds, the previous run's checkpoints untouched; an unreachable server is one line.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kuangchao_core.obs.voice import message_of
from tests.conftest_prefect import TINY

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 4

#: waits until argv[2] (a glob) matches, then holds BEGIN EXCLUSIVE on argv[1] for argv[3] seconds
LOCK_WHEN = """
import glob, sqlite3, sys, time
db, pattern, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
deadline = time.monotonic() + 300
while not glob.glob(pattern) and time.monotonic() < deadline:
    time.sleep(0.02)
c = sqlite3.connect(db, isolation_level=None)
c.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(hold)
c.execute("ROLLBACK")
"""


def _kc_train(workdir: Path, uri: str, task: str, prefect_api: str, *extra: str, timeout: int = 400):
    sets = {
        "task.name": task,
        "train.steps": STEPS,
        "train.warmup_steps": 1,
        "train.log_interval": 1,
        "checkpoint.interval": 2,
        "checkpoint.dir": str(workdir / "ckpt"),
        "tracking.uri": uri,
        "tracking.register_model": "null",
        "tracking.log_model": "false",
        "permission.audit_log": str(workdir / "audit"),
    }
    argv = [sys.executable, "-m", "kuangchao.cli.main", "train", "--config", TINY, "--resume", "auto"]
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")] + list(extra)
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "KC_RUNS_DIR": str(workdir / "runs"), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    out = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - started


def _fresh_store(path: Path) -> str:
    """A store with MLflow's tables (made in a subprocess: this process keeps no engine of it)."""
    code = "import sys; from mlflow.tracking import MlflowClient; MlflowClient(sys.argv[1]).search_experiments()"
    uri = f"sqlite:///{path}"
    subprocess.run([sys.executable, "-c", code, uri], check=True, capture_output=True, timeout=120)
    return uri


def _losses(uri: str, task: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(task)
    (run,) = client.search_runs([exp.experiment_id])
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))


def _failure_lines(out: subprocess.CompletedProcess) -> list[str]:
    said = [message_of(line) for line in (out.stdout + out.stderr).splitlines()]
    return [line for line in said if line.startswith("kc train failed")]


def _lock_when(db: Path, pattern: str, hold_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOCK_WHEN, str(db), pattern, str(hold_s)], stdout=subprocess.PIPE)


def test_a_store_locked_at_the_start_is_waited_for_and_the_run_has_every_step(tmp_path, prefect_api):
    """The lock is taken as the run directory appears (before the doctor and the MLflow run) and held 20 s: the
    job says it waits, then trains and logs every step. The negative control: the same lock with
    ``tracking.store_wait_s=0`` ends the job with one line, no traceback."""
    db = tmp_path / "mlflow.db"
    uri = _fresh_store(db)
    task = f"kc-locked-{uuid.uuid4().hex[:6]}"
    locker = _lock_when(db, str(tmp_path / "runs" / task / "*" / "config.yaml"), 20)
    try:
        out, _ = _kc_train(tmp_path, uri, task, prefect_api)
    finally:
        locker.kill()
        locker.wait()
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert f"the MLflow store {uri} is locked by another process" in text, text[-4000:]
    assert _losses(uri, task) == list(range(1, STEPS + 1))
    assert "Traceback" not in text

    control = f"kc-locked-control-{uuid.uuid4().hex[:6]}"
    locker = _lock_when(db, str(tmp_path / "runs" / control / "*" / "config.yaml"), 30)
    try:
        out, _ = _kc_train(tmp_path, uri, control, prefect_api, "--set", "tracking.store_wait_s=0")
    finally:
        locker.kill()
        locker.wait()
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-4000:]
    (line,) = _failure_lines(out)
    assert line.startswith(f"kc train failed: tracking.uri: the MLflow store {uri} stayed locked"), line
    assert "Traceback" not in text and "OperationalError" not in text, text[-4000:]
    assert not (tmp_path / "ckpt" / control).exists()  # nothing computed


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_a_corrupt_store_is_one_line_in_seconds_and_the_checkpoints_stay_intact(tmp_path, prefect_api):
    """A first run leaves a lineage; the store is then overwritten with garbage: the resumed job ends in seconds
    with one line naming the store and what to do; the lineage is byte for byte what it was, and still resumable."""
    from kuangchao_core.ckpt.lineage import plan_resume
    from kuangchao_core.config import load_config
    from kuangchao_core.config.settings import lineage_key

    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    task = f"kc-corrupt-{uuid.uuid4().hex[:6]}"
    out, _ = _kc_train(tmp_path, uri, task, prefect_api)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    ckpt = tmp_path / "ckpt" / task
    before = _tree_digest(ckpt)
    assert any(name.endswith("manifest.json") for name in before)

    db.write_bytes(os.urandom(db.stat().st_size))
    with pytest.raises(sqlite3.DatabaseError):  # what the job meets
        sqlite3.connect(db).execute("SELECT name FROM sqlite_master").fetchall()
    out, took = _kc_train(tmp_path, uri, task, prefect_api, "--set", f"train.steps={STEPS + 2}")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-4000:]
    (line,) = _failure_lines(out)
    assert line.startswith(f"kc train failed: tracking.uri: the MLflow store {uri} is not a database"), line
    assert f"mv {db} {db}.broken" in line and "backup" in line and "tracking.uri" in line
    assert "Traceback" not in text and "sqlalchemy" not in text.lower(), text[-4000:]
    assert took < 30, took  # before: the doctor, the probe and MLflow first (24-120 s on a busy machine)
    assert _tree_digest(ckpt) == before
    cfg = load_config(TINY, [f"task.name={task}", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    assert plan_resume(lineage_key(cfg), "auto").step == STEPS


def test_an_unreachable_tracking_server_is_one_line(tmp_path, prefect_api):
    from kuangchao_core.sched.launcher import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    out, took = _kc_train(tmp_path, uri, f"kc-unreachable-{uuid.uuid4().hex[:6]}", prefect_api)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-4000:]
    (line,) = _failure_lines(out)
    assert uri in line and "mlflow server" in line and "tracking.uri" in line, line
    assert "Traceback" not in text, text[-4000:]
    assert took < 120, took  # not MLflow's HTTP retries
