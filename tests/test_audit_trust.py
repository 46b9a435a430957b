"""Audit trust outside the run (issue 26, item 3): each attack that `kc audit --verify` accepted before, refused.

The job below is what a flow run leaves: an enforcing job's signed log, its run directory (job id, trust store,
``authority/audit_pins.json``), and its pins in a real MLflow store (the job's MLflow run) — the start pin and the
sealed pin the orchestrator records as its last act. Every attack rewrites only what a worker's uid can reach (the
log, its anchors, the run directory); the MLflow store stays out of reach. The untouched job verifies OK (control).
"""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.audit_chain import anchors_path_for, record_hash
from kuangchao_core.perm.audit_pins import pin_of, pins_path, record_audit_pin, save_pin
from kuangchao_core.perm.audit_seal import seal_audit_log
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.tokens import PURPOSE_AUDIT, TrustedKey, TrustStore, canonical_json, public_raw

TASK = "task-t"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One MLflow sqlite store for the module (its migrations take seconds)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    return SimpleNamespace(uri=uri, client=client, exp=client.create_experiment(TASK))


@pytest.fixture(autouse=True)
def outside(monkeypatch, store):
    """`kc audit` finds the MLflow store as an operator's shell does ($KC_TRACKING_URI); no Prefect API (outside
    a flow run nothing is published to it either)."""
    monkeypatch.setenv("KC_TRACKING_URI", store.uri)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


def _append(log, n):
    for i in range(n):
        log.append(
            "all_reduce",
            actor=f"worker-{i % 2}",
            decision="deny" if i % 3 == 0 else "allow",
            resource="group:world",
            reason="out_of_scope" if i % 3 == 0 else "first_use",
            jti=f"{i:024x}",
        )


def _make_job(tmp_path, store, *, seal: bool = True):
    job = f"{TASK}@{uuid.uuid4().hex[:8]}"
    authority = Authority(tmp_path / "keys")
    run = tmp_path / "run"
    run.mkdir()
    (run / "job_id").write_text(job + "\n")
    (run / "config.yaml").write_text(f"task:\n  name: {TASK}\npermission:\n  mode: enforcing\n")
    authority.export_trust_store(run / "authority" / "trust_store.json")
    path = tmp_path / "audit" / TASK / f"{job}.jsonl"
    signer = authority.audit_signing_key()
    mlflow_run = store.client.create_run(store.exp, tags={"kuangchao.run_dir": str(run.resolve())}).info.run_id
    pin_args = dict(mlflow_run_id=mlflow_run, tracking_uri=store.uri, mode="enforcing")
    log = AuditLog(path, job, signer=signer)
    _append(log, 2)
    log.checkpoint()
    record_audit_pin(run, path, job, signer[0], public_raw(signer[1]), **pin_args)  # the launch's start pin
    _append(log, 5)
    log.close()
    authority.export_trust_store(f"{path}.trust.json")
    if seal:  # the orchestrator's last act
        seal_audit_log(run, path, job, signer, public_key_raw=public_raw(signer[1]), **pin_args)
    return SimpleNamespace(job=job, run=run, log=path, signer=signer, tmp=tmp_path, authority=authority)


@pytest.fixture
def job(tmp_path, store):
    return _make_job(tmp_path, store)


def _cli(*args):
    from kuangchao.cli.main import app

    return CliRunner().invoke(app, ["audit", "--verify", *map(str, args)])


def _lines(path):
    return path.read_text().splitlines(keepends=True)


def test_control_the_untouched_sealed_job_verifies_in_every_form(job):
    res = _cli("--run", job.run)
    assert res.exit_code == 0 and res.output.startswith("OK"), res.output
    assert "unpinned" not in res.output
    for args in (("--log", job.log), ("--task", TASK, "--log", job.tmp / "audit")):
        res = _cli(*args)
        assert res.exit_code == 0 and res.output.startswith("OK"), res.output


