"""RBAC and default deny (reference §7 F1–F6), the guard's audit behaviour, trusted mode and `issue_tokens`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kuangchao_core.config import KNOWN_INTERFACES, config_from_dict
from kuangchao_core.errors import ConfigError, PermissionDenied
from kuangchao_core.perm import guard_api
from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.audit_verify import read_records, verify_log
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.guard import TokenGuard
from kuangchao_core.perm.names import INTERFACES
from kuangchao_core.perm.roles import Policy, PolicyHolder
from kuangchao_core.perm.runtime import install_worker_guard
from kuangchao_core.perm.signed_doc import read_document
from kuangchao_core.perm.tokens import TrustStore, Verifier, b64e

JOB = "job-g"


@pytest.fixture
def auth(tmp_path):
    return Authority(tmp_path / "authority")


@pytest.fixture(autouse=True)
def restore_guard():
    prev = guard_api.current_guard()
    yield
    guard_api.install_guard(prev)


def claims(auth, role="trainer", **kw):
    args = dict(
        interfaces=["all_reduce", "send", "checkpoint_write"],
        groups=["world", "dp[0,1]"],
        objects=["checkpoint:t"],
        ttl_s=600,
    )
    args.update(kw)
    return auth.verifier(JOB).verify(auth.issue("worker-0", role, JOB, 0, **args))


def code(g, itf, res):
    with pytest.raises(R.GuardDenied) as ei:
        g.check(itf, res)
    assert isinstance(ei.value, PermissionDenied)
    return ei.value.code


def test_interface_names_match_the_config_schema():
    assert INTERFACES == KNOWN_INTERFACES


def test_f1_no_token_denies_everything(tmp_path):
    with pytest.raises(PermissionDenied):
        guard_api.DenyAll().check("all_reduce", "group:world")
    log = tmp_path / "a.jsonl"
    with pytest.raises(R.TokenRejected) as ei:
        install_worker_guard(None, None, JOB, 0, log, module_id="worker-5")
    assert ei.value.code == R.NO_TOKEN
    with pytest.raises(R.GuardDenied) as ei:
        guard_api.check("device_init", "device:cpu")
    assert ei.value.code == R.NO_TOKEN
    rec = list(read_records(log))[-1]
    assert (rec["actor"], rec["decision"], rec["reason"]) == ("worker-5", "deny", "no_token")


def test_f2_role_absent_from_policy(auth):
    g = TokenGuard(claims(auth, role="ghost"), Policy())
    assert code(g, "all_reduce", "group:world") == R.UNKNOWN_ROLE


def test_f3_unknown_permission_name_fails_at_load(tmp_path):
    with pytest.raises(ConfigError) as ei:
        Policy({"trainer": {"interfaces": ["all_reduce", "format_disk"]}})
    assert "permission.roles.trainer.interfaces[1]" in str(ei.value)
    with pytest.raises(ConfigError):
        Policy({"trainer": {"interfaces": ["all_reduce"], "resources": ["gpu:0"]}})
    with pytest.raises(ConfigError):
        Policy(None, allowed_interfaces=["all_reduce", "sudo"])
    with pytest.raises(ConfigError):  # the config schema refuses it too, at load
        config_from_dict({"task": {"name": "t"}, "permission": {"roles": {"trainer": ["all_reduce", "sudo"]}}})


def test_f4_explicit_deny_beats_allow(auth):
    policy = Policy(
        {
            "trainer": {
                "interfaces": ["all_reduce", "send"],
                "resources": ["group:*"],
                "deny": ["send", "all_reduce@group:world"],
            }
        }
    )
    g = TokenGuard(claims(auth), policy)
    g.check("all_reduce", "group:dp[0,1]")
    assert code(g, "all_reduce", "group:world") == R.EXPLICIT_DENY
    assert code(g, "send", "group:dp[0,1]") == R.EXPLICIT_DENY


def test_f5_empty_policy_denies_everything(auth):
    g = TokenGuard(claims(auth), Policy({}))
    for itf, res in (("all_reduce", "group:world"), ("checkpoint_write", "checkpoint:t")):
        assert code(g, itf, res) == R.UNKNOWN_ROLE


def test_f6_policy_reload_is_atomic(tmp_path, auth):
    good = Policy({"trainer": {"interfaces": ["all_reduce"], "resources": ["group:*"]}})
    path = good.save(tmp_path / "policy.json")
    holder = PolicyHolder(Policy.load(path))
    path.write_text('{"roles": {"trainer": {"interfaces": ["all_re')  # half-written
    with pytest.raises(ConfigError):
        holder.reload(path)
    assert holder.policy.role("trainer").interfaces == {"all_reduce"}
    Policy({"trainer": ["send"]}).save(path)
    assert holder.reload(path).role("trainer").interfaces == {"send"}
    assert not list(tmp_path.glob(".*tmp"))  # temp files renamed away


def test_allowed_interfaces_narrow_every_token(auth):
    g = TokenGuard(claims(auth), Policy(None, allowed_interfaces=["all_reduce"]))
    g.check("all_reduce", "group:world")
    assert code(g, "send", "group:world") == R.ROLE_DENIED


def test_allowed_interfaces_restrict_communication_only_as_the_original_means_it(auth):
    """The original's list [all_reduce, all_gather, broadcast] used to deny device_init and checkpoint writes to
    every worker; it names communication primitives, the rest stays with the roles."""
    tok = claims(auth, interfaces=["all_reduce", "send", "checkpoint_write", "device_init"], devices=["cpu"])
    g = TokenGuard(tok, Policy(None, allowed_interfaces=["all_reduce", "all_gather", "broadcast"]))
    g.check("device_init", "device:cpu")
    g.check("checkpoint_write", "checkpoint:t")
    assert code(g, "send", "group:world") == R.ROLE_DENIED  # a primitive outside the list is still denied


def test_role_globs_and_config_roles(auth):
    cfg = config_from_dict(
        {
            "task": {"name": "t"},
            "permission": {"roles": {"trainer": {"interfaces": ["all_reduce", "send"], "resources": ["group:dp*"]}}},
        }
    )
    policy = Policy.from_config(cfg.permission)
    g = TokenGuard(claims(auth), policy)
    g.check("all_reduce", "group:dp[0,1]")
    assert code(g, "all_reduce", "group:world") == R.ROLE_DENIED  # in the token, outside the role's glob
    assert policy.role("monitor") is not None  # built-in roles kept


def test_allow_audit_first_use_then_counts(auth, tmp_path, caplog):
    log = AuditLog(tmp_path / "a.jsonl", JOB)
    g = TokenGuard(claims(auth), Policy(), audit=log, count_interval_s=3600)
    caplog.set_level(logging.DEBUG, logger="kuangchao.perm.guard")
    g._debug = True
    for _ in range(50):
        g.check("all_reduce", "group:world")
    g.check("send", "group:dp[0,1]")
    with pytest.raises(PermissionDenied):
        g.check("recv", "group:world")
    g.close()
    recs = list(read_records(tmp_path / "a.jsonl"))
    firsts = [(r["action"], r["resource"]) for r in recs if r["reason"] == "first_use"]
    assert firsts == [("all_reduce", "group:world"), ("send", "group:dp[0,1]")]
    counts = [r for r in recs if r["reason"] == "count"]
    assert [(r["action"], r["count"]) for r in counts] == [("all_reduce", 49)]
    assert [r["reason"] for r in recs if r["decision"] == "deny"] == ["out_of_scope"]
    assert caplog.text.count("allow worker-0 all_reduce group:world") == 50
    assert verify_log(tmp_path / "a.jsonl", log_id=JOB).ok


def test_guard_expires_without_renewal(auth):
    now = [1_700_000_000.0]
    auth.clock = lambda: now[0]
    c = auth.verifier(JOB).verify(
        auth.issue("worker-0", "trainer", JOB, 0, interfaces=["all_reduce"], groups=["world"], ttl_s=1), now=now[0]
    )
    fresh = TokenGuard(c, Policy(), leeway_s=0.0, clock=lambda: now[0] + 0.5)
    fresh.check("all_reduce", "group:world")
    g = TokenGuard(c, Policy(), leeway_s=0.0, clock=lambda: now[0] + 1.05)  # 1.05 s after issue
    assert code(g, "all_reduce", "group:world") == R.EXPIRED


def test_trusted_mode_allows_and_logs_loudly(tmp_path, caplog):
    log = tmp_path / "a.jsonl"
    g = install_worker_guard(None, None, JOB, 0, log, mode="trusted", module_id="worker-0")
    assert isinstance(g, guard_api.AllowAll) and guard_api.current_guard() is g
    guard_api.check("config_write", "config:anything")
    assert "TRUSTED" in caplog.text
    assert list(read_records(log))[0]["action"] == "mode_trusted"


def _cfg(**perm):
    return config_from_dict(
        {
            "task": {"name": "tok"},
            "model": {"preset": "tiny"},
            "parallel": {"data_parallel_size": 2, "tensor_parallel_size": 2},
            "train": {"device": "cpu"},
            "permission": {"token_ttl_seconds": 600, **perm},
        }
    )


def test_issue_tokens_keeps_tokens_in_memory_and_writes_only_signed_public_files(tmp_path, monkeypatch):
    from kuangchao_core.perm.issuance import authority_for, issue_tokens_for_run, issued_tokens, token_env
    from kuangchao_core.perm.tokens import private_raw
    from tasks.issue_tokens import issue_tokens

    monkeypatch.chdir(tmp_path)
    cfg = _cfg()
    env = issue_tokens_for_run(cfg, tmp_path / "run", attempt=1)
    assert issue_tokens.name == "issue_tokens" and callable(issue_tokens.fn)
    tokens = issued_tokens(tmp_path / "run", 1)
    assert sorted(tokens) == sorted(
        [f"worker-{r}" for r in range(4)] + [f"data_loader-{r}" for r in range(4)] + ["monitor"]
    )
    # nothing secret on disk or in the environment handed out: no token, no private key
    auth = authority_for(cfg, tmp_path / "run")
    secrets_ = [b64e(private_raw(k)) for k in auth._private.values()] + list(tokens.values())
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert sorted(p.name for p in (tmp_path / "run" / "authority").iterdir()) == ["policy.json", "trust_store.json"]
    for text in [p.read_text(errors="replace") for p in files] + list(env.values()):
        assert not any(sec in text for sec in secrets_)
    job = env["KC_JOB_ID"]
    trust = TrustStore.load_verified(env["KC_TRUST_STORE"], env["KC_TRUST_ROOT"])
    v = Verifier(trust, job_id=job, min_attempt=1)
    w3 = v.verify(tokens["worker-3"], subject="worker-3")
    # dp=2, tp=2: rank 3 = (dp 1, tp 1) -> tp[2,3], dp[1,3]
    assert set(w3.groups) == {"world", "host", "tp[2,3]", "dp[1,3]", "pp[3]"} and w3.devices == ["cpu"]
    assert "checkpoint:tok" in w3.objects and "dataset:synthetic" not in w3.objects  # datasets: the data loader's
    assert "dataset:synthetic" in v.verify(tokens["data_loader-3"], subject="data_loader-3").objects
    mon = v.verify(tokens["monitor"], subject="monitor")
    assert mon.role == "monitor" and mon.interfaces == ["metrics_read"]
    # what a node's processes get: only the tokens of their ranks
    assert sorted(json.loads(token_env(tmp_path / "run", 1, [3])["KC_TOKENS"])) == ["data_loader-3", "worker-3"]
    # the worker side: its token from the environment, the signed trust store and policy, the job binding
    monkeypatch.setenv("RANK", "3")
    kw = dict(token=tokens["worker-3"], trust_root=env["KC_TRUST_ROOT"], policy_file=env["KC_POLICY_FILE"])
    g = install_worker_guard(None, env["KC_TRUST_STORE"], job, 1, env["KC_AUDIT_LOG"], renew=False, **kw)
    g.check("all_reduce", "group:dp[1,3]")
    assert code(g, "all_reduce", "group:dp[0,2]") == R.OUT_OF_SCOPE
    assert code(g, "metrics_read", "metrics:tok") == R.OUT_OF_SCOPE
    with pytest.raises(R.TokenRejected) as ei:  # attempt 1's tokens after a restart to attempt 2
        install_worker_guard(None, env["KC_TRUST_STORE"], job, 2, renew=False, **kw)
    assert ei.value.code == R.STALE_ATTEMPT
    assert read_document(env["KC_POLICY_FILE"])["body"]["allowed_interfaces"] is None
    assert env["KC_AUDIT_LOG"].endswith(f"audit/tok/{job}.jsonl")


def test_a_worker_cannot_forge_rights_from_the_files_it_can_read(tmp_path, monkeypatch):
    """The attack of issue 16: with the run directory readable, mint an admin token or widen the own role.
    The key is not there; a key of one's own added to the trust store, or rights added to the policy, break the
    authority's signature, which the worker checks against the trust root in its environment."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from kuangchao_core.perm.issuance import issue_tokens_for_run, issued_tokens
    from kuangchao_core.perm.signed_doc import write_document
    from kuangchao_core.perm.tokens import TrustedKey, public_raw, sign_token

    monkeypatch.chdir(tmp_path)
    env = issue_tokens_for_run(_cfg(), tmp_path / "run", attempt=0)
    job, mine = env["KC_JOB_ID"], issued_tokens(tmp_path / "run", 0)["worker-0"]
    monkeypatch.setenv("RANK", "0")
    kw = dict(trust_root=env["KC_TRUST_ROOT"], policy_file=env["KC_POLICY_FILE"], renew=False)
    # control: the untouched files verify and the guard installs
    install_worker_guard(None, env["KC_TRUST_STORE"], job, 0, token=mine, **kw)
    # 1. my own key in the trust store, an admin token signed with it
    evil = Ed25519PrivateKey.generate()
    doc = read_document(env["KC_TRUST_STORE"])
    body = dict(doc["body"])
    body["keys"] = [*body["keys"], TrustedKey("cap-evil", "capability", public_raw(evil)).to_json()]
    original = Path(env["KC_TRUST_STORE"]).read_text()
    write_document(env["KC_TRUST_STORE"], {**doc, "body": body})
    claims = Verifier(TrustStore.load(env["KC_TRUST_STORE"]), job_id=job).verify(mine).model_dump()
    forged = sign_token(
        {**claims, "sub": "worker-0", "role": "admin", "interfaces": ["config_write"]}, evil, "cap-evil"
    )
    with pytest.raises(R.TokenRejected) as ei:
        install_worker_guard(None, env["KC_TRUST_STORE"], job, 0, token=forged, **kw)
    assert ei.value.code == R.BAD_SIGNATURE
    assert code(guard_api.current_guard(), "all_reduce", "group:world") == R.BAD_SIGNATURE  # deny-all installed
    Path(env["KC_TRUST_STORE"]).write_text(original)
    # 2. more rights for my role in the policy
    pdoc = read_document(env["KC_POLICY_FILE"])
    roles = {"trainer": {"interfaces": ["config_write", "all_reduce"], "resources": ["config:*", "group:*"]}}
    write_document(env["KC_POLICY_FILE"], {**pdoc, "body": {**pdoc["body"], "roles": roles}})
    with pytest.raises(R.TokenRejected) as ei:
        install_worker_guard(None, env["KC_TRUST_STORE"], job, 0, token=mine, **kw)
    assert ei.value.code == R.BAD_SIGNATURE
    # 3. the whole store replaced by one I signed myself: the trust root names another key
    from kuangchao_core.perm.signed_doc import sign_document
    from kuangchao_core.perm.tokens import TRUST_STORE_TYP

    write_document(env["KC_TRUST_STORE"], sign_document(TRUST_STORE_TYP, body, evil, "cap-evil"))
    with pytest.raises(R.TokenRejected):
        install_worker_guard(None, env["KC_TRUST_STORE"], job, 0, token=forged, **kw)


