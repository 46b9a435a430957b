"""The audit chain's format (L5.4): version, genesis and record hashes, checkpoint type and signing domain.

Shared by the writer (:mod:`~kuangchao_core.perm.audit`) and the verifier (:mod:`~kuangchao_core.perm.audit_verify`)
so that both hash and sign exactly the same bytes.
"""

from __future__ import annotations

import hashlib
import os
from datetime import datetime, timezone
from pathlib import Path

from kuangchao_core.perm.tokens import canonical_json

AUDIT_VERSION = 1
CHECKPOINT_TYP = "kuangchao/audit-checkpoint"
CKPT_DOMAIN = b"kc1.audit-ckpt."


def genesis_hash(log_id: str) -> str:
    """The ``prev_hash`` of the first record: commits the chain to its log (job) id."""
    return hashlib.sha256(b"kuangchao-audit-v1|" + log_id.encode("utf-8")).hexdigest()


def record_hash(prev_hash: str, body: dict) -> str:
    """Hash of one record (``body`` without its ``hash`` field)."""
    return hashlib.sha256(prev_hash.encode("ascii") + canonical_json(body)).hexdigest()


def utc_now_iso() -> str:
    """Now as RFC 3339 UTC with milliseconds."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def anchors_path_for(path: str | os.PathLike) -> Path:
    """Where the signed checkpoints of log ``path`` live."""
    return Path(f"{path}.anchors")