def test_rewrite_reanchor_and_replaced_trust_store_and_pins_in_the_run_dir(job):
    """Attack: every denial removed, the log re-anchored with the attacker's key, the run's trust store, its
    ``audit_pins.json`` and ``<log>.trust.json`` replaced to match — everything in reach of a worker's uid."""
    attacker = Ed25519PrivateKey.generate()
    kid = "aud-attacker"
    n = len(_lines(job.log))
    job.log.unlink()
    anchors_path_for(job.log).unlink()
    forged = AuditLog(job.log, job.job, signer=(kid, attacker))
    for _ in range(n - 1):
        forged.append("all_reduce", actor="worker-0", decision="allow", resource="group:world", reason="first_use")
    forged.append("audit_seal", actor="orchestrator", decision="info", resource=f"job:{job.job}", reason="job_end")
    forged.close()
    store = TrustStore(keys={kid: TrustedKey(kid, PURPOSE_AUDIT, public_raw(attacker))})
    store.save(job.run / "authority" / "trust_store.json")
    store.save(f"{job.log}.trust.json")
    pins_path(job.run / "authority").unlink()
    save_pin(job.run / "authority", pin_of(job.log, job.job, kid, public_raw(attacker), mode="enforcing"))
    res = _cli("--run", job.run)
    assert res.exit_code == 1, res.output
    assert "pin_mismatch" in res.output and "bad_checkpoint" in res.output, res.output
    res = _cli("--task", TASK, "--log", job.tmp / "audit")  # found by the log's path, the same verdict
    assert res.exit_code == 1 and "pin_mismatch" in res.output, res.output


def _rechain(lines: list[str], start: int) -> list[str]:
    """The attacker's repair: re-hash every record from index ``start`` on, so the chain is whole again."""
    out = lines[:start]
    prev = json.loads(out[-1])["hash"] if out else None
    for line in lines[start:]:
        rec = json.loads(line)
        rec["prev_hash"] = prev or rec["prev_hash"]
        body = {k: v for k, v in rec.items() if k != "hash"}
        rec["hash"] = record_hash(rec["prev_hash"], body)
        prev = rec["hash"]
        out.append(canonical_json(rec).decode() + "\n")
    return out


@pytest.mark.parametrize("attack", ["append", "edit", "delete"])
def test_tail_record_appended_edited_or_deleted(job, attack):
    """Attack on the records after the last anchor the workers wrote: a correctly chained forgery appended, the
    last worker record's decision flipped and the chain re-hashed, or the last record deleted."""
    lines = _lines(job.log)
    if attack == "append":
        worker = AuditLog(job.log, job.job)  # the chain continues: no key is needed to extend it
        worker.append("all_reduce", actor="worker-1", decision="allow", resource="group:world", reason="first_use")
        worker.close()
    elif attack == "edit":
        i = len(lines) - 2  # the last worker record, just before the seal
        rec = json.loads(lines[i])
        rec["decision"] = "deny" if rec["decision"] == "allow" else "allow"
        lines[i] = canonical_json(rec).decode() + "\n"
        job.log.write_text("".join(_rechain(lines, i)))
    else:
        job.log.write_text("".join(lines[:-1]))
        anchors_path_for(job.log).write_text(
            "".join(a for a in _lines(anchors_path_for(job.log)) if json.loads(a)["seq"] < len(lines))
        )
    from kuangchao_core.perm.audit_verify import verify_log

    assert verify_log(job.log, log_id=job.job).ok or attack == "edit"  # the chain alone is whole
    res = _cli("--run", job.run)
    assert res.exit_code == 1, res.output
    expected = {"append": "after_seal", "edit": "pin_mismatch", "delete": "pin_truncated"}[attack]
    assert expected in res.output, res.output
    assert _cli("--log", job.log).exit_code == 1


