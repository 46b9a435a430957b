"""Tamper-evident audit log (L5.4): hash-chained JSON lines plus signed checkpoints of the chain head.

Record ``n`` carries ``prev_hash`` (the hash of record ``n-1``; for the first record a hash bound to the log id,
i.e. the job id) and ``hash = SHA-256(prev_hash || canonical_json(record without hash))``. Any number of
processes may append: each append takes an exclusive ``flock`` on the log, reads the head, and writes the record
with one ``write`` on an ``O_APPEND`` descriptor. A holder of the audit key (the orchestrating process, never a
worker) appends signed checkpoints ``{log_id, seq, head_hash, ts}`` to ``<log>.anchors``; they catch a tail that
was rewritten consistently or cut off. Records after the last checkpoint are reported as an unanchored tail.
A torn last line (a crash mid-write) is reported, truncated away, and the repair is itself logged.

This module writes; the chain's format is in :mod:`~kuangchao_core.perm.audit_chain`, reading and verifying in
:mod:`~kuangchao_core.perm.audit_verify`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kuangchao_core.errors import KuangchaoError
from kuangchao_core.perm.audit_chain import (
    AUDIT_VERSION,
    CHECKPOINT_TYP,
    CKPT_DOMAIN,
    anchors_path_for,
    genesis_hash,
    record_hash,
    utc_now_iso,
)
from kuangchao_core.perm.tokens import b64e, canonical_json, pae

log = logging.getLogger("kuangchao.perm.audit")


class AuditError(KuangchaoError):
    """The audit log cannot be appended to (its head is unreadable)."""


class AuditLog:
    """Appends hash-chained records to one job's log; safe across threads and processes.

    ``signer`` = ``(kid, Ed25519PrivateKey)`` of the audit key enables :meth:`checkpoint` (and an automatic one every
    ``checkpoint_every`` records written by this process).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        log_id: str,
        *,
        signer: tuple[str, Ed25519PrivateKey] | None = None,
        checkpoint_every: int = 256,
        fsync: bool = False,
    ):
        self.path = Path(path)
        self.log_id = log_id
        self.signer = signer
        self.checkpoint_every = checkpoint_every
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o640)
        self._lock = threading.Lock()
        self._known_size = -1
        self._head: tuple[int, str] | None = None
        self._last_anchor_seq = 0
        self.repairs = 0

    # ------------------------------------------------------------------ writing
    def append(
        self,
        action: str,
        *,
        actor: str,
        decision: str,
        resource: str = "",
        reason: str = "",
        jti: str = "",
        attempt: int | None = None,
        **extra,
    ) -> dict:
        """Append one record and return it (with ``seq`` and ``hash``)."""
        fields = {
            "actor": actor,
            "action": action,
            "resource": resource,
            "decision": decision,
            "reason": reason,
            "jti": jti,
            "attempt": attempt,
        }
        fields.update(extra)
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._sync_head()
                rec = self._write(fields)
                if self.signer and self.checkpoint_every and rec["seq"] % self.checkpoint_every == 0:
                    self._checkpoint_locked()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        return rec

    def _write(self, fields: dict) -> dict:
        seq, prev = self._head
        body = {
            "v": AUDIT_VERSION,
            "log_id": self.log_id,
            "seq": seq + 1,
            "ts": utc_now_iso(),
            "mono_ns": time.monotonic_ns(),
            "pid": os.getpid(),
            **fields,
            "prev_hash": prev,
        }
        body["hash"] = record_hash(prev, body)
        line = canonical_json(body) + b"\n"
        os.write(self._fd, line)
        if self.fsync:
            os.fsync(self._fd)
        self._known_size = os.fstat(self._fd).st_size
        self._head = (body["seq"], body["hash"])
        return body

    def _sync_head(self) -> None:
        size = os.fstat(self._fd).st_size
        if size == self._known_size and self._head is not None:
            return
        if size == 0:
            self._head, self._known_size = (0, genesis_hash(self.log_id)), 0
            return
        last_byte = os.pread(self._fd, 1, size - 1)
        torn = 0
        if last_byte != b"\n":
            torn = self._truncate_torn(size)
            size -= torn
        self._head = self._read_last(size)
        self._known_size = size
        if torn:
            self.repairs += 1
            log.warning(
                "audit log %s: torn last line (%d bytes) removed after a crash; chain continues", self.path, torn
            )
            self._write(
                {
                    "actor": "audit",
                    "action": "log_recovered",
                    "resource": f"log:{self.log_id}",
                    "decision": "info",
                    "reason": "torn_tail",
                    "jti": "",
                    "attempt": None,
                    "bytes_removed": torn,
                }
            )

    def _truncate_torn(self, size: int) -> int:
        pos, chunk = size, 65536
        while pos > 0:
            start = max(0, pos - chunk)
            data = os.pread(self._fd, pos - start, start)
            nl = data.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                os.ftruncate(self._fd, keep)
                return size - keep
            pos = start
        os.ftruncate(self._fd, 0)
        return size

    def _read_last(self, size: int) -> tuple[int, str]:
        if size == 0:
            return 0, genesis_hash(self.log_id)
        pos, buf = size - 1, b""  # size-1 is the trailing newline
        while pos > 0:
            start = max(0, pos - 65536)
            buf = os.pread(self._fd, pos - start, start) + buf
            nl = buf.rfind(b"\n")
            if nl >= 0:
                buf = buf[nl + 1 :]
                break
            pos = start
        try:
            rec = json.loads(buf)
            seq, head, owner = int(rec["seq"]), str(rec["hash"]), rec["log_id"]
        except (ValueError, KeyError, TypeError):
            raise AuditError(
                f"audit log {self.path}: the last record is unreadable, so the chain cannot continue; "
                f"run `kc audit --verify --log {self.path}` and move the damaged file aside"
            ) from None
        if owner != self.log_id:
            raise AuditError(
                f"audit log {self.path} belongs to job {owner!r}, not {self.log_id!r}; give every job its own "
                "file (permission.audit_log with {job_id}, or the default audit/<task>/<job_id>.jsonl)"
            )
        return seq, head

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self) -> dict | None:
        """Sign the current chain head into ``<log>.anchors`` (needs the audit key); None if nothing new."""
        if not self.signer:
            raise AuditError(
                f"audit log {self.path}: no audit key in this process; checkpoints are signed by the authority"
            )
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._sync_head()
                return self._checkpoint_locked()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _checkpoint_locked(self) -> dict | None:
        seq, head = self._head
        if seq == 0 or seq == self._last_anchor_seq:
            return None
        kid, key = self.signer
        body = {
            "typ": CHECKPOINT_TYP,
            "log_id": self.log_id,
            "seq": seq,
            "head_hash": head,
            "ts": utc_now_iso(),
            "kid": kid,
        }
        body["sig"] = b64e(key.sign(pae(CKPT_DOMAIN, canonical_json(body))))
        fd = os.open(anchors_path_for(self.path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        try:
            os.write(fd, canonical_json(body) + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.fsync(self._fd)
        self._last_anchor_seq = seq
        return body

    def close(self) -> None:
        """Write a final checkpoint (if this process holds the audit key) and close the file."""
        if self._fd < 0:
            return
        if self.signer:
            try:
                self.checkpoint()
            except OSError as exc:
                log.error("audit log %s: final checkpoint failed: %s", self.path, exc)
        os.close(self._fd)
        self._fd = -1
