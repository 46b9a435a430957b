"""Capability tokens: the reference's attack list E1–E18, each with its expected reason code."""

from __future__ import annotations

import base64
import json
import logging

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kuangchao_core.errors import PermissionDenied
from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.guard import TokenGuard
from kuangchao_core.perm.roles import Policy
from kuangchao_core.perm.tokens import (
    CAP_TYP,
    PREFIX,
    TrustStore,
    Verifier,
    b64d,
    b64e,
    canonical_json,
    public_raw,
    sign_token,
    split_token,
)

T0 = 1_700_000_000
L = 30
JOB = "job-a"


class Clock:
    def __init__(self, t=T0):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def auth(tmp_path, clock):
    return Authority(tmp_path / "authority", clock=clock, leeway_s=L, max_ttl_s=7200, session_cap_s=4 * 3600)


def verifier(auth, job=JOB, attempt=0, **kw):
    return Verifier(auth.trust, job_id=job, min_attempt=attempt, leeway_s=L, max_ttl_s=7200, clock=auth.clock, **kw)


def issue(auth, **kw):
    sub, role, job = kw.pop("sub", "worker-0"), kw.pop("role", "trainer"), kw.pop("job", JOB)
    args = dict(
        interfaces=["all_reduce", "device_init", "memory_alloc"],
        devices=["cuda:0"],
        regions=["params"],
        groups=["dp-0", "world"],
        ttl_s=600,
    )
    args.update(kw)
    return auth.issue(sub, role, job, 0, **args)


def claims_of(token):
    payload, _, _ = split_token(token)
    return json.loads(payload)


def resign(auth, claims, kid=None):
    """Sign arbitrary claims with the authority's real key (a 'correctly signed' hostile token)."""
    kid = kid or auth.active_kid
    return sign_token(claims, auth._private[kid], kid)


def code_of(fn):
    with pytest.raises(R.TokenRejected) as ei:
        fn()
    assert isinstance(ei.value, PermissionDenied)
    assert "invalid capability token" in str(ei.value)  # generic for the caller
    return ei.value.code


def test_e1_valid_token_allowed_and_audited(auth, tmp_path):
    tok = issue(auth)
    c = verifier(auth).verify(tok, subject="worker-0")
    audit = AuditLog(tmp_path / "a.jsonl", JOB)
    g = TokenGuard(c, Policy(), audit=audit, clock=auth.clock)
    g.check("all_reduce", "group:dp-0")
    recs = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert recs[-1]["decision"] == "allow" and recs[-1]["jti"] == c.jti and recs[-1]["resource"] == "group:dp-0"


def test_e2_flipped_payload_or_widened_claim(auth):
    tok = issue(auth)
    payload, sig, footer = split_token(tok)
    flipped = bytearray(payload)
    flipped[10] ^= 1
    t1 = f"{PREFIX}{b64e(bytes(flipped))}.{b64e(sig)}.{b64e(footer)}"
    widened = claims_of(tok)
    widened["groups"].append("tp-0")
    t2 = f"{PREFIX}{b64e(canonical_json(widened))}.{b64e(sig)}.{b64e(footer)}"
    v = verifier(auth)
    assert code_of(lambda: v.verify(t1)) == R.BAD_SIGNATURE
    assert code_of(lambda: v.verify(t2)) == R.BAD_SIGNATURE


def test_e3_signature_stripped_resized_or_malleated(auth):
    tok = issue(auth)
    payload, sig, footer = split_token(tok)
    v = verifier(auth)
    for bad in (b"", sig[:63], sig + b"\0"):
        assert code_of(lambda b=bad: v.verify(f"{PREFIX}{b64e(payload)}.{b64e(b)}.{b64e(footer)}")) == R.MALFORMED
    assert code_of(lambda: v.verify(f"{PREFIX}{b64e(payload)}.{b64e(footer)}")) == R.MALFORMED
    # S + L malleation: add the group order to the scalar half of the signature
    ell = 2**252 + 27742317777372353535851937790883648493
    s = int.from_bytes(sig[32:], "little") + ell
    mall = sig[:32] + (s % 2**256).to_bytes(32, "little")
    assert code_of(lambda: v.verify(f"{PREFIX}{b64e(payload)}.{b64e(mall)}.{b64e(footer)}")) == R.BAD_SIGNATURE


