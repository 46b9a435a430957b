"""The token authority: owns the signing keys, issues, renews, revokes and rotates.

It runs in the orchestrating process only, and its private keys never leave that process's memory: they are
generated per authority (per job and flow process) or derived from the ``TokenSigningKey`` Prefect Secret block
(``permission.signing_key_block``), and never written to disk. ``<key_dir>/`` (0700) holds public state only:
``trust_store.json`` — the public half of every key with its status, the trusted operators and the revocations —
signed by the active token key, so a worker that is handed the trust root (``KC_TRUST_ROOT``) detects any edit.
Token signing and audit-checkpoint signing use separate keys (key separation by purpose).

Revocations made while a job runs (``kc token revoke``: operator-signed documents in ``<key_dir>/revocations.json``)
are read before every renewal; renewal is bound to its caller: the token's subject must be the module asking, and
only the newest token of a session renews — presenting an older one (a copy) revokes the session.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kuangchao_core.errors import KuangchaoError
from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.tokens import (
    CAP_TYP,
    DEFAULT_AUDIENCE,
    DEFAULT_ISSUER,
    DEFAULT_LEEWAY_S,
    DEFAULT_MAX_TTL_S,
    PURPOSE_AUDIT,
    PURPOSE_CAPABILITY,
    Claims,
    TrustedKey,
    TrustStore,
    Verifier,
    check_canonical,
    private_raw,
    public_raw,
    sign_token,
    trust_root_of,
)

DEFAULT_SESSION_CAP_S = 30 * 24 * 3600
log = logging.getLogger("kuangchao.perm.authority")


def _kid_of(purpose: str, key: Ed25519PrivateKey) -> str:
    return f"{purpose[:3]}-{hashlib.sha256(public_raw(key)).hexdigest()[:12]}"


def _derived_audit_key(signing_key: Ed25519PrivateKey) -> Ed25519PrivateKey:
    """The audit key that belongs to a configured signing key: stable across processes, never the same key."""
    return Ed25519PrivateKey.from_private_bytes(
        hashlib.sha256(b"kuangchao audit key\x00" + private_raw(signing_key)).digest()
    )


class Authority:
    """Issues and renews capability tokens; workers never see its private keys (they exist in memory only).

    ``signing_key``: the token key to use (from the ``TokenSigningKey`` block); by default a fresh one. The public
    trust store already in ``key_dir`` (an earlier process of the same run) is kept as history: its token keys are
    retired (their tokens belong to finished attempts), its audit keys stay so older audit checkpoints verify.
    """

    def __init__(
        self,
        key_dir: str | os.PathLike,
        *,
        signing_key: Ed25519PrivateKey | None = None,
        issuer: str = DEFAULT_ISSUER,
        audience: str = DEFAULT_AUDIENCE,
        max_ttl_s: float = DEFAULT_MAX_TTL_S,
        leeway_s: float = DEFAULT_LEEWAY_S,
        session_cap_s: float = DEFAULT_SESSION_CAP_S,
        max_renewals: int | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.key_dir = Path(key_dir)
        self.issuer = issuer
        self.audience = audience
        self.max_ttl_s = max_ttl_s
        self.leeway_s = leeway_s
        self.session_cap_s = session_cap_s
        self.max_renewals = max_renewals
        self.clock = clock
        self._lock = threading.Lock()
        self._latest: dict[str, str] = {}  # session id -> the newest token id of that session
        self._session_of: dict[str, str] = {}  # every token id issued here -> its session id (revocation by any)
        self._revocations_stamp: tuple | None = None
        self.key_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.key_dir, 0o700)
        self._private: dict[str, Ed25519PrivateKey] = {}
        self.trust = self._history()
        if signing_key is not None:
            self.active_kid = self._add_key(PURPOSE_CAPABILITY, signing_key)
            self.audit_kid = self._add_key(PURPOSE_AUDIT, _derived_audit_key(signing_key))
        else:
            self.active_kid = self._add_key(PURPOSE_CAPABILITY)
            self.audit_kid = self._add_key(PURPOSE_AUDIT)
        self._save()

    def _history(self) -> TrustStore:
        path = self.trust_store_path
        if not path.exists():
            return TrustStore(issuers=[self.issuer])
        try:
            old = TrustStore.load(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the unreadable trust store %s (%s); starting a new one", path, exc)
            return TrustStore(issuers=[self.issuer])
        for k in old.keys.values():
            if k.purpose == PURPOSE_CAPABILITY and k.status in ("active", "grace"):
                k.status = "retired"
        old.operators = {}  # trusted operators come from this process's config only (trust_operators)
        return old

    # ------------------------------------------------------------------ keys
    @property
    def trust_store_path(self) -> Path:
        """Where the signed public trust store is written."""
        return self.key_dir / "trust_store.json"

    @property
    def revocations_path(self) -> Path:
        """Where ``kc token revoke`` appends operator-signed revocations for this authority to honour."""
        return self.key_dir / "revocations.json"

    @property
    def trust_root(self) -> str:
        """``KID:PUBLIC_KEY`` of the key that signs the trust store and policy (``KC_TRUST_ROOT`` for workers)."""
        return trust_root_of(self.active_kid, self._private[self.active_kid])

    def _add_key(self, purpose: str, key: Ed25519PrivateKey | None = None) -> str:
        key = key or Ed25519PrivateKey.generate()
        kid = _kid_of(purpose, key)
        self._private[kid] = key
        self.trust.keys[kid] = TrustedKey(kid, purpose, public_raw(key))
        return kid

    def _save(self) -> None:
        self.trust.save_signed(self.trust_store_path, self._private[self.active_kid], self.active_kid)

    def trust_operators(self, operators: Iterable) -> None:
        """Trust these operators (:class:`~kuangchao_core.perm.operator.TrustedOperator`) for config changes and
        revocations of this job; persisted to the signed trust store."""
        with self._lock:
            for op in operators:
                self.trust.operators[op.kid] = op.to_json()
            self._save()

    def export_trust_store(self, path: str | os.PathLike) -> Path:
        """Write the signed public trust store to ``path`` (for a run directory or beside an audit log)."""
        return self.trust.save_signed(path, self._private[self.active_kid], self.active_kid)

    actor = "orchestrator"  # how audit records name changes this authority signs

    def sign(self, typ: str, body: dict) -> dict:
        """A document of type ``typ`` signed with the active token key (the policy, the job's initial settings)."""
        from kuangchao_core.perm.signed_doc import sign_document

        with self._lock:
            return sign_document(typ, body, self._private[self.active_kid], self.active_kid)

    def audit_signing_key(self) -> tuple[str, Ed25519PrivateKey]:
        """The (kid, key) for signing audit checkpoints: never the token key."""
        return self.audit_kid, self._private[self.audit_kid]

    def rotate(self, grace_s: float | None = None) -> str:
        """Make a new signing key active; the old one stays accepted for ``grace_s`` (default max TTL + leeway)."""
        with self._lock:
            grace = self.max_ttl_s + self.leeway_s if grace_s is None else grace_s
            old = self.trust.keys[self.active_kid]
            old.status, old.grace_until = "grace", self.clock() + grace
            self.active_kid = self._add_key(PURPOSE_CAPABILITY)
            self._retire_expired()
            self._save()
            return self.active_kid

    def _retire_expired(self) -> None:
        now = self.clock()
        for k in self.trust.keys.values():
            if k.status == "grace" and k.grace_until is not None and now > k.grace_until:
                k.status = "retired"
                self._private.pop(k.kid, None)

    def revoke(self, *, jti: str | None = None, kid: str | None = None, subject: str | None = None) -> None:
        """Revoke a token (by ``jti``; renewals of it too), a key (at once) or a module; persisted to the trust store."""
        with self._lock:
            if jti:
                self.trust.revoked_jti.add(jti)
                self.trust.revoked_jti.add(self._session_of.get(jti, jti))  # and its session: renewals too
            if subject:
                self.trust.revoked_sub.add(subject)
            if kid:
                if kid not in self.trust.keys:
                    raise KuangchaoError(f"cannot revoke key {kid!r}: not in {self.trust_store_path}")
                self.trust.keys[kid].status = "revoked"
                self._private.pop(kid, None)
                if kid == self.active_kid:
                    self.active_kid = self._add_key(PURPOSE_CAPABILITY)
            self._save()

    def refresh_revocations(self, job_id: str) -> int:
        """Apply the operator-signed revocations of ``revocations.json`` for ``job_id`` (only those whose signer the
        trust store names as an operator; others are skipped with a warning). Returns how many are in force."""
        from kuangchao_core.perm.revocation import read_revocations

        try:
            st = self.revocations_path.stat()
        except FileNotFoundError:
            return 0
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._revocations_stamp:
            return len(self.trust.revoked_jti) + len(self.trust.revoked_sub)
        entries = read_revocations(self.revocations_path, self.trust, job_id)
        with self._lock:
            changed = False
            for e in entries:
                target = self.trust.revoked_jti if e["kind"] == "jti" else self.trust.revoked_sub
                # a token id revokes its whole session: any id the audit log shows, also one renewed since
                values = (
                    {e["target"], self._session_of.get(e["target"], e["target"])}
                    if e["kind"] == "jti"
                    else {e["target"]}
                )
                if not values <= target:
                    target.update(values)
                    changed = True
            if changed:
                self._save()
            self._revocations_stamp = stamp
        return len(self.trust.revoked_jti) + len(self.trust.revoked_sub)

    # ------------------------------------------------------------------ issue / renew
    def issue(
        self,
        subject: str,
        role: str,
        job_id: str,
        attempt: int,
        *,
        interfaces: Iterable[str],
        devices: Iterable[str] = (),
        regions: Iterable[str] = (),
        groups: Iterable[str] = (),
        objects: Iterable[str] = (),
        ttl_s: float = 3600,
        once: bool = False,
    ) -> str:
        """Sign a token for module ``subject``; every name is validated canonical and ``ttl_s`` ≤ max TTL."""
        if ttl_s > self.max_ttl_s:
            raise KuangchaoError(
                f"token TTL {ttl_s}s exceeds the maximum {self.max_ttl_s}s; lower permission.token_ttl_seconds"
            )
        now = int(self.clock())
        jti = secrets.token_hex(12)
        claims = {
            "typ": CAP_TYP,
            "jti": jti,
            "iss": self.issuer,
            "aud": self.audience,
            "sub": subject,
            "role": role,
            "job_id": job_id,
            "attempt": int(attempt),
            "devices": sorted(set(devices)),
            "regions": sorted(set(regions)),
            "groups": sorted(set(groups)),
            "interfaces": sorted(set(interfaces)),
            "objects": sorted(set(objects)),
            "iat": now,
            "nbf": now,
            "exp": now + max(1, int(round(ttl_s))),
            "sid": jti,
            "session_iat": now,
            "renewals": 0,
            "once": bool(once),
        }
        if not check_canonical(Claims.model_validate(claims)):
            raise KuangchaoError(
                f"cannot issue a token for {subject}: a resource or interface name is not canonical "
                f"(devices={claims['devices']}, regions={claims['regions']}, groups={claims['groups']}, "
                f"objects={claims['objects']}, interfaces={claims['interfaces']}); see docs/architecture.md"
            )
        with self._lock:
            self._latest[jti] = jti
            self._session_of[jti] = jti
            return sign_token(claims, self._private[self.active_kid], self.active_kid)

    def verifier(self, job_id: str, min_attempt: int = 0) -> Verifier:
        """A verifier bound to ``job_id`` using this authority's current trust store."""
        return Verifier(
            self.trust,
            job_id=job_id,
            min_attempt=min_attempt,
            audience=self.audience,
            issuers=[self.issuer],
            leeway_s=self.leeway_s,
            max_ttl_s=self.max_ttl_s,
            clock=self.clock,
        )

    def renew(
        self,
        token: str,
        job_id: str,
        min_attempt: int = 0,
        narrow: dict | None = None,
        ttl_s: float | None = None,
        *,
        caller: str | None = None,
    ) -> str:
        """Renew ``token``: only before expiry, within the session cap and renewal count, scope never wider.

        ``caller``: the module asking; the token must be its own. Only the newest token of a session renews: an
        older one (a copy kept by someone else) is refused and the whole session revoked. Revocations by operators
        (``revocations.json``) are read first. ``narrow`` optionally asks for a smaller scope
        (``interfaces``/``devices``/``regions``/``groups``/``objects``); ``ttl_s`` may shorten the lifetime (e.g. after
        a start-up grace), never lengthen it. Raises ``TokenRejected`` with the reason code otherwise.
        """
        now = self.clock()
        try:
            self.refresh_revocations(job_id)
        except Exception as exc:  # an unreadable revocation file must not stop renewals of the others
            log.error("revocations of %s not readable: %s", job_id, exc)
        verifier = self.verifier(job_id, min_attempt)
        try:
            old = verifier.verify(token, subject=caller, now=now)
        except R.TokenRejected as exc:
            if exc.code == R.EXPIRED:
                raise R.TokenRejected(R.RENEWAL_LATE, exc.jti) from None
            raise
        with self._lock:
            newest = self._latest.get(old.sid)
            if newest is not None and newest != old.jti:  # a superseded token: somebody kept a copy
                self.trust.revoked_jti.add(old.sid)
                self._save()
                raise R.TokenRejected(R.REPLAY, old.jti)
        if now >= old.exp:  # strictly before expiry: the leeway is for clock skew, not for late renewal
            raise R.TokenRejected(R.RENEWAL_LATE, old.jti)
        ttl = old.exp - old.iat
        if ttl_s is not None:
            ttl = max(1, min(ttl, int(round(ttl_s))))
        if now + ttl > old.session_iat + self.session_cap_s:  # the renewed token would outlive the session cap
            raise R.TokenRejected(R.SESSION_CAP, old.jti)
        limit = self.max_renewals if self.max_renewals is not None else int(self.session_cap_s // max(ttl, 1)) * 2 + 16
        if old.renewals >= limit:
            raise R.TokenRejected(R.RENEWAL_LIMIT, old.jti)
        data = old.model_dump()
        for fld, wanted in (narrow or {}).items():
            if fld not in ("interfaces", "devices", "regions", "groups", "objects"):
                raise R.TokenRejected(R.SCOPE_WIDENING, old.jti)
            if not set(wanted) <= set(data[fld]):
                raise R.TokenRejected(R.SCOPE_WIDENING, old.jti)
            data[fld] = sorted(set(wanted))
        inow = int(now)
        data.update(
            jti=secrets.token_hex(12),
            iat=inow,
            nbf=inow,
            exp=inow + ttl,
            renewals=old.renewals + 1,
        )
        with self._lock:
            self._latest[old.sid] = data["jti"]
            self._session_of[data["jti"]] = old.sid
            return sign_token(data, self._private[self.active_kid], self.active_kid)