def test_the_signing_key_block_s_key_signs_and_stays_in_memory(tmp_path, monkeypatch):
    """``permission.signing_key_block``: the block's key (here its PEM, as the flow receives it) is the token key;
    a later authority of the run from the same block has the same token and audit keys (audit checkpoints keep
    verifying), and neither process writes it anywhere. Without a block every authority has a fresh key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    from kuangchao_core.perm.issuance import close_authority, open_authority
    from kuangchao_core.perm.tokens import public_raw

    monkeypatch.chdir(tmp_path)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode()
    run = tmp_path / "run"
    first = open_authority(_cfg(), run, pem)
    assert first.trust.keys[first.active_kid].public == public_raw(key)
    kids = (first.active_kid, first.audit_kid)
    close_authority(run)
    again = open_authority(_cfg(), run, pem)
    assert (again.active_kid, again.audit_kid) == kids and again.trust.keys[again.audit_kid].status == "active"
    close_authority(run)
    fresh = open_authority(_cfg(), run)  # control: no block, a new key
    assert fresh.active_kid != kids[0] and fresh.trust.keys[kids[0]].status == "retired"
    close_authority(run)
    assert not any(pem.splitlines()[1] in p.read_text(errors="replace") for p in run.rglob("*") if p.is_file())


def test_dataset_reads_run_as_the_data_loader_also_in_the_prefetch_thread(auth, tmp_path):
    """Roles made real: a trainer token carries no dataset, so reading one needs the rank's data loader guard —
    at start, for evaluation and in the prefetch thread; without it (the control) the read is denied."""
    import torch

    from kuangchao_core.data import PrefetchLoader, ResumableBatchSampler, build_dataset

    log = AuditLog(tmp_path / "audit.jsonl", JOB)
    trainer = auth.verifier(JOB).verify(
        auth.issue("worker-0", "trainer", JOB, 0, interfaces=["dataset_read"], ttl_s=600), subject="worker-0"
    )
    loader = auth.verifier(JOB).verify(
        auth.issue("data_loader-0", "data_loader", JOB, 0, interfaces=["dataset_read"], objects=["dataset:synthetic"]),
        subject="data_loader-0",
    )
    data = {"seq_len": 16, "synthetic": {"num_train": 64, "num_eval": 8}}
    guard_api.install_guard(TokenGuard(trainer, Policy(), audit=log))
    try:
        with pytest.raises(PermissionDenied) as ei:
            build_dataset(data, 256)
        assert ei.value.code == R.OUT_OF_SCOPE
        guard_api.install_module_guard("data_loader", TokenGuard(loader, Policy(), audit=log))
        dataset = build_dataset(data, 256)

        seen: list[str] = []

        class Recording:
            def __len__(self):
                return len(dataset)

            def __getitem__(self, i):
                seen.append(guard_api.current_guard().module_id)
                return {"input_ids": torch.zeros(4, dtype=torch.long)}

        sampler = ResumableBatchSampler(len(dataset), 2, 1, 0, 1, seed=1)
        prefetch = PrefetchLoader(Recording(), sampler, depth=1)
        prefetch.next_step()
        prefetch.close()
        assert seen and set(seen) == {"data_loader-0"}
    finally:
        guard_api.install_module_guard("data_loader", None)
    reads = [r for r in read_records(log.path) if r["action"] == "dataset_read"]
    assert [(r["actor"], r["decision"]) for r in reads] == [("worker-0", "deny"), ("data_loader-0", "allow")]


def test_a_token_for_every_group_allows_any_canonical_group_within_its_role(auth):
    """``kc launch`` tokens carry ``groups: ["*"]`` (a script's groups are named when it creates them): any
    canonical group passes, a non-canonical name does not, and the role still decides the interfaces."""
    any_group = dict(interfaces=["all_reduce", "send"], groups=["*"], ttl_s=600)
    g = TokenGuard(auth.verifier(JOB).verify(auth.issue("worker-0", "trainer", JOB, 0, **any_group)), Policy())
    for group in ("group:world", "group:g3[0,1]", "group:tp[2,3]"):
        g.check("all_reduce", group)
    assert code(g, "all_reduce", "group:g1[0,1]/../x") == R.OUT_OF_SCOPE
    assert code(g, "broadcast", "group:world") == R.OUT_OF_SCOPE  # not in the token
    loader = auth.verifier(JOB).verify(auth.issue("data_loader-0", "data_loader", JOB, 0, **any_group))
    assert code(TokenGuard(loader, Policy()), "all_reduce", "group:world") == R.ROLE_DENIED  # the role refuses
    with pytest.raises(Exception, match="not canonical"):  # the wildcard is the whole claim or nothing
        auth.issue("worker-0", "trainer", JOB, 0, interfaces=["all_reduce"], groups=["*", "world"])
