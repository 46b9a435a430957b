"""Reading and verifying an audit log (L5.4): the hash chain record by record, and the signed checkpoints of its head.

:func:`verify_log` never raises for a bad log: it reports the first record that is missing, altered or foreign,
a chain that does not reach the last signed checkpoint (a cut or consistently rewritten tail), records after the
last checkpoint (the unanchored tail) and a torn last line. ``kc audit`` and the tests read logs through it.
Checks against trust held outside the log's directory (the run's pins, :mod:`~kuangchao_core.perm.audit_pins`)
add their findings to the same report (:meth:`VerifyReport.add_problem`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature

from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.audit_chain import CHECKPOINT_TYP, CKPT_DOMAIN, anchors_path_for, genesis_hash, record_hash
from kuangchao_core.perm.tokens import PURPOSE_AUDIT, TrustStore, b64d, canonical_json, pae, strict_json_loads


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


def read_head(path: str | os.PathLike) -> tuple[int, str | None, str | None]:
    """``(seq, hash, log_id)`` of the last complete record of a log (``(0, None, None)`` when it has none).

    Reads only the tail of the file; a torn last line is skipped. Raises ``ValueError`` if that record is unreadable.
    """
    with open(path, "rb") as f:
        buf, pos = b"", f.seek(0, os.SEEK_END)
        while True:
            last_nl = buf.rfind(b"\n")
            if last_nl >= 0:
                prev_nl = buf.rfind(b"\n", 0, last_nl)
                if prev_nl >= 0 or pos == 0:
                    line = buf[prev_nl + 1 : last_nl]
                    break
            if pos == 0:
                return 0, None, None
            start = max(0, pos - 65536)
            f.seek(start)
            buf = f.read(pos - start) + buf
            pos = start
    rec = strict_json_loads_record(line)
    if not isinstance(rec.get("seq"), int) or not isinstance(rec.get("hash"), str):
        raise ValueError("the last record has no integer seq or no hash")
    return rec["seq"], rec["hash"], rec.get("log_id")


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_log`. ``first_bad_seq`` names the first record that is missing, altered or foreign.

    ``head_seq``/``head_hash``: the last record of the valid chain; ``hash_at``: the hashes of the seqs asked for
    (``verify_log(hash_at=...)``); ``checkpoint_kids``: the audit keys the checkpoints name (accepted or not);
    ``trust_problems``: ``{"problem", "detail"}`` of failures not tied to one record (pins, trust, missing anchors).
    """

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
    head_seq: int = 0
    head_hash: str | None = None
    hash_at: dict[int, str] = field(default_factory=dict)
    checkpoint_kids: list[str] = field(default_factory=list)
    trust_problems: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        """The report as a JSON-ready dict."""
        return dict(self.__dict__)

    def add_problem(self, problem: str, detail: str) -> None:
        """Record a failure that no single record is to blame for; the report is no longer ok."""
        self.trust_problems.append({"problem": problem, "detail": detail})
        self.ok = False
        if self.problem is None:
            self.problem, self.detail = problem, detail


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
    hash_at: Iterable[int] = (),
    require_anchors: bool = False,
) -> VerifyReport:
    """Check the chain and the signed checkpoints of one log; never raises for a bad log, reports instead.

    ``log_id``: the expected log (job) id, else the one the log claims. ``hash_at``: seqs whose hashes the report
    keeps (for pins). ``require_anchors``: a log without signed checkpoints fails (``no_anchors``) instead of warning.
    """
    wanted = set(hash_at)
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
    report.head_seq, report.head_hash = valid, (hashes[valid] if valid else None)
    report.hash_at = {s: hashes[s] for s in sorted(wanted) if s in hashes}
    last_anchor, prev_anchor_ok = 0, 0
    for j, cline in enumerate(ckpts, start=1):
        kid = _peek(cline, "kid")
        if isinstance(kid, str) and kid not in report.checkpoint_kids:
            report.checkpoint_kids.append(kid)
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
    if not ckpts and require_anchors:
        report.add_problem(
            "no_anchors",
            f"no signed checkpoints in {anchors}: an enforcing job's log is anchored by the authority, so they were "
            "deleted (or never written); a truncated or rewritten log cannot be ruled out",
        )
    elif not ckpts:
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


def _peek(line: bytes, key: str):
    try:
        return json.loads(line).get(key)
    except (ValueError, AttributeError):
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
            key.verify(b64d(cp["sig"]), pae(CKPT_DOMAIN, canonical_json(body)))
        except (InvalidSignature, ValueError):
            raise ValueError("bad signature") from None
    return cp
