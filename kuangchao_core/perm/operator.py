"""Operator identities: the Ed25519 keys with which people change a running job (``kc config set``,
``kc token revoke``).

An operator key lives outside every run directory and every worker environment: in ``$KC_OPERATOR_KEY`` or
``~/.config/kuangchao/operator.key`` (a 0600 file made by ``kc operator init``). A job trusts the public halves
listed in ``permission.operators`` (``NAME:PUBLIC_KEY`` as ``kc operator show`` prints it) plus the key of the
operator who started it; the orchestrator puts them into the job's signed trust store. A change is a document
signed with the key (:mod:`kuangchao_core.perm.signed_doc`); the job applies only changes whose signer it trusts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kuangchao_core.config.bounded_json import read_json_file
from kuangchao_core.errors import ConfigError, KuangchaoError
from kuangchao_core.perm.tokens import b64d, b64e, private_raw, public_raw

ENV_OPERATOR_KEY = "KC_OPERATOR_KEY"
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}\Z")


def operator_key_path() -> Path:
    """Where this user's operator key lives: ``$KC_OPERATOR_KEY`` or ``~/.config/kuangchao/operator.key``."""
    env = os.environ.get(ENV_OPERATOR_KEY)
    return Path(env) if env else Path.home() / ".config" / "kuangchao" / "operator.key"


def operator_kid(public: bytes) -> str:
    """The id of an operator's public key: ``op-`` and the first 16 hex digits of its SHA-256."""
    return "op-" + hashlib.sha256(public).hexdigest()[:16]


@dataclass(frozen=True)
class TrustedOperator:
    """The public half of an operator key, as a job trusts it."""

    name: str
    public: bytes

    @property
    def kid(self) -> str:
        return operator_kid(self.public)

    def spec(self) -> str:
        """``NAME:PUBLIC_KEY``, the form ``permission.operators`` takes."""
        return f"{self.name}:{b64e(self.public)}"

    def to_json(self) -> dict:
        return {"name": self.name, "public_key": b64e(self.public)}


@dataclass(frozen=True)
class OperatorKey:
    """An operator's private key and name (only ever in the operator's own process)."""

    name: str
    private: Ed25519PrivateKey

    @property
    def public(self) -> TrustedOperator:
        return TrustedOperator(self.name, public_raw(self.private))

    @property
    def kid(self) -> str:
        return self.public.kid

    @property
    def actor(self) -> str:
        """How audit records name this operator."""
        return f"operator:{self.name}"

    def sign(self, typ: str, body: dict) -> dict:
        """``body`` as a ``typ`` document signed with this key."""
        from kuangchao_core.perm.signed_doc import sign_document

        return sign_document(typ, body, self.private, self.kid)

    def __repr__(self) -> str:  # never the key
        return f"OperatorKey(name={self.name!r}, kid={self.kid!r})"


def parse_operator(spec: str, where: str = "permission.operators") -> TrustedOperator:
    """``NAME:PUBLIC_KEY`` → :class:`TrustedOperator`; ConfigError naming ``where`` when malformed."""
    name, sep, key = str(spec).partition(":")
    try:
        public = b64d(key) if sep else b""
    except ValueError:
        public = b""
    if not _NAME.match(name) or len(public) != 32:
        raise ConfigError([(where, f"{spec!r} is not NAME:PUBLIC_KEY (as `kc operator show` prints it)")])
    return TrustedOperator(name, public)


def create_operator_key(path: str | os.PathLike | None = None, name: str | None = None) -> OperatorKey:
    """Generate a key and write it to ``path`` (default :func:`operator_key_path`), owner-only; refuses to
    overwrite an existing key."""
    path = Path(path) if path else operator_key_path()
    name = name or os.environ.get("USER") or "operator"
    if not _NAME.match(name):
        raise KuangchaoError(f"operator name {name!r}: use letters, digits and _.@- (at most 64)")
    key = OperatorKey(name, Ed25519PrivateKey.generate())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"name": name, "private_key": b64e(private_raw(key.private))}, f)
    return key


def load_operator_key(path: str | os.PathLike | None = None) -> OperatorKey:
    """Read the operator key; KuangchaoError saying how to make one when it is missing, and refusing a key file
    that others can read."""
    path = Path(path) if path else operator_key_path()
    if not path.is_file():
        raise KuangchaoError(
            f"no operator key at {path}: create one with `kc operator init` (or point ${ENV_OPERATOR_KEY} at yours); "
            "the job must trust it (it does when you started it, or list `kc operator show` in permission.operators)"
        )
    if path.stat().st_mode & 0o077:
        raise KuangchaoError(f"operator key {path} is readable by others; run `chmod 600 {path}`")
    try:
        data = read_json_file(path)
        return OperatorKey(str(data["name"]), Ed25519PrivateKey.from_private_bytes(b64d(data["private_key"])))
    except (ValueError, KeyError, TypeError) as exc:
        raise KuangchaoError(f"operator key {path} is not a Kuangchao operator key ({exc})") from None


def local_operator(create: bool = True) -> TrustedOperator | None:
    """The public half of this user's operator key, created on first use when ``create``; None if absent."""
    path = operator_key_path()
    if path.is_file():
        return load_operator_key(path).public
    if not create:
        return None
    key = create_operator_key(path)
    logging.getLogger("kuangchao.perm.operator").warning(
        "created your operator key %s (%s) at %s: `kc config set` and `kc token revoke` sign with it",
        key.kid,
        key.name,
        path,
    )
    return key.public
