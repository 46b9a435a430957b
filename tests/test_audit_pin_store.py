"""The append-only audit pin store (issue 38, item 3): pins a worker with the job's files and uid cannot take back.

The attack: a worker process with the job's uid and files (this root test's uid without any capability, as
``setpriv`` starts it: it may write what uid 0 owns, like any user its own files, and no more; it owns the store's
``pins.jsonl`` as the job's uid does, the store's directory is another user's) forges the whole log with a key of its own (every denial an allow), replaces
the trust files beside it, writes a sealed pin of the forgery and then tries to leave only that pin in the store
(truncate, replace, unlink). The MLflow store is out of the picture (in local mode it is the working directory's,
in the worker's reach). With the store append-only the job's own pins stay and the forgery fails; the negative
control is the same attack on the same store without the flag, which then verifies OK.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.audit_external import collect_external_pins
from kuangchao_core.perm.audit_pins import record_audit_pin
from kuangchao_core.perm.audit_seal import seal_audit_log
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.pin_store import (
    PinStoreError,
    append_pin,
    check_store,
    init_store,
    is_append_only,
    read_store,
    store_file,
)
from kuangchao_core.perm.tokens import public_raw
from tests.test_audit_trust import _append

TASK = "task-ps"
REPO = Path(__file__).resolve().parents[1]

ATTACKER = r"""
import array, fcntl, json, os, sys
from pathlib import Path
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.audit_chain import anchors_path_for
from kuangchao_core.perm.audit_pins import pin_of
from kuangchao_core.perm.pin_store import append_pin, store_file
from kuangchao_core.perm.tokens import PURPOSE_AUDIT, TrustedKey, TrustStore, public_raw

log, job, store = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
n = len(log.read_text().splitlines())
key, kid = Ed25519PrivateKey.generate(), "aud-attacker"
log.unlink()
anchors_path_for(log).unlink()
forged = AuditLog(log, job, signer=(kid, key))
for _ in range(n - 1):
    forged.append("all_reduce", actor="worker-0", decision="allow", resource="group:world", reason="first_use")
forged.append("audit_seal", actor="orchestrator", decision="info", resource=f"job:{job}", reason="job_end")
forged.checkpoint()
forged.close()
TrustStore(keys={kid: TrustedKey(kid, PURPOSE_AUDIT, public_raw(key))}).save(f"{log}.trust.json")
pin = pin_of(log, job, kid, public_raw(key), mode="enforcing", sealed=True)
line = json.dumps(pin.to_json(), sort_keys=True, separators=(",", ":")) + "\n"
path, done = store_file(store), {}
def clear_flag():
    fd = os.open(path, os.O_RDONLY)
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, 0x80086601, flags, True)
        flags[0] &= ~0x20
        fcntl.ioctl(fd, 0x40086602, flags, True)
    finally:
        os.close(fd)
try:
    clear_flag()
    done["clear_flag"] = "ok"
except OSError as exc:
    done["clear_flag"] = exc.strerror
attempts = {
    "truncate": lambda: Path(path).write_text(line),
    "replace": lambda: (Path(store, ".new").write_text(line), os.replace(Path(store, ".new"), path)),
    "unlink": lambda: (os.unlink(path), Path(path).write_text(line)),
}
for how, attempt in attempts.items():
    try:
        attempt()
        done[how] = "ok"
        break
    except OSError as exc:
        done[how] = exc.strerror
else:
    append_pin(store, pin.to_json())
    done["append"] = "ok"
print(json.dumps(done))
"""


def _cli(*args):
    from kuangchao.cli.main import app

    return CliRunner().invoke(app, ["audit", "--verify", *map(str, args)])


@pytest.fixture(autouse=True)
def no_other_pins(monkeypatch, tmp_path):
    """No MLflow store (the worker could rewrite the local one) and no Prefect API: the pin store is the only
    place outside the run."""
    monkeypatch.setenv("KC_TRACKING_URI", f"sqlite:///{tmp_path / 'absent' / 'mlflow.db'}")
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "KC_AUDIT_PIN_STORE"):
        monkeypatch.delenv(name, raising=False)


def _sealed_job(base: Path, store: Path) -> SimpleNamespace:
    """An enforcing job's signed log under ``base/job``, its start and sealed pins recorded in ``store``."""
    job = f"{TASK}@run1"
    authority = Authority(base / "keys")
    run = base / "job" / "run"
    run.mkdir(parents=True)
    (run / "job_id").write_text(job + "\n")
    log_path = base / "job" / "audit" / TASK / f"{job}.jsonl"
    signer = authority.audit_signing_key()
    log = AuditLog(log_path, job, signer=signer)
    _append(log, 3)
    log.checkpoint()
    record_audit_pin(run, log_path, job, signer[0], public_raw(signer[1]), mode="enforcing", pin_store=str(store))
    _append(log, 4)
    log.close()
    authority.export_trust_store(f"{log_path}.trust.json")
    seal_audit_log(
        run, log_path, job, signer, public_key_raw=public_raw(signer[1]), mode="enforcing", pin_store=str(store)
    )
    return SimpleNamespace(job=job, run=run, log=log_path)


