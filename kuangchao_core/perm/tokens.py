"""Capability tokens: Ed25519-signed claims in a fixed, versioned format, and their verifier.

Format (no algorithm negotiation; the key id is outside the claims)::

    kc1.cap.<b64url(payload)>.<b64url(signature, 64 bytes)>.<b64url(footer)>

``payload`` is canonical JSON of the claims, ``footer`` is canonical JSON ``{"kid": ...}``, and the signature
covers ``PAE(b"kc1.cap.", payload, footer, implicit)`` (PASETO-style pre-authentication encoding). The verifier
follows the checklist of the reference (§4.2) in order; any failure raises ``TokenRejected`` with a reason code.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, ValidationError

from kuangchao_core.config.bounded_json import loads_bounded, read_json_file
from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.encoding import b64d, b64e, canonical_json, pae  # noqa: F401 (re-exported)
from kuangchao_core.perm.names import CLAIM_KINDS, INTERFACES, OBJECT_KINDS, is_canonical_value

PREFIX = "kc1.cap."
CAP_TYP = "kuangchao/capability"
MAX_TOKEN_BYTES = 8192
MAX_JSON_DEPTH = 4
MAX_JSON_KEYS = 64
DEFAULT_ISSUER = "kuangchao-authority"
DEFAULT_AUDIENCE = "kuangchao-guard"
DEFAULT_LEEWAY_S = 30
DEFAULT_MAX_TTL_S = 24 * 3600
PURPOSE_CAPABILITY = "capability"
PURPOSE_AUDIT = "audit"
TRUST_STORE_TYP = "kuangchao/trust-store"
_IMPLICIT = CAP_TYP.encode()


def token_digest(token: str) -> str:
    """SHA-256 of a raw token (the only form of a token that may be logged besides its ``jti``)."""
    return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate JSON key")
    if len(keys) > MAX_JSON_KEYS:
        raise ValueError("too many JSON keys")
    return dict(pairs)


def strict_json_loads(raw: bytes):
    """Parse JSON refusing duplicate keys, NaN/Infinity, excessive depth or key counts."""

    def bad_constant(name):
        raise ValueError(f"non-finite number {name}")

    obj = loads_bounded(
        raw, max_depth=MAX_JSON_DEPTH + 1, object_pairs_hook=_no_duplicates, parse_constant=bad_constant
    )
    _check_depth(obj, 0)
    return obj


def _check_depth(obj, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise ValueError("JSON nested too deeply")
    if isinstance(obj, dict):
        for v in obj.values():
            _check_depth(v, depth + 1)
    elif isinstance(obj, list):
        if len(obj) > 256:
            raise ValueError("JSON list too long")
        for v in obj:
            _check_depth(v, depth + 1)


class Claims(BaseModel):
    """The signed claims of a capability token (strict: unknown fields and wrong types are refused)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    typ: Literal["kuangchao/capability"]
    jti: str
    iss: str
    aud: str | list[str]
    sub: str
    role: str
    job_id: str
    attempt: int
    devices: list[str] = []
    regions: list[str] = []
    groups: list[str] = []
    interfaces: list[str] = []
    objects: list[str] = []
    iat: int
    nbf: int
    exp: int
    sid: str
    session_iat: int
    renewals: int = 0
    once: bool = False

    def scope(self) -> dict[str, frozenset[str]]:
        """The token's scope as sets: ``interfaces`` and one set of canonical resource names per kind."""
        out = {"interfaces": frozenset(self.interfaces)}
        for fld in ("devices", "regions", "groups", "objects"):
            out[fld] = frozenset(getattr(self, fld))
        return out

    def resources(self) -> frozenset[str]:
        """Every resource granted, as canonical ``kind:value`` names."""
        names = {f"{CLAIM_KINDS[fld]}:{v}" for fld in CLAIM_KINDS for v in getattr(self, fld)}
        names.update(self.objects)
        return frozenset(names)


#: the one wildcard a token may carry: ``groups: ["*"]`` — every communication group of the job (``kc launch``: a
#: user's script creates groups whose names cannot be known when its tokens are issued)
ANY_GROUP = "*"


