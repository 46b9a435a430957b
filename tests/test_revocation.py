"""Revocation during a run (issue 16): an operator-signed ``kc token revoke`` stops a module within one renewal
period, through the real renewal endpoint and the workers' renewal threads; an unsigned or untrusted revocation
changes nothing; the commands refuse without an operator key the job trusts or without the job's authority."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.config import load_config
from kuangchao_core.perm import guard_api
from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.audit_verify import read_records
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.operator import OperatorKey, create_operator_key
from kuangchao_core.perm.revocation import append_revocation, sign_revocation
from kuangchao_core.perm.roles import Policy
from kuangchao_core.perm.runtime import RenewalServer, module_guard

ROOT = Path(__file__).resolve().parent.parent
RUN = CliRunner()
JOB = "job-rv"
TTL = 2.0  # renewal at half the lifetime: one renewal period is 1 s


@pytest.fixture(autouse=True)
def restore_guard():
    prev = guard_api.current_guard()
    yield
    guard_api.install_guard(prev)


def _denied_code(guard) -> str | None:
    try:
        guard.check("all_reduce", "group:world")
    except R.GuardDenied as exc:
        return exc.code
    return None


def test_a_revoked_module_loses_its_rights_within_one_renewal_period(tmp_path):
    auth = Authority(tmp_path / "authority")
    alice = OperatorKey("alice", Ed25519PrivateKey.generate())
    mallory = OperatorKey("mallory", Ed25519PrivateKey.generate())
    auth.trust_operators([alice.public])
    audit = tmp_path / "audit.jsonl"
    with RenewalServer(auth, JOB, 0, audit_log=audit, ttl_s=TTL) as server:
        guards = {}
        for module in ("worker-0", "worker-1"):
            token = auth.issue(module, "trainer", JOB, 0, interfaces=["all_reduce"], groups=["world"], ttl_s=TTL)
            guards[module] = module_guard(token, module, auth.trust, Policy(), JOB, 0, authority_addr=server.address)
        time.sleep(1.5 * TTL)  # both renew (their first tokens would have expired otherwise)
        assert all(_denied_code(g) is None for g in guards.values())
        assert min(g.renewals_applied for g in guards.values()) >= 1
        # an untrusted signer's revocation is skipped: worker-1 keeps renewing
        append_revocation(auth.revocations_path, sign_revocation(mallory, JOB, "worker-1"))
        append_revocation(auth.revocations_path, sign_revocation(alice, JOB, "worker-0", "leaked"))
        t0 = time.monotonic()
        while _denied_code(guards["worker-0"]) is None and time.monotonic() - t0 < 3 * TTL:
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert _denied_code(guards["worker-0"]) == R.REVOKED
        assert took <= TTL / 2 + 1.0, f"revocation took {took:.2f}s; one renewal period is {TTL / 2}s"
        renewed = guards["worker-1"].renewals_applied
        time.sleep(TTL)
        assert _denied_code(guards["worker-1"]) is None and guards["worker-1"].renewals_applied > renewed
        for g in guards.values():
            g.renewer.stop()
    assert "worker-0" in auth.trust.revoked_sub and "worker-1" not in auth.trust.revoked_sub
    refusals = [r for r in read_records(audit) if r["action"] == "token_renew" and r["decision"] == "deny"]
    assert refusals and refusals[0]["reason"] == R.REVOKED and refusals[0]["caller"] == "worker-0"


def _run_dir(tmp_path: Path):
    from kuangchao_core.perm.issuance import close_authority, issue_tokens_for_run

    cfg = load_config(
        str(ROOT / "configs" / "tiny.yaml"),
        [f"task.name=kc-rv-{uuid.uuid4().hex[:6]}", f"permission.audit_log={tmp_path / 'audit'}"],
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    env = issue_tokens_for_run(cfg, run_dir, 0)
    close_authority(run_dir)
    return cfg, run_dir, env


def test_kc_token_revoke_needs_a_trusted_operator_key_and_the_jobs_authority(tmp_path):
    cfg, run_dir, env = _run_dir(tmp_path)
    res = RUN.invoke(app, ["token", "revoke", "--run", str(run_dir), "worker-1", "--reason", "test"])
    assert res.exit_code == 0, res.output
    [doc] = json.loads((run_dir / "authority" / "revocations.json").read_text())
    assert doc["body"]["target"] == "worker-1" and doc["body"]["job_id"] == env["KC_JOB_ID"]
    audit = Path(env["KC_AUDIT_LOG"])
    assert [r["target"] for r in read_records(audit) if r["action"] == "token_revoke"] == ["worker-1"]
    # someone else's key: refused, audited, nothing added
    create_operator_key(tmp_path / "eve.key", "eve")
    res = RUN.invoke(
        app, ["token", "revoke", "--run", str(run_dir), "worker-0", "--operator-key", str(tmp_path / "eve.key")]
    )
    assert res.exit_code == 1 and "does not trust" in res.output
    assert len(json.loads((run_dir / "authority" / "revocations.json").read_text())) == 1
    denials = [r for r in read_records(audit) if r["action"] == "operator_verify" and r["decision"] == "deny"]
    assert denials and denials[-1]["actor"] == "operator:eve"
    # the job's authority gone: nothing can be signed for it
    for p in (run_dir / "authority").iterdir():
        p.unlink()
    res = RUN.invoke(app, ["token", "revoke", "--run", str(run_dir), "worker-0"])
    assert res.exit_code == 1 and "authority is missing" in res.output
    res = RUN.invoke(app, ["config", "set", "--run", str(run_dir), "lr_scale=0.5"])
    assert res.exit_code == 1 and "authority is missing" in res.output
    assert not (run_dir / "authority" / "trust_store.json").exists(), "a refused command creates no authority"