def test_e4_other_version_purpose_or_alg_none(auth):
    tok = issue(auth)
    v = verifier(auth)
    for prefix in ("kc2.cap.", "kc1.local.", "kc1.none."):
        assert code_of(lambda p=prefix: v.verify(p + tok[len(PREFIX) :])) == R.UNSUPPORTED_VERSION
    jwt_like = b64e(b'{"alg":"none","typ":"JWT"}') + "." + tok.split(".")[2] + "."
    assert code_of(lambda: v.verify(jwt_like)) == R.UNSUPPORTED_VERSION


def test_e5_unknown_revoked_retired_kid(auth, clock):
    tok = issue(auth)
    payload, sig, _ = split_token(tok)
    unknown = f"{PREFIX}{b64e(payload)}.{b64e(sig)}.{b64e(canonical_json({'kid': 'cap-000000000000'}))}"
    assert code_of(lambda: verifier(auth).verify(unknown)) == R.UNKNOWN_KEY
    audit_kid_footer = f"{PREFIX}{b64e(payload)}.{b64e(sig)}.{b64e(canonical_json({'kid': auth.audit_kid}))}"
    assert code_of(lambda: verifier(auth).verify(audit_kid_footer)) == R.UNKNOWN_KEY  # key purpose separation
    old = auth.active_kid
    auth.rotate(grace_s=60)
    clock.t += 61
    assert code_of(lambda: verifier(auth).verify(tok)) == R.RETIRED_KEY
    tok2 = issue(auth)
    auth.revoke(kid=auth.active_kid)
    assert code_of(lambda: verifier(auth).verify(tok2)) == R.REVOKED_KEY
    assert old != auth.active_kid


def test_e6_key_smuggled_in_footer(auth):
    attacker = Ed25519PrivateKey.generate()
    claims = claims_of(issue(auth))
    claims["groups"] = ["world", "dp-0", "dp-1"]
    payload = canonical_json(claims)
    for footer in (
        {"kid": auth.active_kid, "jwk": b64e(public_raw(attacker))},
        {"kid": "evil", "public_key": b64e(public_raw(attacker))},
    ):
        tok = sign_token(claims, attacker, "x")
        _, sig, _ = split_token(tok)
        forged = f"{PREFIX}{b64e(payload)}.{b64e(sig)}.{b64e(canonical_json(footer))}"
        assert code_of(lambda f=forged: verifier(auth).verify(f)) == R.MALFORMED
    # a well-formed footer naming the real kid, signed by the attacker
    assert code_of(lambda: verifier(auth).verify(sign_token(claims, attacker, auth.active_kid))) == R.BAD_SIGNATURE
    # the attacker's own kid is not in the local trust store
    assert code_of(lambda: verifier(auth).verify(sign_token(claims, attacker, "cap-attacker"))) == R.UNKNOWN_KEY


def test_e7_expiry_boundary(auth, clock):
    c = claims_of(issue(auth))
    c.update(iat=clock.t - 100, nbf=clock.t - 100, exp=clock.t - L - 1)
    assert code_of(lambda: verifier(auth).verify(resign(auth, c))) == R.EXPIRED
    c.update(exp=clock.t - L + 1)
    assert verifier(auth).verify(resign(auth, c)).exp == clock.t - L + 1


def test_e8_not_yet_valid(auth, clock):
    c = claims_of(issue(auth))
    c.update(nbf=clock.t + L + 1, exp=clock.t + 600)
    assert code_of(lambda: verifier(auth).verify(resign(auth, c))) == R.NOT_YET_VALID
    c.update(nbf=clock.t, iat=clock.t + L + 1, exp=clock.t + L + 300)
    assert code_of(lambda: verifier(auth).verify(resign(auth, c))) == R.NOT_YET_VALID
    c.update(iat=clock.t + L, nbf=clock.t + L)  # exactly at the leeway: accepted
    assert verifier(auth).verify(resign(auth, c)).iat == clock.t + L