def check_canonical(claims: Claims) -> bool:
    """Whether every name in ``claims`` is canonical (the groups claim may also be exactly ``["*"]``)."""
    for fld, kind in CLAIM_KINDS.items():
        values = getattr(claims, fld)
        if kind == "group" and list(values) == [ANY_GROUP]:
            continue
        if not all(is_canonical_value(kind, v) for v in values):
            return False
    for obj in claims.objects:
        kind, sep, value = obj.partition(":")
        if not sep or kind not in OBJECT_KINDS or not is_canonical_value(kind, value):
            return False
    return all(i in INTERFACES for i in claims.interfaces)


# ----------------------------------------------------------------------------------------------- keys


def new_kid(purpose: str) -> str:
    """A fresh key id naming its purpose."""
    return f"{purpose[:3]}-{secrets.token_hex(6)}"


def public_raw(key: Ed25519PrivateKey) -> bytes:
    """The 32 raw bytes of the public half of ``key``."""
    from cryptography.hazmat.primitives import serialization

    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_raw(key: Ed25519PrivateKey) -> bytes:
    """The 32 raw bytes of a private key (only ever written to owner-only files)."""
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


@dataclass
class TrustedKey:
    """A public key of the trust store with its purpose and status (``active``, ``grace``, ``retired``, ``revoked``)."""

    kid: str
    purpose: str
    public: bytes
    status: str = "active"
    grace_until: float | None = None

    def to_json(self) -> dict:
        return {
            "kid": self.kid,
            "purpose": self.purpose,
            "public_key": b64e(self.public),
            "status": self.status,
            "grace_until": self.grace_until,
        }


