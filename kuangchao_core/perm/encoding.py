"""Byte encodings shared by the signed formats of the permission layer (tokens, signed documents, the audit chain):
strict base64url, canonical JSON and pre-authentication encoding."""

from __future__ import annotations

import base64
import json
import struct


def b64e(data: bytes) -> str:
    """URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64d(text: str) -> bytes:
    """Strict inverse of :func:`b64e`; ValueError on padding, foreign characters or non-canonical encodings."""
    if not isinstance(text, str) or "=" in text or any(c not in _B64_ALPHABET for c in text):
        raise ValueError("not base64url without padding")
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if b64e(raw) != text:
        raise ValueError("non-canonical base64url")
    return raw


_B64_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def canonical_json(obj) -> bytes:
    """Canonical JSON bytes: sorted keys, no spaces, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def pae(*pieces: bytes) -> bytes:
    """Pre-authentication encoding: the count and every piece length-prefixed (little-endian u64)."""
    out = [struct.pack("<Q", len(pieces))]
    for p in pieces:
        out.append(struct.pack("<Q", len(p)))
        out.append(p)
    return b"".join(out)
