"""How a verified audit log disagrees with its job's pins (issue 16; :mod:`~kuangchao_core.perm.audit_pins`)."""

from __future__ import annotations

import os
from typing import NamedTuple

from kuangchao_core.perm.audit_pins import AuditPin, key_fingerprint
from kuangchao_core.perm.audit_verify import VerifyReport, verify_log
from kuangchao_core.perm.tokens import PURPOSE_AUDIT, TrustStore


class PinProblem(NamedTuple):
    """One way a log disagrees with its pins: a short ``problem`` code and a sentence."""

    problem: str
    detail: str

    def __str__(self) -> str:
        return f"{self.problem}: {self.detail}"


def verify_against_pins(
    report_or_log: VerifyReport | str | os.PathLike,
    pins: list[AuditPin],
    expected_job_id: str,
    *,
    trust_store: TrustStore | None = None,
) -> list[PinProblem]:
    """How a log disagrees with the pins of job ``expected_job_id`` (``[]``: it agrees).

    ``report_or_log``: a :func:`verify_log` report made with ``hash_at`` = the pins' seqs, or a log path (verified
    here). Checked: every pin names the expected job; the log is that job's; the chain reaches every pinned head
    with the pinned hash (fewer records = truncated); no record follows a sealed pin (the job's last act); every
    checkpoint is signed by a pinned audit key; and the trust store's copy of each pinned key has the pinned
    fingerprint (a key swapped in beside the log is not).
    """
    if isinstance(report_or_log, VerifyReport):
        report = report_or_log
    else:
        report = verify_log(
            report_or_log, log_id=expected_job_id, trust_store=trust_store, hash_at=[p.seq for p in pins]
        )
    if not pins:
        return [PinProblem("no_pins", f"no audit pins for job {expected_job_id!r}: the log's trust is unpinned")]
    problems = []
    for p in pins:
        if p.job_id != expected_job_id or p.log_id != expected_job_id:
            problems.append(
                PinProblem("pin_wrong_job", f"a pin names job {p.job_id!r} (log {p.log_id!r}), not {expected_job_id!r}")
            )
    if report.log_id != expected_job_id:
        problems.append(
            PinProblem("wrong_job", f"the log is job {report.log_id!r}'s, not {expected_job_id!r}'s: it was swapped")
        )
    for p in sorted(pins, key=lambda x: x.seq):
        if p.seq > report.records:
            problems.append(
                PinProblem(
                    "pin_truncated",
                    f"the log ends at seq {report.records}, but seq {p.seq} was pinned ({p.pinned_at}): "
                    f"{p.seq - report.records} records were cut off",
                )
            )
        elif p.seq and p.seq in report.hash_at and report.hash_at[p.seq] != p.head_hash:
            problems.append(
                PinProblem(
                    "pin_mismatch",
                    f"seq {p.seq} differs from the head pinned at {p.pinned_at}: records up to it were rewritten",
                )
            )
    sealed = [p.seq for p in pins if p.sealed]
    if sealed and report.records > min(sealed):
        problems.append(
            PinProblem(
                "after_seal",
                f"the job sealed its log at seq {min(sealed)} as its last act, but it holds {report.records} records: "
                f"{report.records - min(sealed)} were appended afterwards",
            )
        )
    pinned: dict[str, set[str]] = {}
    for p in pins:
        pinned.setdefault(p.audit_kid, set()).add(p.audit_key_fp)
    for kid in report.checkpoint_kids:
        if kid not in pinned:
            problems.append(
                PinProblem("unpinned_key", f"checkpoints are signed by audit key {kid!r}, which no pin names")
            )
    for kid, fps in sorted(pinned.items()):
        if len(fps) > 1:
            problems.append(PinProblem("pin_key_conflict", f"the pins give audit key {kid!r} {len(fps)} fingerprints"))
            continue
        if trust_store is None:
            continue
        key = trust_store.keys.get(kid)
        if key is None or key.purpose != PURPOSE_AUDIT:
            problems.append(PinProblem("pin_key_missing", f"the trust store has no audit key {kid!r} (pinned)"))
        elif key_fingerprint(key.public) not in fps:
            problems.append(
                PinProblem(
                    "pin_key_mismatch",
                    f"the trust store's audit key {kid!r} has fingerprint {key_fingerprint(key.public)[:16]}…, "
                    f"not the pinned {next(iter(fps))[:16]}…: the trust store was replaced",
                )
            )
    return problems
