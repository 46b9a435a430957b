"""Audit trust pinned outside the log's directory (issue 16): pins, and the five ways `kc audit --verify` was fooled.

Each attack is checked twice: the plain `kc audit --verify --log LOG` of before still accepts it (the negative
control: the attack is real), and `--run RUN_DIR` (or the pins / expected job) refuses it with exit 1 and a reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import stat
import sys
import types
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.audit_chain import anchors_path_for
from kuangchao_core.perm.audit_pins import (
    AuditPinError,
    load_pins,
    pin_of,
    pins_path,
    record_audit_pin,
    record_audit_pin_or_log,
    save_pin,
)
from kuangchao_core.perm.audit_trust import trust_for_run
from kuangchao_core.perm.audit_verify import read_records
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.pin_check import verify_against_pins
from kuangchao_core.perm.tokens import PURPOSE_AUDIT, TrustedKey, TrustStore, public_raw
from tasks.prefect_hooks import PREFECT_HOOKS

JOB = "task-p@run1"


class _Ctx:
    current = None

    @classmethod
    def get(cls):
        return cls.current


@pytest.fixture(autouse=True)
def fake_prefect(monkeypatch):
    """Stand-ins for prefect.context / prefect.artifacts (the real import costs seconds); outside a flow run."""
    calls = []
    ctx = types.ModuleType("prefect.context")
    ctx.FlowRunContext, ctx.TaskRunContext = type("F", (_Ctx,), {}), type("T", (_Ctx,), {})
    arts = types.ModuleType("prefect.artifacts")
    arts.create_markdown_artifact = lambda **kw: calls.append(kw)
    monkeypatch.setitem(sys.modules, "prefect.context", ctx)
    monkeypatch.setitem(sys.modules, "prefect.artifacts", arts)
    return SimpleNamespace(ctx=ctx, arts=arts, calls=calls)


def _append(log, n, start=0):
    for i in range(start, start + n):
        log.append(
            "all_reduce",
            actor=f"worker-{i % 2}",
            decision="deny" if i % 3 == 0 else "allow",
            resource="group:world",
            reason="out_of_scope" if i % 3 == 0 else "first_use",
        )


@pytest.fixture
def job(tmp_path):
    """An enforcing run: 6 signed records, trust store in the authority dir, `<log>.trust.json`, one pin."""
    authority = Authority(tmp_path / "keys")
    run = tmp_path / "run"
    run.mkdir()
    (run / "job_id").write_text(JOB + "\n")
    (run / "config.yaml").write_text("task:\n  name: task-p\npermission:\n  mode: enforcing\n")
    authority.export_trust_store(run / "authority" / "trust_store.json")
    path = tmp_path / "audit" / "task-p" / f"{JOB}.jsonl"
    log = AuditLog(path, JOB, signer=authority.audit_signing_key())
    _append(log, 6)
    log.close()
    authority.export_trust_store(f"{path}.trust.json")
    kid, key = authority.audit_signing_key()
    pin = record_audit_pin(run, path, JOB, kid, public_raw(key), mode="enforcing")
    outside = tmp_path / "outside-pins.json"  # the copy kept outside the run (as MLflow's audit/pins.json)
    shutil.copy(pins_path(run / "authority"), outside)
    _OUTSIDE["pins"] = outside
    return SimpleNamespace(authority=authority, run=run, log=path, kid=kid, key=key, pin=pin, tmp=tmp_path)


_OUTSIDE: dict = {}


def _cli(*args):
    """`kc audit --verify`; with --run, the job's pins kept outside the run are given (issue 26: the run's own
    audit_pins.json is no trust) and the unsealed log (these jobs never end) is accepted."""
    from kuangchao.cli.main import app

    extra = []
    if "--run" in args and "--pins" not in args and _OUTSIDE.get("pins") and _OUTSIDE["pins"].exists():
        extra = ["--pins", _OUTSIDE["pins"], "--allow-unsealed"]
    return CliRunner().invoke(
        app, ["audit", "--verify", "--tracking-uri", "sqlite:///nowhere.db", *map(str, args), *map(str, extra)]
    )


def _rewrite_with(path, signer, n=6, log_id=JOB):
    """The attacker's log: same length, every denial gone, re-anchored with ``signer``."""
    path.unlink()
    anchors_path_for(path).unlink(missing_ok=True)
    log = AuditLog(path, log_id, signer=signer)
    for _ in range(n):
        log.append("all_reduce", actor="worker-0", decision="allow", resource="group:world", reason="first_use")
    log.close()


