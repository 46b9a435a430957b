"""Revocations made while a job runs: operator-signed documents the job's authority honours at the next renewal.

``kc token revoke --run DIR TOKEN_ID|MODULE`` appends one signed document per revocation to
``<run>/authority/revocations.json`` (a JSON list, rewritten atomically under an ``flock``). The authority reads the
file before every renewal (:meth:`~kuangchao_core.perm.authority.Authority.refresh_revocations`) and applies each
entry whose signer is an operator the job trusts; the holder's next renewal is refused, and its guard stops
allowing anything from then on — so a revocation takes effect within one renewal period (half a token lifetime).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import time
from pathlib import Path

from kuangchao_core.config.bounded_json import read_json_file
from kuangchao_core.perm.signed_doc import DocumentRejected, sign_document, verify_document, write_document

REVOCATION_TYP = "kuangchao/revocation"
_JTI = re.compile(r"[0-9a-f]{24}\Z")
log = logging.getLogger("kuangchao.perm.revocation")


def revocation_target(target: str) -> tuple[str, str]:
    """``("jti", id)`` for a token id (24 hex digits, as audit records show it), else ``("sub", module)``."""
    return ("jti", target) if _JTI.match(target) else ("sub", target)


def sign_revocation(operator, job_id: str, target: str, reason: str = "") -> dict:
    """The signed revocation of ``target`` (a token id or a module name) in job ``job_id`` by ``operator``
    (an :class:`~kuangchao_core.perm.operator.OperatorKey`)."""
    kind, value = revocation_target(target)
    body = {"job_id": job_id, "kind": kind, "target": value, "ts": time.time(), "operator": operator.name}
    if reason:
        body["reason"] = reason[:200]
    return sign_document(REVOCATION_TYP, body, operator.private, operator.kid)


def append_revocation(path: str | os.PathLike, doc: dict) -> int:
    """Add ``doc`` to the revocation file (created 0644 if absent); returns how many entries it holds."""
    path = Path(path)
    with open(path.with_name(path.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entries = read_json_file(path) if path.exists() else []
            if not isinstance(entries, list):
                entries = []
            entries.append(doc)
            write_document(path, entries)  # a list of signed documents; each is verified on its own
            return len(entries)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_revocations(path: str | os.PathLike, trust, job_id: str) -> list[dict]:
    """The verified revocations of ``job_id`` in ``path``: each signed by an operator ``trust`` (a
    :class:`~kuangchao_core.perm.tokens.TrustStore`) names; any other entry is skipped with a warning."""
    try:
        entries = read_json_file(path)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("revocation file %s unreadable (%s); no revocation applied from it", path, exc)
        return []
    out = []
    for i, doc in enumerate(entries if isinstance(entries, list) else []):
        kid = doc.get("kid") if isinstance(doc, dict) else None
        public = trust.operator_public(kid)
        try:
            if public is None:
                raise DocumentRejected(f"{path}[{i}]", f"signer {kid!r} is not an operator this job trusts")
            body = verify_document(doc, REVOCATION_TYP, public, where=f"{path}[{i}]")
        except DocumentRejected as exc:
            log.warning("revocation skipped: %s", exc)
            continue
        if body.get("job_id") == job_id and body.get("kind") in ("jti", "sub") and isinstance(body.get("target"), str):
            out.append(body)
    return out