def test_e9_ttl_too_long_even_if_signed(auth, clock):
    c = claims_of(issue(auth))
    c.update(exp=c["iat"] + 7201)
    assert code_of(lambda: verifier(auth).verify(resign(auth, c))) == R.TTL_TOO_LONG
    with pytest.raises(Exception, match="exceeds the maximum"):
        issue(auth, ttl_s=7201)


def test_e10_audience(auth):
    c = claims_of(issue(auth))
    for aud in ("kuangchao-monitor", ["kuangchao-guard", "kuangchao-monitor"]):
        c["aud"] = aud
        assert code_of(lambda: verifier(auth).verify(resign(auth, c))) == R.AUDIENCE


def test_e11_other_job_and_stale_attempt(auth):
    tok_b = issue(auth, job="job-b")
    assert code_of(lambda: verifier(auth, job=JOB).verify(tok_b)) == R.WRONG_JOB
    tok_a0 = issue(auth)
    assert verifier(auth, attempt=0).verify(tok_a0)
    assert code_of(lambda: verifier(auth, attempt=1).verify(tok_a0)) == R.STALE_ATTEMPT


def _guard(auth, tok, policy=None, **kw):
    return TokenGuard(verifier(auth).verify(tok), policy or Policy(), clock=auth.clock, **kw)


def _denied(g, interface, resource):
    with pytest.raises(R.GuardDenied) as ei:
        g.check(interface, resource)
    return ei.value.code


def test_e12_out_of_scope_including_non_canonical(auth):
    g = _guard(auth, issue(auth))
    g.check("device_init", "device:cuda:0")
    g.check("memory_alloc", "memory:params")
    g.check("all_reduce", "group:dp-0")
    cases = [
        ("device_init", "device:cuda:1"),
        ("memory_alloc", "memory:optim"),
        ("all_reduce", "group:dp-1"),
        ("all_reduce", "group:job-b/world"),
        ("send", "group:dp-0"),  # interface not whitelisted
        ("device_init", "device:CUDA:0"),
        ("device_init", "device:0"),
        ("device_init", "device: cuda:0"),
        ("device_init", "device:cuda:0 "),
        ("all_reduce", "group:dp-1/../dp-0"),
        ("all_reduce", "group:DP-0"),
        ("all_reduce", "group:*"),
    ]
    for itf, res in cases:
        assert _denied(g, itf, res) == R.OUT_OF_SCOPE, (itf, res)
    # non-canonical names cannot even be put into a token
    with pytest.raises(Exception, match="not canonical"):
        issue(auth, groups=["dp-1/../dp-0"])
    with pytest.raises(Exception, match="not canonical"):
        issue(auth, devices=["CUDA:0"])


def test_e13_token_and_role_intersect(auth):
    tok = issue(auth, role="data_loader", interfaces=["dataset_read", "all_reduce"], objects=["dataset:wiki"])
    g = _guard(auth, tok)
    g.check("dataset_read", "dataset:wiki")
    assert _denied(g, "all_reduce", "group:world") == R.ROLE_DENIED  # token allows, role does not
    policy = Policy({"trainer": {"interfaces": ["all_reduce", "send"], "resources": ["group:*"]}})
    g2 = _guard(auth, issue(auth, interfaces=["all_reduce"]), policy)
    g2.check("all_reduce", "group:world")
    assert _denied(g2, "send", "group:world") == R.OUT_OF_SCOPE  # role allows, token does not


def test_e14_one_shot_replay(auth):
    tok = issue(auth, once=True)
    v = verifier(auth)
    assert v.verify(tok, one_shot=True).once
    assert code_of(lambda: v.verify(tok, one_shot=True)) == R.REPLAY
    session = issue(auth)
    v.verify(session, one_shot=True)
    v.verify(session, one_shot=True)  # session tokens may be reused


