"""Which failures a lifecycle task retries (issue 44 item 4): :func:`kuangchao_core.sched.transient.classify_failure`
over real exceptions — a refused connection, a held port's EADDRINUSE, a socket read that timed out, a locked SQLite
database and the tracking store's own ``locked`` error, S3 and httpx clients against endpoints that refuse or never
answer — against real permanent ones: the config loader's ``ConfigError``, the default-deny guard's
``PermissionDenied``, the publishing gate's ``NotPublishable``. Each transient kind has a control of the same class
that is permanent (another errno, another SQLite error, the store gate's refusal, which is a ``ConnectionError``), and
a permanent error anywhere in the chain wins. The doctor's probes mark their failed checks the same way."""

from __future__ import annotations

import errno
import sqlite3

import pytest

from kuangchao_core.errors import DataError, WorkerFailed
from kuangchao_core.sched import service_checks
from kuangchao_core.sched.store_gate import GateRefused
from kuangchao_core.sched.transient import classify_failure, mark_failure
from tests import real_faults as F

TRANSIENT = {
    "refused connection": F.refused_connection,
    "port in use": F.address_in_use,
    "socket timeout": F.socket_timeout,
    "urllib over a refused connection": F.url_refused,
    "S3 endpoint refused": F.s3_refused,
    "S3 read timeout": F.s3_read_timeout,
    "httpx refused": F.httpx_refused,
}
PERMANENT = {
    "ConfigError": F.config_error,
    "PermissionDenied": F.permission_denied,
    "NotPublishable": F.not_publishable,
}


@pytest.mark.parametrize("name", sorted(TRANSIENT))
def test_network_faults_are_transient(name):
    exc = TRANSIENT[name]()
    transient, reason = classify_failure(exc)
    assert transient, (name, reason)
    assert type(exc).__name__ in reason or "Refused" in reason, reason  # the reason names the error


@pytest.mark.parametrize("name", sorted(PERMANENT))
def test_refusals_are_permanent(name):
    exc = PERMANENT[name]()
    assert type(exc).__name__ == name
    transient, reason = classify_failure(exc)
    assert not transient and name in reason, reason


def test_a_port_in_use_is_transient_and_another_oserror_is_not():
    exc = F.address_in_use()
    assert exc.errno == errno.EADDRINUSE and classify_failure(exc)[0]
    with pytest.raises(OSError) as missing:  # control: the same class, an errno no retry cures
        open("/nonexistent-kc-dir/file")
    assert missing.value.errno == errno.ENOENT and not classify_failure(missing.value)[0]


def test_a_locked_sqlite_store_is_transient_and_a_corrupt_one_is_not(tmp_path):
    locked = F.sqlite_locked(tmp_path / "locked.db")
    assert isinstance(locked, sqlite3.OperationalError) and "locked" in str(locked)
    assert classify_failure(locked) == (True, "store locked: database is locked")
    store = F.store_locked(tmp_path / "store.db")  # the tracking store's own error, its cause the lock
    assert type(store).__name__ == "TrackingStoreError" and store.kind == "locked"
    assert classify_failure(store)[0]
    (tmp_path / "junk.db").write_bytes(b"not a database at all, just sixteen+ bytes of text" * 4)
    con = sqlite3.connect(tmp_path / "junk.db")
    corrupt = F.caught(lambda: con.execute("SELECT * FROM sqlite_master").fetchall())
    con.close()
    assert "not a database" in str(corrupt) and not classify_failure(corrupt)[0]  # control


def test_a_refusal_that_is_a_connection_error_stays_permanent():
    assert isinstance(GateRefused("wrong key"), ConnectionError)  # what would make it look transient
    assert classify_failure(GateRefused("the peer does not hold the job's store key")) == (
        False,
        "the store gate refused the job's key: GateRefused: the peer does not hold the job's store key",
    )


def test_the_chain_is_read_and_a_permanent_error_in_it_wins():
    refused = F.refused_connection()
    try:
        raise RuntimeError("mirror upload failed") from refused
    except RuntimeError as exc:
        assert classify_failure(exc)[0]  # the cause is transient
    try:
        try:
            raise refused
        except ConnectionRefusedError:
            raise F.config_error()  # noqa: B904 - the implicit context is the point
    except Exception as exc:
        assert exc.__context__ is refused and not classify_failure(exc)[0]
    assert not classify_failure(RuntimeError("mirror upload failed"))[0]  # control: nothing transient in it


def test_unknown_failures_and_worker_failures_are_not_retried():
    transient, reason = classify_failure(KeyError("step"))
    assert not transient and reason.startswith("not a failure known to pass on a retry: KeyError")
    assert not classify_failure(WorkerFailed(1, "exit code 1"))[0]
    assert not classify_failure(DataError("3 records, 500 needed"))[0]


def test_a_stated_kind_overrides_the_classes():
    exc = mark_failure(F.refused_connection(), False, "after the workers' start")
    assert classify_failure(exc) == (False, "after the workers' start")
    assert classify_failure(F.refused_connection())[0]  # control: unmarked, the same fault is transient


def test_doctor_probes_mark_services_that_did_not_answer_transient(tmp_path, monkeypatch):
    port = F.free_port()
    mlflow = service_checks.check_mlflow({"tracking": {"uri": f"http://127.0.0.1:{port}"}}, timeout=2)
    assert not mlflow.ok and mlflow.transient, mlflow
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{port}/api")
    prefect = service_checks.check_prefect(timeout=2)
    assert not prefect.ok and prefect.transient, prefect
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "kc")  # without credentials botocore refuses before connecting
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "kc-test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3 = service_checks.check_checkpoint_storage(
        {"checkpoint": {"uri": "s3://kc/ckpt", "endpoint_url": f"http://127.0.0.1:{port}"}}
    )
    assert not s3.ok and s3.transient, s3
    blocker = tmp_path / "file"
    blocker.write_text("x")
    local = service_checks.check_checkpoint_storage({"checkpoint": {"dir": str(blocker / "ckpt")}})
    assert not local.ok and not local.transient, local  # control: a path that cannot be a directory


def test_a_doctor_report_is_transient_only_when_every_failed_check_is():
    from kuangchao_core.sched.doctor_report import Check, DoctorReport

    down = Check("mlflow", False, "MLflow server not reachable: ConnectionRefusedError", transient=True)
    bad_dir = Check("checkpoint_storage", False, "NotADirectoryError", transient=False)
    assert DoctorReport([down, Check("versions", True, "ok")]).failure_kind()[0]
    transient, reason = DoctorReport([down, bad_dir]).failure_kind()  # control: one lasting failure decides
    assert not transient and reason.endswith("cannot mend: checkpoint_storage"), reason


def test_a_failure_once_the_path_exists_is_marked_permanent(tmp_path):
    from kuangchao_core.sched.transient import permanent_once_exists

    started = tmp_path / "attempt_0"
    with pytest.raises(OSError) as before, permanent_once_exists(started, "the workers' start"):
        raise F.address_in_use()
    assert classify_failure(before.value)[0]  # nothing started yet: a retry may pass
    started.mkdir()
    with pytest.raises(OSError) as after, permanent_once_exists(started, "the workers' start"):
        raise F.address_in_use()
    transient, reason = classify_failure(after.value)
    assert not transient and reason.startswith("OSError after the workers' start (attempt_0 exists)"), reason