# ---------------------------------------------------------------------------------------------- the pin itself


def test_pin_records_head_key_fingerprint_and_is_owner_only(job):
    recs = list(read_records(job.log))
    pin = job.pin
    assert (pin.seq, pin.head_hash) == (6, recs[-1]["hash"])
    assert pin.audit_kid == job.kid and pin.audit_key_fp == hashlib.sha256(public_raw(job.key)).hexdigest()
    assert pin.job_id == pin.log_id == JOB and pin.log_path == str(job.log.resolve()) and pin.mode == "enforcing"
    authority_dir = job.run / "authority"
    assert stat.S_IMODE(pins_path(authority_dir).stat().st_mode) == 0o600
    assert stat.S_IMODE(authority_dir.stat().st_mode) == 0o700
    assert load_pins(authority_dir) == [pin]
    save_pin(authority_dir, pin)  # the same state again: not a second pin
    assert len(load_pins(authority_dir)) == 1
    with open(job.log, "ab") as f:
        f.write(b'{"v":1,"seq":7,"tor')  # a torn tail is not the head
    assert pin_of(job.log, JOB, job.kid, public_raw(job.key)).seq == 6
    with pytest.raises(AuditPinError, match="belongs to job"):
        pin_of(job.log, "task-p@run2", job.kid, public_raw(job.key))
    with pytest.raises(AuditPinError, match="does not exist"):
        pin_of(job.tmp / "nope.jsonl", JOB, job.kid, public_raw(job.key))


def test_pins_only_grow_and_an_older_head_still_binds(job, caplog):
    log = AuditLog(job.log, JOB, signer=job.authority.audit_signing_key())
    _append(log, 2, start=6)
    log.close()
    later = record_audit_pin(job.run, job.log, JOB, job.kid, public_raw(job.key))
    assert [p.seq for p in load_pins(job.run / "authority")] == [6, 8]
    assert verify_against_pins(job.log, load_pins(job.run / "authority"), JOB, trust_store=job.authority.trust) == []
    lines = job.log.read_text().splitlines(keepends=True)
    job.log.write_text("".join(lines[:4]))
    save_pin(job.run / "authority", pin_of(job.log, JOB, job.kid, public_raw(job.key)))
    assert "behind the pinned seq 8" in caplog.text
    problems = verify_against_pins(job.log, load_pins(job.run / "authority"), JOB)
    assert {p.problem for p in problems} == {"pin_truncated"} and len(problems) == 2, problems
    assert later.seq == 8


def test_clean_run_verifies_pinned_and_plain_log_says_unpinned(job):
    res = _cli("--run", job.run)
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"OK {job.log.resolve()}: 6 records") and "pinned head seq 6" in res.output
    assert "unpinned" not in res.output
    plain = _cli("--log", job.log, "--mode", "trusted")  # the old command keeps working, and says what it trusted
    assert plain.exit_code == 0 and plain.output.startswith("OK") and "trust unpinned" in plain.output
    as_json = json.loads(_cli("--run", job.run, "--json").output)
    assert as_json["ok"] and as_json["pinned"] and as_json["mode"] == "enforcing" and as_json["head_seq"] == 6


# ---------------------------------------------------------------------------------------------- the five attacks


def test_1_log_resigned_with_a_new_key_beside_the_log(job):
    attacker = Ed25519PrivateKey.generate()
    _rewrite_with(job.log, ("aud-attacker", attacker))
    TrustStore(keys={"aud-attacker": TrustedKey("aud-attacker", PURPOSE_AUDIT, public_raw(attacker))}).save(
        f"{job.log}.trust.json"
    )
    assert (
        _cli("--log", job.log, "--mode", "trusted").exit_code == 0
    )  # control: the trust store beside the log vouches for the forgery
    res = _cli("--run", job.run)
    assert res.exit_code == 1 and "pin_mismatch" in res.output and "unpinned_key" in res.output, res.output
    res = _cli("--log", job.log, "--pins", pins_path(job.run / "authority"))  # the pins alone catch it too
    assert res.exit_code == 1 and "unpinned_key" in res.output, res.output


def test_1b_new_key_under_the_pinned_kid_in_every_trust_store(job):
    attacker = Ed25519PrivateKey.generate()
    _rewrite_with(job.log, (job.kid, attacker))
    forged = TrustStore(keys={job.kid: TrustedKey(job.kid, PURPOSE_AUDIT, public_raw(attacker))})
    forged.save(f"{job.log}.trust.json")
    forged.save(job.run / "authority" / "trust_store.json")
    assert _cli("--log", job.log, "--mode", "trusted").exit_code == 0  # control
    res = _cli("--run", job.run)
    assert res.exit_code == 1 and "pin_key_mismatch" in res.output and "trust store was replaced" in res.output
    assert "pin_mismatch" in res.output, res.output


