"""The tracking store failing is an error a user can act on (issue 38 item 8), on a real MLflow SQLite store.

A lock is a real ``BEGIN EXCLUSIVE`` held by another process; corruption is the store's file overwritten with
garbage. A locked store is waited for and the write lands (the control: with no wait, and through MLflow's own
client as before, the same lock fails); a corrupt, foreign or unreachable store is one line naming ``tracking.uri``,
the store and what to do, within seconds. ``kc train`` against them: tests/test_tracking_store_job.py.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kuangchao_core.errors import TrackingStoreError
from kuangchao_core.obs.tracking_store import (
    CORRUPT,
    LOCKED,
    SCHEMA,
    UNREACHABLE,
    StoreClient,
    classify,
    preflight,
    probe_sqlite,
)

ROOT = Path(__file__).resolve().parent.parent

#: holds an exclusive lock on a SQLite file for argv[2] seconds; prints "locked" once it has it
LOCKER = """
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
c.execute("ROLLBACK")
"""


def hold_lock(db: Path, seconds: float) -> subprocess.Popen:
    """Another process holding ``BEGIN EXCLUSIVE`` on ``db`` for ``seconds`` (returned once it holds it)."""
    proc = subprocess.Popen([sys.executable, "-c", LOCKER, str(db), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A real MLflow SQLite store with one run (its tables made once: migrations take seconds)."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    client = MlflowClient(f"sqlite:///{db}")
    exp = client.create_experiment("kc-store-test")
    run = client.create_run(exp)
    (db.parent / "run_id").write_text(run.info.run_id)
    return db


def _run_id(db: Path) -> str:
    return (db.parent / "run_id").read_text()


def test_failures_are_classified_from_the_databases_own_words():
    assert classify(sqlite3.OperationalError("database is locked")).kind == LOCKED
    assert classify(sqlite3.DatabaseError("file is not a database")).kind == CORRUPT
    assert classify(sqlite3.DatabaseError("database disk image is malformed")).kind == CORRUPT
    wrapped = RuntimeError("(sqlite3.DatabaseError) file is not a database\n[SQL: SELECT name FROM sqlite_master]")
    problem = classify(wrapped)
    assert (problem.kind, problem.detail) == (CORRUPT, "file is not a database")
    outer = ValueError("store init failed")
    outer.__cause__ = RuntimeError("Can't locate revision identified by 'ffffffffffff'")
    assert classify(outer).kind == SCHEMA
    assert classify(OSError("Max retries exceeded with url: /api/2.0/mlflow/runs/get")).kind == UNREACHABLE
    assert classify(KeyError("a bug")) is None and classify(ValueError("RESOURCE_DOES_NOT_EXIST")) is None


#: opens a store as a job's start does, in a fresh process (one process caches MLflow's engine): argv[1] ``mlflow``
#: (the pre-fix path, MLflow's own client) or ``preflight`` with the wait argv[3]; prints the outcome as one line
OPENER = """
import sys, time
from kuangchao_core.errors import TrackingStoreError
from kuangchao_core.obs.tracking_store import preflight
from mlflow.tracking import MlflowClient
mode, uri, wait = sys.argv[1], sys.argv[2], float(sys.argv[3])
print("READY", flush=True)
sys.stdin.readline()
started = time.monotonic()
try:
    if mode == "mlflow":
        MlflowClient(uri).search_experiments(max_results=1)
    else:
        preflight(uri, wait, say=lambda line: print("SAID", line, flush=True))
    print("OPENED", round(time.monotonic() - started, 1))
except TrackingStoreError as exc:
    print("ERROR", exc)
except Exception as exc:
    print("RAW", type(exc).__name__, str(exc).splitlines()[0])
"""


def _opener(mode: str, uri: str, wait_s: float) -> subprocess.Popen:
    """A fresh process that imports MLflow, says READY, and opens ``uri`` when told (a line on its stdin)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", OPENER, mode, uri, str(wait_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "READY"
    return proc


