"""Tamper-evident audit log (L5.4): hash-chained JSON lines plus signed checkpoints of the chain head.

Record ``n`` carries ``prev_hash`` (the hash of record ``n-1``; for the first record a hash bound to the log id,
i.e. the job id) and ``hash = SHA-256(prev_hash || canonical_json(record without hash))``. Any number of
processes may append: each append takes an exclusive ``flock`` on the log, reads the head, and writes the record
with one ``write`` on an ``O_APPEND`` descriptor. A holder of the audit key (the orchestrating process, never a
worker) appends signed checkpoints ``{log_id, seq, head_hash, ts}`` to ``<log>.anchors``; they catch a tail that
was rewritten consistently or cut off. Records after the last checkpoint are reported as an unanchored tail.
A torn last line (a crash mid-write) is reported, truncated away, and the repair is itself logged.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kuangchao_core.errors import KuangchaoError
from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.tokens import PURPOSE_AUDIT, TrustStore, b64d, b64e, canonical_json, pae, strict_json_loads

log = logging.getLogger("kuangchao.perm.audit")

AUDIT_VERSION = 1
CHECKPOINT_TYP = "kuangchao/audit-checkpoint"
_CKPT_DOMAIN = b"kc1.audit-ckpt."


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
        body["sig"] = b64e(key.sign(pae(_CKPT_DOMAIN, canonical_json(body))))
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


# ---------------------------------------------------------------------------------------------- reading / verifying


def read_records(path: str | os.PathLike) -> Iterator[dict]:
    """Every complete, parseable record of a log in file order (a torn last line is skipped)."""
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec, dict):
                yield rec


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_log`. ``first_bad_seq`` names the first record that is missing, altered or foreign."""

    ok: bool
    log_id: str | None
    records: int
    checkpoints: int = 0
    first_bad_seq: int | None = None
    first_bad_line: int | None = None
    problem: str | None = None
    detail: str = ""
    unanchored_tail: int = 0
    torn_tail_bytes: int = 0
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _fail(report: VerifyReport, problem: str, seq: int, line: int | None, detail: str) -> None:
    if report.first_bad_seq is None or seq < report.first_bad_seq:
        report.ok, report.problem, report.first_bad_seq, report.first_bad_line = False, problem, seq, line
        report.detail = detail