def test_e15_renewal_rules(auth, clock):
    tok = issue(auth, ttl_s=600)
    old = verifier(auth).verify(tok)
    clock.t += 300
    new = auth.renew(tok, JOB)
    nc = verifier(auth).verify(new)
    assert nc.jti != old.jti and nc.sub == old.sub and nc.aud == old.aud and nc.job_id == old.job_id
    assert nc.renewals == 1 and nc.exp == clock.t + 600 and nc.resources() <= old.resources()
    narrowed_tok = auth.renew(new, JOB, narrow={"groups": ["world"]})
    narrowed = verifier(auth).verify(narrowed_tok)
    assert narrowed.groups == ["world"]
    assert code_of(lambda: auth.renew(narrowed_tok, JOB, narrow={"groups": ["world", "dp-0"]})) == R.SCOPE_WIDENING
    assert code_of(lambda: auth.renew(narrowed_tok, JOB, narrow={"role": "admin"})) == R.SCOPE_WIDENING
    clock.t = narrowed.exp + 1  # late, even though within the clock leeway
    assert code_of(lambda: auth.renew(narrowed_tok, JOB)) == R.RENEWAL_LATE
    # session cap: keep renewing every 500 s; the cap (4 h) stops it
    clock.t = T0 + 10_000
    tok = issue(auth, ttl_s=600)
    with pytest.raises(R.TokenRejected) as ei:
        for _ in range(100):
            clock.t += 500
            tok = auth.renew(tok, JOB)
    assert ei.value.code == R.SESSION_CAP
    auth.max_renewals = 2
    tok = issue(auth, ttl_s=600)
    tok = auth.renew(auth.renew(tok, JOB), JOB)
    assert code_of(lambda: auth.renew(tok, JOB)) == R.RENEWAL_LIMIT


def test_renewal_is_bound_to_the_caller_and_to_the_newest_token_of_its_session(auth, clock):
    tok = issue(auth, ttl_s=600)
    clock.t += 10
    # another module presenting worker-0's token (one it read somewhere) is refused
    assert code_of(lambda: auth.renew(tok, JOB, caller="worker-1")) == R.WRONG_SUBJECT
    new = auth.renew(tok, JOB, caller="worker-0")  # control: the holder renews
    # the superseded token is a copy: refused, and the whole session ends (the holder's newest token too)
    assert code_of(lambda: auth.renew(tok, JOB, caller="worker-0")) == R.REPLAY
    assert code_of(lambda: auth.renew(new, JOB, caller="worker-0")) == R.REVOKED
    assert code_of(lambda: verifier(auth).verify(new)) == R.REVOKED
    other = issue(auth, ttl_s=600)  # another session is untouched
    assert verifier(auth).verify(auth.renew(other, JOB, caller="worker-0"))


def test_e16_key_rotation_grace(auth, clock):
    old_tok = issue(auth)
    auth.rotate(grace_s=120)
    new_tok = issue(auth)
    assert claims_of(new_tok) and verifier(auth).verify(old_tok) and verifier(auth).verify(new_tok)
    clock.t += 121
    assert code_of(lambda: verifier(auth).verify(old_tok)) == R.RETIRED_KEY
    assert verifier(auth).verify(new_tok)
    # the rotation persisted in the public trust store; a later authority of the run keeps it as history and
    # brings its own key: every earlier token key is retired (their tokens belong to finished attempts)
    again = Authority(auth.key_dir, clock=clock, leeway_s=L, max_ttl_s=7200)
    assert again.active_kid not in (auth.active_kid,) and auth.active_kid in again.trust.keys
    assert code_of(lambda: verifier(again).verify(new_tok)) == R.RETIRED_KEY
    assert again.trust.keys[auth.audit_kid].status == "active"  # older audit checkpoints still verify