@pytest.mark.slow
def test_a_store_locked_at_the_jobs_start_is_waited_for_and_every_write_lands(store):
    """Issue 38 item 8's done-when: a locked store retried. A lock held 12 s by another process while a job's
    process opens the store: the pre-fix path (MLflow's own client) and ``tracking.store_wait_s: 0`` fail after
    SQLite's 5 s (the negative control); the pre-flight waits, says so, and opens it; every write then lands."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    uri, run_id = f"sqlite:///{store}", _run_id(store)
    runs = {
        mode: _opener(mode.split("-")[0], uri, wait)
        for mode, wait in (("mlflow", 0), ("preflight-0", 0), ("preflight-60", 60))
    }
    locker = hold_lock(store, 12)
    try:
        for proc in runs.values():  # all three open the store now, the lock held
            proc.stdin.write("go\n")
            proc.stdin.flush()
        out = {mode: proc.communicate(timeout=120)[0] for mode, proc in runs.items()}
    finally:
        locker.kill()
        locker.wait()
    assert out["mlflow"].startswith("RAW OperationalError (sqlite3.OperationalError) database is locked"), out
    no_wait = out["preflight-0"].strip()
    assert no_wait.startswith(f"ERROR tracking.uri: the MLflow store {uri} stayed locked"), out
    assert "\n" not in no_wait and "tracking.store_wait_s" in no_wait and f"fuser {store}" in no_wait
    said, opened = out["preflight-60"].splitlines()[0], out["preflight-60"].splitlines()[-1]
    assert said.startswith(f"SAID the MLflow store {uri} is locked by another process"), out
    assert "tracking.store_wait_s" in said and opened.startswith("OPENED"), out
    client = StoreClient(uri)
    client.log_batch(run_id, metrics=[Metric("loss", float(s), 0, s) for s in range(1, 5)])
    assert sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, "loss")) == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_write_meeting_a_lock_longer_than_mlflows_own_wait_is_retried(store):
    """Mid-run: an opened MLflow store waits 20 s for a lock (SQLite's busy timeout) and then fails the write (the
    negative control); the job's client retries it until the lock is gone (26 s here) and the steps land."""
    from concurrent.futures import ThreadPoolExecutor

    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    uri, run_id = f"sqlite:///{store}", _run_id(store)
    plain, patient = MlflowClient(uri), StoreClient(uri, wait_s=60, say=lambda line: None)
    plain.get_run(run_id), patient.get_run(run_id)
    locker = hold_lock(store, 26)
    try:
        with ThreadPoolExecutor(2) as pool:
            before = pool.submit(plain.log_batch, run_id, metrics=[Metric("before_fix", 1.0, 0, 1)])
            after = pool.submit(patient.log_batch, run_id, metrics=[Metric("retried", float(s), 0, s) for s in (1, 2)])
            with pytest.raises(Exception, match="database is locked"):
                before.result(timeout=60)
            after.result(timeout=90)
    finally:
        locker.kill()
        locker.wait()
    assert sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, "retried")) == [1, 2]
    assert not MlflowClient(uri).get_metric_history(run_id, "before_fix")


def test_a_corrupt_store_is_one_line_naming_it_and_what_to_do_in_a_second(tmp_path, store):
    db = tmp_path / "mlflow.db"
    db.write_bytes(os.urandom(64 * 1024))
    uri = f"sqlite:///{db}"
    started = time.monotonic()
    with pytest.raises(TrackingStoreError) as info:
        preflight(uri)
    assert time.monotonic() - started < 5
    text = str(info.value)
    assert info.value.kind == CORRUPT and "\n" not in text
    assert text.startswith(f"tracking.uri: the MLflow store {uri} is not a database MLflow can read"), text
    assert f"mv {db} {db}.broken" in text and "backup" in text and "point tracking.uri at another store" in text
    # malformed inside (a good store's pages overwritten past its header): the same line, from the database's words
    broken = tmp_path / "malformed.db"
    data = bytearray(store.read_bytes())
    data[4096:] = os.urandom(len(data) - 4096)
    broken.write_bytes(bytes(data))
    with pytest.raises(TrackingStoreError) as malformed:
        preflight(f"sqlite:///{broken}")
    assert malformed.value.kind == CORRUPT and "malformed" in str(malformed.value)
    # another program's database is not a store either
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE notes (x)").connection.commit()
    assert probe_sqlite(str(other)).kind == CORRUPT


def test_an_unreachable_server_is_one_line_in_seconds():
    from kuangchao_core.sched.launcher import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(TrackingStoreError) as info:
        preflight(uri)
    assert time.monotonic() - started < 10  # not MLflow's own HTTP retries (minutes)
    text = str(info.value)
    assert info.value.kind == UNREACHABLE and "\n" not in text and uri in text and "mlflow server" in text


def test_the_doctor_fails_a_corrupt_store_and_notes_a_locked_one(tmp_path, store):
    from kuangchao_core.sched.service_checks import check_mlflow

    def cfg(uri: str):
        return SimpleNamespace(tracking=SimpleNamespace(uri=uri, store_wait_s=45.0))

    db = tmp_path / "mlflow.db"
    db.write_bytes(b"not a database, just bytes " * 100)
    check = check_mlflow(cfg(f"sqlite:///{db}"))
    assert not check.ok and "is not a database MLflow can read" in check.detail and "mv" in check.fix
    locker = hold_lock(store, 10)
    try:
        check = check_mlflow(cfg(f"sqlite:///{store}"))
    finally:
        locker.kill()
        locker.wait()
    assert check.ok and "locked by another process" in check.detail and "45 s" in check.detail, check
    assert check_mlflow(cfg(f"sqlite:///{store}")).ok
