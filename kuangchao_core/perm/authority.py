"""The token authority: owns the signing keys, issues, renews, revokes and rotates.

It runs in the orchestrating process only. Private keys live in ``<key_dir>/keys.json`` (directory 0700, file
0600); the public half of every key, with its status, goes to ``<key_dir>/trust_store.json`` which workers
receive. Token signing and audit-checkpoint signing use separate keys (key separation by purpose).
"""

from __future__ import annotations

import json
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
    b64d,
    b64e,
    check_canonical,
    new_kid,
    private_raw,
    public_raw,
    sign_token,
)

DEFAULT_SESSION_CAP_S = 30 * 24 * 3600


def _write_private(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Authority:
    """Issues and renews capability tokens; workers never see its private keys."""

    def __init__(
        self,
        key_dir: str | os.PathLike,
        *,
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
        self.key_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.key_dir, 0o700)
        self._keys_path = self.key_dir / "keys.json"
        if self._keys_path.exists():
            st = self._keys_path.stat()
            if st.st_mode & 0o077:
                raise KuangchaoError(
                    f"authority key file {self._keys_path} is readable by others (mode {oct(st.st_mode & 0o777)}); "
                    "run `chmod 600` on it or delete the directory to generate fresh keys"
                )
            data = json.loads(self._keys_path.read_text())
            self._private = {kid: Ed25519PrivateKey.from_private_bytes(b64d(v)) for kid, v in data["private"].items()}
            self.active_kid = data["active_kid"]
            self.audit_kid = data["audit_kid"]
            self.trust = TrustStore.load(self.trust_store_path)
        else:
            self._private = {}
            self.trust = TrustStore(issuers=[issuer])
            self.active_kid = self._add_key(PURPOSE_CAPABILITY)
            self.audit_kid = self._add_key(PURPOSE_AUDIT)
            self._save()

    # ------------------------------------------------------------------ keys
    @property
    def trust_store_path(self) -> Path:
        """Where the public trust store is written (hand this file to workers)."""
        return self.key_dir / "trust_store.json"

    def _add_key(self, purpose: str) -> str:
        key = Ed25519PrivateKey.generate()
        kid = new_kid(purpose)
        self._private[kid] = key
        self.trust.keys[kid] = TrustedKey(kid, purpose, public_raw(key))
        return kid

    def _save(self) -> None:
        data = {
            "active_kid": self.active_kid,
            "audit_kid": self.audit_kid,
            "private": {kid: b64e(private_raw(k)) for kid, k in self._private.items()},
        }
        _write_private(self._keys_path, data)
        self.trust.save(self.trust_store_path)

    def export_trust_store(self, path: str | os.PathLike) -> Path:
        """Copy the public trust store to ``path`` (for a run directory)."""
        self.trust.save(path)
        return Path(path)

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
        self, token: str, job_id: str, min_attempt: int = 0, narrow: dict | None = None, ttl_s: float | None = None
    ) -> str:
        """Renew ``token``: only before expiry, within the session cap and renewal count, scope never wider.

        ``narrow`` optionally asks for a smaller scope (``interfaces``/``devices``/``regions``/``groups``/``objects``);
        ``ttl_s`` may shorten the lifetime (e.g. after a start-up grace), never lengthen it.
        Raises ``TokenRejected`` with the reason code otherwise.
        """
        now = self.clock()
        verifier = self.verifier(job_id, min_attempt)
        try:
            old = verifier.verify(token, now=now)
        except R.TokenRejected as exc:
            if exc.code == R.EXPIRED:
                raise R.TokenRejected(R.RENEWAL_LATE, exc.jti) from None
            raise
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
            return sign_token(data, self._private[self.active_kid], self.active_kid)
