"""Signed JSON documents: the trust store, the policy, global-config versions and revocations.

A signed document is a JSON object ``{"typ": ..., "body": {...}, "kid": ..., "sig": <b64url>}``; the Ed25519
signature covers ``PAE(b"kc1.doc.", typ, canonical_json(body), kid)``, so a body signed as one type (a policy) can
never be passed off as another (a trust store). Verification takes the expected type and the public key from the
caller — never from the document — and returns the body, or raises :class:`DocumentRejected` with the reason.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kuangchao_core.config.bounded_json import loads_bounded
from kuangchao_core.errors import KuangchaoError
from kuangchao_core.perm.encoding import b64d, b64e, canonical_json, pae

_DOMAIN = b"kc1.doc."
MAX_DOC_BYTES = 4 * 1024 * 1024


class DocumentRejected(KuangchaoError):
    """A signed document failed verification (``reason`` says why; the path is in the message)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def _message(typ: str, body: dict, kid: str) -> bytes:
    return pae(_DOMAIN, typ.encode(), canonical_json(body), kid.encode())


def sign_document(typ: str, body: dict, key: Ed25519PrivateKey, kid: str) -> dict:
    """The signed document of ``body`` (a JSON object) as type ``typ``, signed by ``key`` named ``kid``."""
    return {"typ": typ, "body": body, "kid": kid, "sig": b64e(key.sign(_message(typ, body, kid)))}


def document_signer(doc: object) -> str | None:
    """The ``kid`` a document claims to be signed by (None when it is not a signed document)."""
    if isinstance(doc, dict) and isinstance(doc.get("kid"), str):
        return doc["kid"]
    return None


def verify_document(doc: object, typ: str, public: bytes | Ed25519PublicKey, *, where: str = "document") -> dict:
    """The body of ``doc`` if it is a ``typ`` document signed by ``public``; else :class:`DocumentRejected`."""
    if not isinstance(doc, dict) or set(doc) != {"typ", "body", "kid", "sig"}:
        raise DocumentRejected(where, "not a signed Kuangchao document (unsigned or altered layout)")
    if doc["typ"] != typ:
        raise DocumentRejected(where, f"a {doc['typ']!r} document where a {typ!r} one was expected")
    body, kid, sig = doc["body"], doc["kid"], doc["sig"]
    if not isinstance(body, dict) or not isinstance(kid, str) or not isinstance(sig, str):
        raise DocumentRejected(where, "malformed signed document")
    key = public if isinstance(public, Ed25519PublicKey) else Ed25519PublicKey.from_public_bytes(public)
    try:
        key.verify(b64d(sig), _message(typ, body, kid))
    except (InvalidSignature, ValueError):
        raise DocumentRejected(where, f"bad signature (claimed signer {kid})") from None
    return body


def read_document(path: str | os.PathLike) -> object:
    """Parse a document file (a regular file of at most ``MAX_DOC_BYTES``); DocumentRejected if unreadable."""
    p = Path(path)
    try:
        if not p.is_file() or p.is_symlink():
            raise DocumentRejected(str(p), "missing or not a regular file")
        if p.stat().st_size > MAX_DOC_BYTES:
            raise DocumentRejected(str(p), "too large")
        return loads_bounded(p.read_bytes(), max_bytes=MAX_DOC_BYTES)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise DocumentRejected(str(p), f"unreadable ({exc})") from None


def write_document(path: str | os.PathLike, doc: dict, mode: int = 0o644) -> Path:
    """Write ``doc`` atomically (temporary file in the same directory, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(doc, indent=1, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