def test_2_truncated_with_anchors_deleted(job):
    lines = job.log.read_text().splitlines(keepends=True)
    job.log.write_text("".join(lines[:3]))
    anchors_path_for(job.log).unlink()
    plain = _cli("--log", job.log, "--mode", "trusted")
    assert plain.exit_code == 0 and "no signed checkpoints" in plain.output  # control: only a warning
    res = _cli("--run", job.run)
    assert res.exit_code == 1, res.output
    assert "pin_truncated" in res.output and "3 records were cut off" in res.output and "no_anchors" in res.output


def test_2b_truncated_and_regrown_without_the_key(job):
    lines = job.log.read_text().splitlines(keepends=True)
    job.log.write_text("".join(lines[:3]))
    anchors_path_for(job.log).unlink()
    worker = AuditLog(job.log, JOB)  # a worker's log continues the cut chain; it holds no audit key
    _append(worker, 5)
    worker.close()
    assert _cli("--log", job.log, "--mode", "trusted").exit_code == 0  # control
    res = _cli("--run", job.run, "--mode", "trusted")  # even without the enforcing requirements: the pin binds
    assert res.exit_code == 1 and "pin_mismatch" in res.output and "seq 6 differs" in res.output, res.output


def test_3_log_swapped_for_another_jobs(job, tmp_path):
    other_auth = Authority(tmp_path / "other-keys")
    other = tmp_path / "other.jsonl"
    log = AuditLog(other, "task-p@run2", signer=other_auth.audit_signing_key())
    _append(log, 6)
    log.close()
    shutil.copy(other, job.log)
    shutil.copy(anchors_path_for(other), anchors_path_for(job.log))
    other_auth.export_trust_store(f"{job.log}.trust.json")
    assert _cli("--log", job.log, "--mode", "trusted").exit_code == 0  # control: the log id is read from the log itself
    res = _cli("--run", job.run)
    assert res.exit_code == 1 and "first bad record seq 1" in res.output and "wrong_log_id" in res.output
    res = _cli("--log", job.log, "--job-id", JOB)  # the expected job alone, without the run, catches it
    assert res.exit_code == 1 and "wrong_log_id" in res.output, res.output
    assert _cli("--run", job.run, "--job-id", "task-p@run2").exit_code == 2  # contradicts <run>/job_id


def test_4_enforcing_job_without_trust_store(job):
    """Issue 26: the pins carry the audit key, so deleting every trust store costs nothing; the run dir saying
    trusted does not change the pins' mode; without pins an enforcing log fails."""
    (job.run / "authority" / "trust_store.json").unlink()
    job.log.with_name(job.log.name + ".trust.json").unlink()
    plain = _cli("--log", job.log, "--mode", "trusted")
    assert plain.exit_code == 0 and "signatures not checked" in plain.output  # control: silently unchecked
    res = _cli("--run", job.run)
    assert res.exit_code == 0 and "3 signed checkpoints" not in res.output, res.output
    res = _cli("--log", job.log, "--mode", "enforcing")
    assert res.exit_code == 1 and "no_trust_store" in res.output and "no_pins" in res.output, res.output


def test_4b_mode_comes_from_pins_outside_the_run_never_its_config(job):
    from kuangchao_core.perm.audit_external import ExternalPins

    (job.run / "config.yaml").write_text("permission:\n  mode: trusted\n")
    outside = ExternalPins()
    outside.add(job.pin, "test")
    assert trust_for_run(job.run, external=outside).mode == "enforcing"  # the pin says enforcing
    assert trust_for_run(job.run).mode == "enforcing"  # no pins outside: enforcing, not the run's config
    res = _cli("--log", job.log)  # enforcing without pins outside the run fails, naming them
    assert res.exit_code == 1 and "no_pins" in res.output, res.output