def verify_log(
    path: str | os.PathLike,
    *,
    log_id: str | None = None,
    trust_store: TrustStore | None = None,
    anchors: str | os.PathLike | None = None,
) -> VerifyReport:
    """Check the chain and the signed checkpoints of one log; never raises for a bad log, reports instead."""
    raw = Path(path).read_bytes()
    lines = raw.split(b"\n")
    torn = lines.pop()  # the bytes after the last newline ("" when the file ends cleanly)
    anchors = Path(anchors) if anchors else anchors_path_for(path)
    ckpts = []
    if anchors.exists():
        ckpts = [ln for ln in anchors.read_bytes().split(b"\n") if ln.strip()]
    if log_id is None:
        log_id = _claimed_log_id(ckpts, lines)
    report = VerifyReport(ok=True, log_id=log_id, records=len(lines), torn_tail_bytes=len(torn))
    if torn:
        report.warnings.append(f"torn_tail: the last {len(torn)} bytes are an incomplete record (crash mid-write)")
    prev = genesis_hash(log_id or "")
    hashes: dict[int, str] = {}
    for i, line in enumerate(lines, start=1):
        try:
            rec = strict_json_loads_record(line)
        except ValueError as exc:
            _fail(report, "unparseable", i, i, f"line {i} is not a valid record: {exc}")
            break
        seq = rec.get("seq")
        if not isinstance(seq, int):
            _fail(report, "unparseable", i, i, f"line {i} has no integer seq")
            break
        if rec.get("log_id") != log_id:
            _fail(
                report, "wrong_log_id", min(i, seq), i, f"line {i} belongs to log {rec.get('log_id')!r}, not {log_id!r}"
            )
            break
        if seq != i:
            _fail(
                report, "sequence", min(i, seq), i, f"line {i} holds seq {seq}: a record was deleted, moved or inserted"
            )
            break
        if rec.get("prev_hash") != prev:
            _fail(report, "chain_break", i, i, f"seq {i}: prev_hash does not match the hash of seq {i - 1}")
            break
        body = {k: v for k, v in rec.items() if k != "hash"}
        if record_hash(prev, body) != rec.get("hash"):
            _fail(report, "hash_mismatch", i, i, f"seq {i}: record content does not match its hash (edited)")
            break
        prev = rec["hash"]
        hashes[i] = prev
    valid = len(hashes)
    last_anchor, prev_anchor_ok = 0, 0
    for j, cline in enumerate(ckpts, start=1):
        try:
            cp = _verify_checkpoint(cline, trust_store, log_id)
        except ValueError as exc:
            seq = _peek_seq(cline)
            _fail(report, "bad_checkpoint", seq, None, f"checkpoint {j} (seq {seq}) rejected: {exc}")
            break
        report.checkpoints += 1
        seq = cp["seq"]
        last_anchor = max(last_anchor, seq)
        if seq > report.records:
            _fail(
                report,
                "truncated",
                report.records + 1,
                None,
                f"checkpoint {j} anchors seq {seq} but the log ends at seq {report.records}: records were cut off",
            )
            break
        if seq <= valid and hashes[seq] != cp["head_hash"]:
            _fail(
                report,
                "checkpoint_mismatch",
                seq,
                seq,
                f"seq {seq} differs from the signed checkpoint {j}: records in ({prev_anchor_ok}, {seq}] were rewritten",
            )
            break
        if seq <= valid:
            prev_anchor_ok = seq
    if trust_store is None and ckpts:
        report.warnings.append("checkpoint signatures not checked: no trust store given (--trust-store)")
    if not ckpts:
        report.warnings.append("no signed checkpoints: a consistently rewritten or truncated log cannot be detected")
    if report.ok:
        report.unanchored_tail = report.records - last_anchor
        if report.unanchored_tail:
            report.warnings.append(f"unanchored tail of {report.unanchored_tail} records after the last checkpoint")
    return report


def strict_json_loads_record(line: bytes) -> dict:
    """Parse one audit record (duplicate keys refused)."""

    def no_dup(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate key")
        return dict(pairs)

    try:
        rec = json.loads(line.decode("utf-8"), object_pairs_hook=no_dup)
    except UnicodeDecodeError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(rec, dict):
        raise ValueError("not a JSON object")
    return rec


def _claimed_log_id(ckpts: list[bytes], lines: list[bytes]) -> str | None:
    for src in (ckpts[:1], lines[:1]):
        for line in src:
            try:
                return json.loads(line).get("log_id")
            except (ValueError, AttributeError):
                pass
    return None


def _peek_seq(line: bytes) -> int:
    try:
        return int(json.loads(line)["seq"])
    except (ValueError, KeyError, TypeError):
        return 0


def _verify_checkpoint(line: bytes, trust_store: TrustStore | None, log_id: str | None) -> dict:
    cp = strict_json_loads(line)
    if not isinstance(cp, dict) or cp.get("typ") != CHECKPOINT_TYP:
        raise ValueError("not an audit checkpoint")
    if set(cp) != {"typ", "log_id", "seq", "head_hash", "ts", "kid", "sig"} or not isinstance(cp["seq"], int):
        raise ValueError("unexpected checkpoint fields")
    if cp["log_id"] != log_id:
        raise ValueError(f"checkpoint of log {cp['log_id']!r}, not {log_id!r}")
    if trust_store is not None:
        try:
            key = trust_store.key_for(cp["kid"], PURPOSE_AUDIT, time.time())
        except R.TokenRejected as exc:
            raise ValueError(f"audit key {cp['kid']!r}: {exc.code}") from None
        body = {k: v for k, v in cp.items() if k != "sig"}
        try:
            key.verify(b64d(cp["sig"]), pae(_CKPT_DOMAIN, canonical_json(body)))
        except (InvalidSignature, ValueError):
            raise ValueError("bad signature") from None
    return cp
