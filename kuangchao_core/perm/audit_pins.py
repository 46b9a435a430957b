"""Audit trust pinned outside the log's directory (issue 16).

A :class:`AuditPin` names the audit key that signs a job's checkpoints (its id and the SHA-256 fingerprint of the
raw public key), the job, the log (path and id) and the head of the chain (last seq and hash) at the time the
orchestrator pinned it. The workers write the log, its ``.anchors`` and ``.trust.json`` side by side, so none of
those can vouch for the others against someone with the workers' uid; pins are kept where the workers do not write:

- ``<run_dir>/authority/audit_pins.json`` (directory 0700, file 0600, every pin of the run, append-only);
- the job's MLflow run: tag ``kuangchao.audit_pin`` (the latest pin) and artifact ``audit/pins.json`` (all);
- a Prefect artifact ``kc-audit-pin`` of the flow run;
- an append-only pin store when the job names one (:mod:`~kuangchao_core.perm.pin_store`).

A pin carries the raw public audit key, so checkpoints verify against the pin and never against a trust store in
the run directory; ``run_dir`` names the run it belongs to, so ``kc audit --run`` finds it outside the run
(:mod:`~kuangchao_core.perm.audit_external`); ``sealed`` marks the job's last pin, after which no record may follow
(:mod:`~kuangchao_core.perm.audit_seal`). Only the copies outside the run count as trust: the authority file is in
the run directory, which a worker's uid can rewrite, and is only compared with them.

:func:`record_audit_pin` writes them all (the orchestrator calls it when a launch starts and after the final signed
checkpoint; :func:`record_audit_pin_or_log` on shutdown paths); :mod:`~kuangchao_core.perm.pin_check` says how a
verified log disagrees with them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kuangchao_core.config.bounded_json import read_json_file
from kuangchao_core.errors import KuangchaoError
from kuangchao_core.obs.run_hooks import NO_HOOKS, RunHooks
from kuangchao_core.perm.audit_chain import genesis_hash, utc_now_iso
from kuangchao_core.perm.audit_verify import read_head
from kuangchao_core.perm.pin_store import append_pin
from kuangchao_core.perm.tokens import b64d, b64e

log = logging.getLogger("kuangchao.perm.audit_pins")

PINS_FILE = "audit_pins.json"
PIN_VERSION = 1
MLFLOW_PIN_TAG = "kuangchao.audit_pin"
MLFLOW_PINS_ARTIFACT = "audit/pins.json"
PREFECT_PIN_KEY = "kc-audit-pin"


class AuditPinError(KuangchaoError):
    """A pin cannot be made (the log is missing or another job's) or a pins file is unreadable."""


def key_fingerprint(public_key_raw: bytes) -> str:
    """SHA-256 (hex) of a raw 32-byte Ed25519 public key."""
    return hashlib.sha256(bytes(public_key_raw)).hexdigest()


@dataclass(frozen=True)
class AuditPin:
    """What the orchestrator vouches for about one job's audit log at one moment (see module docstring)."""

    job_id: str
    log_id: str
    log_path: str
    seq: int
    head_hash: str
    audit_kid: str
    audit_key_fp: str
    mode: str | None = None
    pinned_at: str = ""
    v: int = PIN_VERSION
    run_dir: str = ""  # the run directory (resolved): how `kc audit --run` finds the pins kept outside it
    audit_key: str = ""  # the raw public audit key (base64url): checkpoints verify against the pin, not the run
    sealed: bool = False  # the job's last act: no record may follow ``seq``

    def to_json(self) -> dict:
        """The pin as a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> AuditPin:
        """Parse one pin; ``ValueError`` naming the field when it is malformed."""
        if not isinstance(data, dict):
            raise ValueError("a pin is not a JSON object")
        strings = ("job_id", "log_id", "log_path", "head_hash", "audit_kid", "audit_key_fp")
        for name in strings:
            if not isinstance(data.get(name), str) or not data[name]:
                raise ValueError(f"pin field {name!r} is missing or not a string")
        if not isinstance(data.get("seq"), int) or isinstance(data["seq"], bool) or data["seq"] < 0:
            raise ValueError("pin field 'seq' is not a non-negative integer")
        if data.get("mode") not in (None, "enforcing", "trusted"):
            raise ValueError("pin field 'mode' is not enforcing or trusted")
        for name in ("run_dir", "audit_key"):
            if not isinstance(data.get(name, ""), str):
                raise ValueError(f"pin field {name!r} is not a string")
        if not isinstance(data.get("sealed", False), bool):
            raise ValueError("pin field 'sealed' is not a boolean")
        if data.get("audit_key") and key_fingerprint(_public_of(data["audit_key"])) != data["audit_key_fp"]:
            raise ValueError("pin field 'audit_key' does not have the pinned fingerprint")
        return cls(
            **{n: data[n] for n in strings},
            seq=data["seq"],
            mode=data.get("mode"),
            pinned_at=str(data.get("pinned_at", "")),
            v=int(data.get("v", PIN_VERSION)),
            run_dir=data.get("run_dir", ""),
            audit_key=data.get("audit_key", ""),
            sealed=data.get("sealed", False),
        )

    def public_key(self) -> bytes | None:
        """The pinned raw public audit key (None for a pin that names only its fingerprint)."""
        return _public_of(self.audit_key) if self.audit_key else None


def _public_of(text: str) -> bytes:
    try:
        raw = b64d(text)
    except (ValueError, TypeError):
        raise ValueError("pin field 'audit_key' is not base64url") from None
    if len(raw) != 32:
        raise ValueError("pin field 'audit_key' is not a 32-byte Ed25519 public key")
    return raw


def pin_of(
    log_path: str | os.PathLike,
    job_id: str,
    audit_kid: str,
    public_key_raw: bytes,
    *,
    mode: str | None = None,
    run_dir: str | os.PathLike | None = None,
    sealed: bool = False,
) -> AuditPin:
    """The pin of ``log_path`` as it is now: its head (last complete record) and the audit key that signs it.

    ``run_dir``: the job's run directory (named in the pin); ``sealed``: this is the job's last pin (see
    :mod:`~kuangchao_core.perm.audit_seal`). Raises :class:`AuditPinError` if the log is missing, its last record unreadable, or it belongs to another job.
    """
    path = Path(log_path)
    try:
        seq, head, owner = read_head(path)
    except FileNotFoundError:
        raise AuditPinError(f"cannot pin audit log {path}: it does not exist") from None
    except ValueError as exc:
        raise AuditPinError(f"cannot pin audit log {path}: its last record is unreadable ({exc})") from None
    if seq and owner != job_id:
        raise AuditPinError(f"cannot pin audit log {path}: it belongs to job {owner!r}, not {job_id!r}")
    return AuditPin(
        job_id=job_id,
        log_id=job_id,
        log_path=str(path.resolve()),
        seq=seq,
        head_hash=head if seq else genesis_hash(job_id),
        audit_kid=audit_kid,
        audit_key_fp=key_fingerprint(public_key_raw),
        mode=mode,
        pinned_at=utc_now_iso(),
        run_dir=str(Path(run_dir).resolve()) if run_dir else "",
        audit_key=b64e(bytes(public_key_raw)),
        sealed=sealed,
    )


# ---------------------------------------------------------------------------------------------- the authority file


def pins_path(authority_dir: str | os.PathLike) -> Path:
    """Where the pins of a run live: ``<authority_dir>/audit_pins.json``."""
    return Path(authority_dir) / PINS_FILE


def load_pins_file(path: str | os.PathLike) -> list[AuditPin]:
    """The pins in ``path``: a pins file (``{"version", "pins": [...]}``), a list of pins or one pin (e.g. the
    MLflow tag's value saved to a file). Missing file: ``[]``; malformed: :class:`AuditPinError`."""
    path = Path(path)
    try:
        data = read_json_file(path)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise AuditPinError(f"audit pins {path} are unreadable: {exc}") from None
    items = data.get("pins") if isinstance(data, dict) and "pins" in data else data
    items = items if isinstance(items, list) else [items]
    try:
        return [AuditPin.from_json(item) for item in items]
    except ValueError as exc:
        raise AuditPinError(f"audit pins {path} are malformed: {exc}") from None


def load_pins(authority_dir: str | os.PathLike) -> list[AuditPin]:
    """Every pin recorded in ``<authority_dir>/audit_pins.json``, oldest first (``[]`` when there is none)."""
    return load_pins_file(pins_path(authority_dir))


def save_pin(authority_dir: str | os.PathLike, pin: AuditPin) -> Path:
    """Add ``pin`` to ``<authority_dir>/audit_pins.json`` (atomic rewrite, file 0600, directory 0700).

    Pins are only ever added: an earlier head stays, so a log cut back and regrown still disagrees with it.
    """
    directory = Path(authority_dir)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    path = pins_path(directory)
    lock_fd = os.open(directory / f".{PINS_FILE}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        pins = load_pins_file(path)
        behind = [p for p in pins if p.log_id == pin.log_id and p.seq > pin.seq]
        if behind:
            log.error(
                "audit log %s: head seq %d is behind the pinned seq %d; it was cut back since it was pinned",
                pin.log_path,
                pin.seq,
                behind[-1].seq,
            )
        if not any(_same_state(p, pin) for p in pins):
            pins.append(pin)
        body = json.dumps({"version": PIN_VERSION, "pins": [p.to_json() for p in pins]}, indent=1, sort_keys=True)
        tmp = directory / f".{PINS_FILE}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        os.close(lock_fd)
    return path


def _same_state(a: AuditPin, b: AuditPin) -> bool:
    fields = ("log_id", "seq", "head_hash", "audit_kid", "audit_key_fp", "mode", "sealed")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


# ---------------------------------------------------------------------------------------------- recording


def record_audit_pin(
    run_dir: str | os.PathLike,
    log_path: str | os.PathLike,
    job_id: str,
    audit_kid: str,
    public_key_raw: bytes,
    *,
    mlflow_run_id: str | None = None,
    tracking_uri: str | None = None,
    mode: str | None = None,
    sealed: bool = False,
    pin_store: str | None = None,
    hooks: RunHooks = NO_HOOKS,
) -> AuditPin:
    """Pin the job's audit log now: into ``<run_dir>/authority/audit_pins.json``, the append-only ``pin_store``
    (:mod:`~kuangchao_core.perm.pin_store`) when one is given, the MLflow run ``mlflow_run_id`` (at
    ``tracking_uri``, else ``$KC_TRACKING_URI`` / ``$MLFLOW_TRACKING_URI``) and the current Prefect flow run (an
    artifact made through ``hooks``, the orchestrator's, inside a run only).

    MLflow or Prefect being unavailable costs a warning, never the pin in the authority file. Raises
    :class:`AuditPinError` (nothing written) if the log cannot be pinned (missing, unreadable, another job's), and
    ``PinStoreError`` (an ``OSError``) when the configured pin store cannot take it.
    """
    pin = pin_of(log_path, job_id, audit_kid, public_key_raw, mode=mode, run_dir=run_dir, sealed=sealed)
    authority_dir = Path(run_dir) / "authority"
    save_pin(authority_dir, pin)
    if pin_store:
        append_pin(pin_store, pin.to_json())
    if mlflow_run_id:
        try:
            _publish_mlflow(
                pin, [p for p in load_pins(authority_dir) if p.job_id == job_id], mlflow_run_id, tracking_uri
            )
        except Exception as exc:  # MLflow down or absent: the authority file still holds the pin
            log.warning("audit pin not recorded in MLflow run %s (%s); it is in %s", mlflow_run_id, exc, authority_dir)
    try:
        _publish_prefect(pin, hooks)
    except Exception as exc:
        log.warning("audit pin not recorded as a Prefect artifact (%s); it is in %s", exc, authority_dir)
    return pin


def record_audit_pin_or_log(*args, **kwargs) -> AuditPin | None:
    """:func:`record_audit_pin` for shutdown paths (an ``ExitStack`` callback, ``RenewalServer.stop``): a log that
    cannot be pinned, or an authority directory that cannot be written, is logged as an error and gives None
    instead of raising over the exception that may be unwinding."""
    try:
        return record_audit_pin(*args, **kwargs)
    except (AuditPinError, OSError) as exc:
        log.error("audit log not pinned: %s", exc)
        return None


def _publish_mlflow(pin: AuditPin, pins: list[AuditPin], run_id: str, tracking_uri: str | None) -> None:
    from kuangchao_core.obs.tracking_store import StoreClient  # a store failure in one line (issue 38 item 8)

    uri = tracking_uri or os.environ.get("KC_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI")
    client = StoreClient(uri or "sqlite:///mlflow.db")
    client.set_tag(run_id, MLFLOW_PIN_TAG, json.dumps(pin.to_json(), sort_keys=True, separators=(",", ":")))
    client.log_dict(run_id, {"version": PIN_VERSION, "pins": [p.to_json() for p in pins]}, MLFLOW_PINS_ARTIFACT)


def _publish_prefect(pin: AuditPin, hooks: RunHooks) -> None:
    if not hooks.in_run():
        return  # not inside a flow run: nothing to attach it to
    body = json.dumps(pin.to_json(), indent=1, sort_keys=True)
    hooks.artifact(
        (
            f"Audit log `{pin.log_path}` of job `{pin.job_id}` pinned at seq {pin.seq}; "
            f"audit key `{pin.audit_kid}` (sha256 `{pin.audit_key_fp}`). Save the JSON to a file and check the "
            f"log with `kc audit --verify --run RUN_DIR --pins FILE`.\n\n```json\n{body}\n```\n"
        ),
        PREFECT_PIN_KEY,
        "Audit trust pinned outside the log's directory",
    )