@dataclass
class TrustStore:
    """Public keys and revocations a verifier trusts; the only place a key is ever looked up."""

    keys: dict[str, TrustedKey] = field(default_factory=dict)
    revoked_jti: set[str] = field(default_factory=set)
    revoked_sub: set[str] = field(default_factory=set)
    issuers: list[str] = field(default_factory=lambda: [DEFAULT_ISSUER])
    #: trusted operator keys, ``kid -> {"name", "public_key"}`` (see :mod:`kuangchao_core.perm.operator`)
    operators: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "version": 1,
            "issuers": list(self.issuers),
            "keys": [k.to_json() for k in self.keys.values()],
            "revoked": {"jti": sorted(self.revoked_jti), "sub": sorted(self.revoked_sub)},
            "operators": {kid: dict(v) for kid, v in sorted(self.operators.items())},
        }

    @classmethod
    def from_json(cls, data: dict) -> TrustStore:
        keys = {}
        for k in data.get("keys", []):
            keys[k["kid"]] = TrustedKey(
                k["kid"], k["purpose"], b64d(k["public_key"]), k["status"], k.get("grace_until")
            )
        rev = data.get("revoked", {})
        operators = {str(k): dict(v) for k, v in (data.get("operators") or {}).items()}
        return cls(
            keys,
            set(rev.get("jti", [])),
            set(rev.get("sub", [])),
            list(data.get("issuers", [DEFAULT_ISSUER])),
            operators,
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (temporary file + rename), world-readable: it holds public keys only."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> TrustStore:
        """Read a trust store file: a signed one (the authority's, see :meth:`load_verified`) is read without checking
        its signature — only for tools that hold no trust root; workers use :meth:`load_verified`."""
        data = read_json_file(path)
        if isinstance(data, dict) and data.get("typ") == TRUST_STORE_TYP and isinstance(data.get("body"), dict):
            data = data["body"]
        return cls.from_json(data)

    def save_signed(self, path: str | os.PathLike, key: Ed25519PrivateKey, kid: str) -> Path:
        """Write the store as a document signed by the authority's key ``kid`` (world-readable: public keys only)."""
        from kuangchao_core.perm.signed_doc import sign_document, write_document

        return write_document(path, sign_document(TRUST_STORE_TYP, self.to_json(), key, kid))

    @classmethod
    def load_verified(cls, path: str | os.PathLike, root: str) -> TrustStore:
        """Read a trust store signed by ``root`` (``KID:PUBLIC_KEY``, as :func:`trust_root_of` gives it); raises
        ``DocumentRejected`` when it is unsigned, altered or signed by another key."""
        from kuangchao_core.perm.signed_doc import read_document, verify_document

        kid, public = parse_trust_root(root)
        doc = read_document(path)
        if not isinstance(doc, dict) or doc.get("kid") != kid:
            from kuangchao_core.perm.signed_doc import DocumentRejected

            raise DocumentRejected(str(path), "not signed by this job's authority")
        return cls.from_json(verify_document(doc, TRUST_STORE_TYP, public, where=str(path)))

    def operator_public(self, kid: str) -> bytes | None:
        """The public key of trusted operator ``kid`` (None when the job does not trust it)."""
        entry = self.operators.get(kid) if isinstance(kid, str) else None
        try:
            return b64d(entry["public_key"]) if entry else None
        except (KeyError, ValueError, TypeError):
            return None

    def key_for(self, kid: str, purpose: str, now: float) -> Ed25519PublicKey:
        """The public key ``kid`` for ``purpose``; TokenRejected (fail closed) if unknown, revoked or retired."""
        k = self.keys.get(kid) if isinstance(kid, str) else None
        if k is None or k.purpose != purpose:
            raise R.TokenRejected(R.UNKNOWN_KEY)
        if k.status == "revoked":
            raise R.TokenRejected(R.REVOKED_KEY)
        if k.status == "retired" or (k.status == "grace" and (k.grace_until is None or now > k.grace_until)):
            raise R.TokenRejected(R.RETIRED_KEY)
        return Ed25519PublicKey.from_public_bytes(k.public)


def trust_root_of(kid: str, key: Ed25519PrivateKey | bytes) -> str:
    """``KID:PUBLIC_KEY`` of the key that signs a job's trust store and policy (handed to workers, public)."""
    public = key if isinstance(key, bytes) else public_raw(key)
    return f"{kid}:{b64e(public)}"


def parse_trust_root(root: str) -> tuple[str, bytes]:
    """Inverse of :func:`trust_root_of`; ValueError when malformed."""
    kid, sep, key = str(root).rpartition(":")
    public = b64d(key)
    if not sep or not kid or len(public) != 32:
        raise ValueError("trust root must be KID:PUBLIC_KEY")
    return kid, public


# ----------------------------------------------------------------------------------------------- sign / verify


def sign_token(claims: dict, key: Ed25519PrivateKey, kid: str) -> str:
    """Sign a claims dict (no validation: the authority validates; tests use this to build hostile tokens)."""
    payload = canonical_json(claims)
    footer = canonical_json({"kid": kid})
    sig = key.sign(pae(PREFIX.encode(), payload, footer, _IMPLICIT))
    return f"{PREFIX}{b64e(payload)}.{b64e(sig)}.{b64e(footer)}"


def split_token(token: str) -> tuple[bytes, bytes, bytes]:
    """Shape checks (size, prefix, segments, base64, signature length); returns (payload, signature, footer)."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_BYTES or not token.isascii():
        raise R.TokenRejected(R.MALFORMED)
    if not token.startswith(PREFIX):
        raise R.TokenRejected(R.UNSUPPORTED_VERSION)
    parts = token[len(PREFIX) :].split(".")
    if len(parts) != 3:
        raise R.TokenRejected(R.MALFORMED)
    try:
        payload, sig, footer = (b64d(p) for p in parts)
    except (ValueError, binascii.Error):
        raise R.TokenRejected(R.MALFORMED) from None
    if len(sig) != 64 or not payload:
        raise R.TokenRejected(R.MALFORMED)
    return payload, sig, footer


def _footer_kid(footer: bytes) -> str:
    try:
        data = strict_json_loads(footer)
    except (ValueError, UnicodeDecodeError):
        raise R.TokenRejected(R.MALFORMED) from None
    if not isinstance(data, dict) or set(data) != {"kid"} or not isinstance(data["kid"], str):
        raise R.TokenRejected(R.MALFORMED)  # nothing but a key id may ride in the footer (no embedded keys)
    return data["kid"]


class ReplayCache:
    """Seen ``jti`` values of one-shot tokens, each kept until its expiry plus leeway (thread-safe)."""

    def __init__(self):
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def consume(self, jti: str, keep_until: float, now: float) -> bool:
        """Record ``jti``; False when it was already seen (a replay)."""
        with self._lock:
            for k in [k for k, t in self._seen.items() if t < now]:
                del self._seen[k]
            if jti in self._seen:
                return False
            self._seen[jti] = keep_until
            return True


class Verifier:
    """Verifies capability tokens for one job, attempt and audience against a local trust store."""

    def __init__(
        self,
        trust_store: TrustStore,
        *,
        job_id: str,
        min_attempt: int = 0,
        audience: str = DEFAULT_AUDIENCE,
        issuers: Iterable[str] | None = None,
        leeway_s: float = DEFAULT_LEEWAY_S,
        max_ttl_s: float = DEFAULT_MAX_TTL_S,
        clock: Callable[[], float] = time.time,
        replay_cache: ReplayCache | None = None,
    ):
        self.trust_store = trust_store
        self.job_id = job_id
        self.min_attempt = min_attempt
        self.audience = audience
        self.issuers = frozenset(issuers if issuers is not None else trust_store.issuers)
        self.leeway_s = leeway_s
        self.max_ttl_s = max_ttl_s
        self.clock = clock
        self.replay_cache = replay_cache or ReplayCache()

    def verify(
        self, token: str, *, subject: str | None = None, one_shot: bool = False, now: float | None = None
    ) -> Claims:
        """Run the checklist; return the claims or raise ``TokenRejected`` with the reason code."""
        now = self.clock() if now is None else now
        payload, sig, footer = split_token(token)  # 1. size and shape
        kid = _footer_kid(footer)
        public = self.trust_store.key_for(kid, PURPOSE_CAPABILITY, now)  # 2. key from the local store only
        try:  # 3. signature before any parsing of the claims
            public.verify(sig, pae(PREFIX.encode(), payload, footer, _IMPLICIT))
        except InvalidSignature:
            raise R.TokenRejected(R.BAD_SIGNATURE) from None
        try:  # 4. strict parse
            data = strict_json_loads(payload)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise R.TokenRejected(R.MALFORMED) from None
        if not isinstance(data, dict):
            raise R.TokenRejected(R.MALFORMED)
        jti = data.get("jti") if isinstance(data.get("jti"), str) else None
        if data.get("typ") != CAP_TYP:  # 5. explicit type
            raise R.TokenRejected(R.WRONG_TYPE, jti)
        try:
            claims = Claims.model_validate(data)
        except ValidationError:
            raise R.TokenRejected(R.MALFORMED, jti) from None
        if not check_canonical(claims):
            raise R.TokenRejected(R.MALFORMED, jti)
        if claims.iss not in self.issuers:  # 6. issuer and subject
            raise R.TokenRejected(R.WRONG_ISSUER, jti)
        if subject is not None and claims.sub != subject:
            raise R.TokenRejected(R.WRONG_SUBJECT, jti)
        if not isinstance(claims.aud, str) or claims.aud != self.audience:  # 7. one audience, ours
            raise R.TokenRejected(R.AUDIENCE, jti)
        self.check_time(claims, now)  # 8. time
        if claims.job_id != self.job_id:  # 9. binding
            raise R.TokenRejected(R.WRONG_JOB, jti)
        if claims.attempt < self.min_attempt:
            raise R.TokenRejected(R.STALE_ATTEMPT, jti)
        ts = self.trust_store  # 10. revocation
        if claims.jti in ts.revoked_jti or claims.sid in ts.revoked_jti or claims.sub in ts.revoked_sub:
            raise R.TokenRejected(R.REVOKED, jti)
        if claims.once and one_shot:  # 11. replay of one-shot tokens
            if not self.replay_cache.consume(claims.jti, claims.exp + self.leeway_s, now):
                raise R.TokenRejected(R.REPLAY, jti)
        return claims

    def check_time(self, claims: Claims, now: float) -> None:
        """Checklist step 8: lifetime bound, not-before / issued-at in the future, expiry, all with leeway."""
        L = self.leeway_s
        if claims.exp - claims.iat > self.max_ttl_s:
            raise R.TokenRejected(R.TTL_TOO_LONG, claims.jti)
        if claims.nbf > now + L or claims.iat > now + L:
            raise R.TokenRejected(R.NOT_YET_VALID, claims.jti)
        if not now < claims.exp + L:
            raise R.TokenRejected(R.EXPIRED, claims.jti)