def test_pins_round_trip_and_one_bad_line_voids_only_itself(tmp_path):
    store = tmp_path / "pins"
    store.mkdir()
    with pytest.raises(PinStoreError, match="pins.jsonl"):
        append_pin(store, {"x": 1})  # never creates the store
    store_file(store).touch()
    job = _sealed_job(tmp_path, store)
    with open(store_file(store), "a") as f:
        f.write("[" * 3000 + "]" * 3000 + "\n" + "not json\n" + "x" * 70_000 + "\n")
    rows = list(read_store(store))
    assert [r[1] is not None for r in rows] == [True, True, False, False, False], rows
    found = collect_external_pins(pin_store=str(store))
    assert [p.sealed for p, _ in found.for_job(job.job)] == [False, True]
    bad = [n for n in found.notes if n.startswith("pin store")]
    assert [n.split(": unreadable")[0].rsplit(":", 1)[1] for n in bad] == ["3", "4", "5"], found.notes
    res = _cli("--log", job.log, "--pin-store", store)
    assert res.exit_code == 0 and res.output.startswith("OK"), res.output
    res = _cli("--log", job.log)  # control: without the store nothing outside pins the enforcing job
    assert res.exit_code == 1 and "no_pins" in res.output, res.output


def test_check_store_names_the_field_and_says_what_is_weak(tmp_path):
    with pytest.raises(PinStoreError, match=r"permission\.pin_store: .*pins\.jsonl.*kc operator pin-store"):
        check_store(tmp_path / "missing")
    store = tmp_path / "pins"
    store.mkdir()
    store_file(store).touch()
    warnings = check_store(store)
    assert any("not append-only" in w for w in warnings) == (not is_append_only(store_file(store))), warnings


def _as_root_with_append_only(tmp: Path) -> None:
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv: the append-only flag needs CAP_LINUX_IMMUTABLE, the worker none")
    probe = tmp / "probe"
    try:
        init_store(probe)
    except PinStoreError as exc:
        pytest.skip(f"this file system keeps no append-only flag: {exc}")
    subprocess.run(["chattr", "-a", str(store_file(probe))], check=False)


@pytest.mark.parametrize("append_only", [True, False], ids=["append_only", "control_plain_file"])
def test_a_worker_with_the_jobs_files_and_uid_cannot_take_back_a_pin(append_only):
    base = Path(tempfile.mkdtemp(prefix="kc-pin-store-"))
    try:
        _as_root_with_append_only(base)
        operator = pwd.getpwnam("nobody")  # owns the store's directory and the one above it
        store = base / "pins"
        if append_only:
            init_store(store)
        else:  # the negative control: the same store, ownership and modes, without the kernel's flag
            store.mkdir(mode=0o755)
            store_file(store).touch(mode=0o644)
        assert is_append_only(store_file(store)) == append_only
        job = _sealed_job(base, store)  # the job's files and the pins file: the job's uid's (0)
        for place in (store, base):
            os.chmod(place, 0o755)
            os.chown(place, operator.pw_uid, operator.pw_gid)
        assert _cli("--log", job.log, "--pin-store", store).exit_code == 0
        attack = subprocess.run(
            [
                "setpriv",
                "--bounding-set=-all",
                "--inh-caps=-all",
                sys.executable,
                "-c",
                ATTACKER,
                str(job.log),
                job.job,
                str(store),
            ],
            env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), "HOME": str(base / "job")},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert attack.returncode == 0, attack.stderr[-3000:]
        done = json.loads(attack.stdout.splitlines()[-1])
        res = _cli("--log", job.log, "--pin-store", store)
        if append_only:
            assert list(done) == ["clear_flag", "truncate", "replace", "unlink", "append"], done
            assert done["append"] == "ok" and "ok" not in list(done.values())[:4], done
            assert is_append_only(store_file(store))
            assert res.exit_code == 1, res.output
            assert "pin_mismatch" in res.output and job.job in res.output, res.output
        else:
            assert list(done) == ["clear_flag", "truncate"] and done["truncate"] == "ok", done
            assert res.exit_code == 0 and res.output.startswith("OK"), res.output  # the forgery passes
    finally:
        for path in base.rglob("pins.jsonl"):
            subprocess.run(["chattr", "-a", str(path)], check=False, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