def test_5_anchors_and_pins_without_a_log(job):
    job.log.unlink()
    res = _cli("--run", job.run)
    assert res.exit_code == 1 and "anchors without a log" in res.output and str(job.log.resolve()) in res.output
    assert "pin at seq 6" in res.output, res.output
    res = _cli("--log", job.log)  # today: "no audit log" (exit 2), as if nothing had been there
    assert res.exit_code == 1 and "anchors without a log" in res.output, res.output
    res = _cli("--task", "task-p", "--log", job.tmp / "audit")
    assert res.exit_code == 1 and "anchors without a log" in res.output, res.output
    anchors_path_for(job.log).unlink()  # control: nothing left at all is a bad argument, not a verdict
    assert _cli("--task", "task-p", "--log", job.tmp / "audit").exit_code == 2


# ---------------------------------------------------------------------------------------------- MLflow, Prefect


def test_record_audit_pin_reaches_mlflow_and_prefect(job, monkeypatch, fake_prefect):
    calls = []

    class Client:
        def __init__(self, tracking_uri=None):
            calls.append(("uri", tracking_uri))

        def set_tag(self, run_id, key, value):
            calls.append(("tag", run_id, key, json.loads(value)))

        def log_dict(self, run_id, obj, path):
            calls.append(("dict", run_id, path, obj))

    monkeypatch.setitem(sys.modules, "mlflow.tracking", types.SimpleNamespace(MlflowClient=Client))
    fake_prefect.ctx.TaskRunContext.current = object()  # inside the launch task
    pin = record_audit_pin(
        job.run,
        job.log,
        JOB,
        job.kid,
        public_raw(job.key),
        mlflow_run_id="r1",
        tracking_uri="sqlite:///x.db",
        hooks=PREFECT_HOOKS,
    )
    assert calls[0] == ("uri", "sqlite:///x.db")
    assert calls[1] == ("tag", "r1", "kuangchao.audit_pin", pin.to_json())
    assert calls[2][:3] == ("dict", "r1", "audit/pins.json") and calls[2][3]["pins"][-1] == pin.to_json()
    (art,) = fake_prefect.calls
    assert art["key"] == "kc-audit-pin" and pin.head_hash in art["markdown"]
    fake_prefect.ctx.TaskRunContext.current = None  # control: outside a flow run nothing is published
    record_audit_pin(job.run, job.log, JOB, job.kid, public_raw(job.key), hooks=PREFECT_HOOKS)
    assert len(fake_prefect.calls) == 1
    fake_prefect.ctx.TaskRunContext.current = object()  # control: without the orchestrator's hooks neither
    record_audit_pin(job.run, job.log, JOB, job.kid, public_raw(job.key))
    assert len(fake_prefect.calls) == 1


def test_record_audit_pin_survives_mlflow_and_prefect_down(job, monkeypatch, fake_prefect, caplog):
    class Down:
        def __init__(self, tracking_uri=None):
            raise ConnectionError("tracking server unreachable")

    def refuse(**kw):
        raise RuntimeError("prefect API down")

    monkeypatch.setitem(sys.modules, "mlflow.tracking", types.SimpleNamespace(MlflowClient=Down))
    fake_prefect.arts.create_markdown_artifact = refuse
    fake_prefect.ctx.FlowRunContext.current = object()
    log = AuditLog(job.log, JOB, signer=job.authority.audit_signing_key())
    _append(log, 1)
    log.close()
    with caplog.at_level(logging.WARNING, logger="kuangchao.perm.audit_pins"):
        pin = record_audit_pin(
            job.run, job.log, JOB, job.kid, public_raw(job.key), mlflow_run_id="r1", hooks=PREFECT_HOOKS
        )
    assert "not recorded in MLflow" in caplog.text and "not recorded as a Prefect artifact" in caplog.text
    assert load_pins(job.run / "authority")[-1] == pin and pin.seq == 7
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)  # MLflow not installed at all
    record_audit_pin(job.run, job.log, JOB, job.kid, public_raw(job.key), mlflow_run_id="r1")
    assert caplog.text.count("not recorded in MLflow") == 2


def test_record_audit_pin_or_log_never_raises_on_shutdown(job, caplog):
    assert record_audit_pin_or_log(job.run, job.tmp / "gone.jsonl", JOB, job.kid, public_raw(job.key)) is None
    assert "audit log not pinned" in caplog.text and len(load_pins(job.run / "authority")) == 1
    with pytest.raises(AuditPinError):  # control: the strict call raises for the same log
        record_audit_pin(job.run, job.tmp / "gone.jsonl", JOB, job.kid, public_raw(job.key))
    pin = record_audit_pin_or_log(job.run, job.log, JOB, job.kid, public_raw(job.key))
    assert pin is not None and (pin.seq, pin.head_hash) == (job.pin.seq, job.pin.head_hash)