def test_e17_malformed_payloads(auth):
    tok = issue(auth)
    c = claims_of(tok)
    payload = canonical_json(c)
    dup = payload[:-1] + b',"groups":["dp-1"]}'
    key, kid = auth._private[auth.active_kid], auth.active_kid

    def signed_raw(raw):
        from kuangchao_core.perm.tokens import _IMPLICIT, pae

        footer = canonical_json({"kid": kid})
        sig = key.sign(pae(PREFIX.encode(), raw, footer, _IMPLICIT))
        return f"{PREFIX}{b64e(raw)}.{b64e(sig)}.{b64e(footer)}"

    v = verifier(auth)
    assert code_of(lambda: v.verify(signed_raw(dup))) == R.MALFORMED
    assert code_of(lambda: v.verify(resign(auth, {**c, "admin": True}))) == R.MALFORMED
    deep = {**c, "groups": json.loads("[" * 100 + "]" * 100)}
    assert code_of(lambda: v.verify(signed_raw(canonical_json(deep)))) == R.MALFORMED
    assert code_of(lambda: v.verify(resign(auth, {**c, "attempt": "0"}))) == R.MALFORMED
    assert code_of(lambda: v.verify(resign(auth, {**c, "groups": ["dp-1/../dp-0"]}))) == R.MALFORMED
    assert code_of(lambda: v.verify(resign(auth, {**c, "typ": "kuangchao/audit-checkpoint"}))) == R.WRONG_TYPE
    assert code_of(lambda: v.verify("kc1.cap." + "A" * 1_000_000)) == R.MALFORMED
    assert code_of(lambda: v.verify(tok + "=")) == R.MALFORMED
    assert code_of(lambda: v.verify(tok + ".extra")) == R.MALFORMED
    assert code_of(lambda: v.verify(None)) == R.MALFORMED
    with pytest.raises(ValueError):
        b64d(base64.urlsafe_b64encode(b"xy").decode())  # padded


def test_e18_raw_token_never_logged(auth, tmp_path, caplog, clock):
    from kuangchao_core.perm import guard_api
    from kuangchao_core.perm.runtime import install_worker_guard

    caplog.set_level(logging.DEBUG)
    ts = auth.trust_store_path
    log_path = tmp_path / "audit.jsonl"
    prev = guard_api.current_guard()
    try:
        clock.t = __import__("time").time()
        good = issue(auth)
        bad = issue(auth, job="job-b")
        (tmp_path / "good.tok").write_text(good)
        (tmp_path / "bad.tok").write_text(bad)
        g = install_worker_guard(tmp_path / "good.tok", ts, JOB, 0, log_path, module_id="worker-0", renew=False)
        g.check("all_reduce", "group:world")
        with pytest.raises(PermissionDenied):
            g.check("all_reduce", "group:other")
        with pytest.raises(R.TokenRejected) as ei:
            install_worker_guard(tmp_path / "bad.tok", ts, JOB, 0, log_path, module_id="worker-0", renew=False)
        assert ei.value.code == R.WRONG_JOB and bad not in str(ei.value)
        with pytest.raises(PermissionDenied):
            guard_api.check("all_reduce", "group:world")  # a rejected token leaves a deny-all guard
    finally:
        guard_api.install_guard(prev)
    audit_text = log_path.read_text()
    everything = audit_text + caplog.text
    for tok in (good, bad):
        assert tok not in everything
        assert tok.split(".")[2] not in everything  # not even the payload segment
    from kuangchao_core.perm.tokens import token_digest

    assert token_digest(bad) in audit_text and "wrong_job" in audit_text
    assert TrustStore.load(ts).keys  # trust store holds public keys only
    assert "private" not in ts.read_text()
    assert sorted(p.name for p in auth.key_dir.iterdir()) == ["trust_store.json"]  # no key material on disk


def test_issue_refuses_unknown_interface(auth):
    with pytest.raises(Exception, match="not canonical"):
        issue(auth, interfaces=["all_reduce", "rm_rf"])
    assert CAP_TYP == claims_of(issue(auth))["typ"]
