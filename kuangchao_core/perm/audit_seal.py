"""Sealing a job's audit log as the orchestrator's last act (issue 26).

The chain hash is unkeyed, so records after the last signed checkpoint could be edited, deleted or extended by
anyone who can write the file. The seal closes that tail: the orchestrator appends an ``audit_seal`` record, signs a
checkpoint of it with the audit key (which no worker holds) and records a pin with ``sealed: true`` outside the run
directory (MLflow, Prefect; :func:`~kuangchao_core.perm.audit_pins.record_audit_pin`). A verifier then wants the log
to end exactly at the sealed seq with the sealed hash: an appended record (``after_seal``), a deleted one
(``pin_truncated``) or an edited one (``pin_mismatch``) fails. A log without a sealed pin (the job still runs, or
its orchestrator was killed) fails as ``unsealed`` unless ``kc audit --allow-unsealed``.

The launch registers how to pin its job (:func:`register_seal`); the job's end (``close_authority``) seals it
(:func:`seal_registered`), after every record the orchestrator writes.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.audit_pins import AuditPin, AuditPinError, record_audit_pin

log = logging.getLogger("kuangchao.perm.audit_seal")
_SEALS: dict[str, partial] = {}


def _key(run_dir: str | os.PathLike) -> str:
    return str(Path(run_dir).resolve())


def seal_audit_log(
    run_dir: str | os.PathLike,
    log_path: str | os.PathLike,
    job_id: str,
    signer: tuple[str, Ed25519PrivateKey],
    *,
    public_key_raw: bytes,
    **pin_kwargs,
) -> AuditPin:
    """Append the ``audit_seal`` record, sign a checkpoint of it and record the sealed pin (``pin_kwargs``: the
    ``mlflow_run_id``, ``tracking_uri``, ``mode``, ``pin_store`` and ``hooks`` of :func:`record_audit_pin`). Raises
    :class:`~kuangchao_core.perm.audit_pins.AuditPinError` or ``OSError`` when the log cannot be sealed."""
    audit = AuditLog(log_path, job_id, signer=signer)
    try:
        audit.append("audit_seal", actor="orchestrator", decision="info", resource=f"job:{job_id}", reason="job_end")
        audit.checkpoint()
    finally:
        audit.close()
    kid = signer[0]
    return record_audit_pin(run_dir, log_path, job_id, kid, public_key_raw, sealed=True, **pin_kwargs)


def register_seal(run_dir: str | os.PathLike, pin: partial) -> None:
    """Remember how the launch pins the job in ``run_dir``: ``pin`` is its ``partial`` of
    ``record_audit_pin(_or_log)(run_dir, log_path, job_id, audit_kid, public_key_raw, **kwargs)``."""
    _SEALS[_key(run_dir)] = pin


def seal_registered(run_dir: str | os.PathLike, signer: tuple[str, Ed25519PrivateKey] | None) -> AuditPin | None:
    """Seal the job of ``run_dir`` if a launch registered it (and forget it); errors are logged, never raised (this
    runs on the way out of the job). None when nothing was registered or sealing failed."""
    pin = _SEALS.pop(_key(run_dir), None)
    if pin is None or signer is None:
        return None
    run, log_path, job_id, _kid, public = pin.args[:5]
    kwargs = {
        k: v for k, v in pin.keywords.items() if k in ("mlflow_run_id", "tracking_uri", "mode", "pin_store", "hooks")
    }
    try:
        return seal_audit_log(run, log_path, job_id, signer, public_key_raw=public, **kwargs)
    except (AuditPinError, OSError) as exc:
        log.error("audit log %s not sealed: %s", log_path, exc)
        return None