def test_log_cut_in_half_with_anchors_and_trust_file_deleted(job):
    """Attack: half the log cut off, its anchors and ``<log>.trust.json`` deleted, so nothing beside the log says
    the job was enforcing; `kc audit --task T --verify` used to accept it with warnings."""
    lines = _lines(job.log)
    job.log.write_text("".join(lines[: len(lines) // 2]))
    anchors_path_for(job.log).unlink()
    job.log.with_name(job.log.name + ".trust.json").unlink()
    res = _cli("--task", TASK, "--log", job.tmp / "audit")
    assert res.exit_code == 1, res.output
    assert "pin_truncated" in res.output and "no_anchors" in res.output, res.output


def test_deleted_log_named_by_external_pins_fails_the_task(job):
    job.log.unlink()
    anchors_path_for(job.log).unlink()
    job.log.with_name(job.log.name + ".trust.json").unlink()
    (job.tmp / "audit" / TASK / "other.jsonl").write_text("")  # the task still has a log to look at
    res = _cli("--task", TASK, "--log", job.tmp / "audit")
    assert res.exit_code == 1 and "anchors without a log" in res.output, res.output


def test_unsealed_job_fails_unless_allowed(tmp_path, store):
    """A job whose orchestrator died: its tail after the last pin is vouched for by nothing."""
    job = _make_job(tmp_path, store, seal=False)
    res = _cli("--run", job.run)
    assert res.exit_code == 1 and "unsealed" in res.output, res.output
    res = _cli("--run", job.run, "--allow-unsealed")  # a job still running: said, accepted
    assert res.exit_code == 0 and "unsealed" in res.output, res.output


def test_run_dir_pins_alone_are_not_trust(job, monkeypatch, tmp_path):
    """Without the MLflow store the run's own ``audit_pins.json`` does not vouch for the log (its writer could
    have replaced it); the job id and mode in the run directory are not taken either."""
    monkeypatch.setenv("KC_TRACKING_URI", f"sqlite:///{tmp_path / 'nowhere.db'}")
    (job.run / "config.yaml").write_text("permission:\n  mode: trusted\n")
    res = _cli("--run", job.run)
    assert res.exit_code == 1 and "no_pins" in res.output, res.output


def test_job_id_file_contradicting_the_pins_fails(job):
    (job.run / "job_id").write_text(f"{TASK}@someone-else\n")
    res = _cli("--run", job.run)
    assert res.exit_code == 1 and "job_id_mismatch" in res.output, res.output


# ---------------------------------------------------------------------------------------------- revocation


def test_kc_token_revoke_of_an_id_from_the_audit_log_revokes_the_renewed_session(tmp_path):
    """Attack: the holder renewed, so the token id the audit log shows is no longer its newest; revoking that id
    used to change nothing. Now it revokes the session: the holder's next renewal and use are refused."""
    from kuangchao.cli.main import app
    from kuangchao_core.config import load_config
    from kuangchao_core.perm.issuance import close_authority, issue_tokens_for_run, issued_tokens
    from tests.test_revocation import ROOT

    cfg = load_config(
        str(ROOT / "configs" / "tiny.yaml"),
        [f"task.name=kc-rv-{uuid.uuid4().hex[:6]}", f"permission.audit_log={tmp_path / 'audit'}"],
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    env = issue_tokens_for_run(cfg, run_dir, 0)
    from kuangchao_core.perm.issuance import authority_for

    authority = authority_for(cfg, run_dir)
    try:
        job = env["KC_JOB_ID"]
        first = issued_tokens(run_dir, 0)["worker-1"]
        token = authority.renew(first, job, caller="worker-1")
        shown = authority.verifier(job).verify(token, subject="worker-1").jti  # what its records carried for a while
        token = authority.renew(token, job, caller="worker-1")  # then it renewed again
        other = authority.renew(issued_tokens(run_dir, 0)["worker-0"], job, caller="worker-0")
        res = CliRunner().invoke(app, ["token", "revoke", "--run", str(run_dir), shown, "--reason", "leaked"])
        assert res.exit_code == 0, res.output
        with pytest.raises(R.TokenRejected) as exc:
            authority.renew(token, job, caller="worker-1")
        assert exc.value.code == R.REVOKED
        with pytest.raises(R.TokenRejected):
            authority.verifier(job).verify(token, subject="worker-1")
        assert authority.renew(other, job, caller="worker-0")  # control: another session keeps renewing
    finally:
        close_authority(run_dir)
