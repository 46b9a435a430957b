"""The job's global configuration: the few settings that may change while a job runs (L5.2, L5.4).

Storage: one JSON file per job (for example ``<run dir>/global_config.json``) shared by every process of the job
through the file system, chosen over the c10d store because it outlives the process group (an elastic restart keeps
the settings), needs no rendezvous to read, and works for processes outside the training group (the monitor, the
CLI). Layout: ``{"task", "version", "values", "updated"}``. Writers serialise on an ``flock`` of ``<file>.lock``,
write a temporary file in the same directory, ``fsync`` it and ``rename`` it over the old one (then ``fsync`` the
directory), so a reader sees either the old or the new version, never a torn one; ``version`` grows by one per change.

Permissions and signatures:

* ``set`` needs a signer: an operator key the job trusts (``kc config set``; see
  :mod:`kuangchao_core.perm.operator`) or the job's own authority (the initial values). Each version is a document
  signed by it (:mod:`kuangchao_core.perm.signed_doc`); a process without a signer (a worker) is refused
  (``PermissionDenied``), and the refusal audited. Every accepted change is appended to the job's audit log (action
  ``config_change``) with the signer, the key, the old and the new value and the new version; if that record cannot
  be written, the change is rolled back.
* Readers given the job's ``trust`` (its verified trust store — the trainer's case) apply a version only if it is
  signed by a trusted operator or the job's authority, names this job, is not older than the last version they
  accepted, and every value passes its validator; anything else — a direct write of the file, a copy of another
  job's file, a replayed old version, ``lr_scale: 1e12`` — is refused (``ConfigRefused``) and audited once per
  file version, and the job keeps its settings. A reader that starts late (a worker of a new attempt) starts from
  ``min_version``: the newest version the job's audit log records (:func:`newest_recorded_version`), so an older,
  correctly signed file copied back between attempts is a replay too.
* ``get`` / ``snapshot`` need a live capability token of any role (or ``permission.mode: trusted``). There is no
  read interface for the configuration, and every module must be able to follow the settings it runs under, so
  holding a verified, unexpired token of the job is the least privilege that still lets workers read; a process
  without a token (default deny) is refused and, when its guard has an audit log, audited.

Keys are an allow-list (:data:`DEFAULT_KEYS` plus ``extra_keys``), each with a validator that normalises the value
or raises ``ValueError``; an unknown key or a bad value is a ``ConfigError`` naming the key.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kuangchao_core import guard_api
from kuangchao_core.config.bounded_json import read_json_file
from kuangchao_core.errors import ConfigError, KuangchaoError, PermissionDenied
from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.signed_doc import DocumentRejected, document_signer, verify_document
from kuangchao_core.perm.tokens import PURPOSE_CAPABILITY, TrustStore

Validator = Callable[[Any], Any]
FORMAT_VERSION = 2
GLOBAL_CONFIG_TYP = "kuangchao/global-config"


class ConfigRefused(KuangchaoError):
    """A version of the global configuration that the job does not apply (unsigned, untrusted, invalid, stale)."""


_KEY = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")


def choice(*options: str) -> Validator:
    """A validator accepting one of ``options`` (upper-case strings; the value is upper-cased before comparing)."""

    def check(value):
        if not isinstance(value, str) or value.upper() not in options:
            raise ValueError(f"must be one of {list(options)}, not {value!r}")
        return value.upper()

    return check


def integer(minimum: int | None = None, maximum: int | None = None) -> Validator:
    """A validator accepting an int (not a bool) within ``[minimum, maximum]``."""

    def check(value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, not {value!r}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise ValueError(f"must be in [{minimum}, {maximum}], not {value}")
        return value

    return check


def number(minimum: float | None = None, maximum: float | None = None, *, exclusive_min: bool = False) -> Validator:
    """A validator accepting a finite int or float within the bounds; returns a float."""

    def check(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"must be a finite number, not {value!r}")
        value = float(value)
        low_bad = minimum is not None and (value <= minimum if exclusive_min else value < minimum)
        if low_bad or (maximum is not None and value > maximum):
            lo = "(" if exclusive_min else "["
            raise ValueError(f"must be in {lo}{minimum}, {maximum}], not {value}")
        return value

    return check


def scalar(value):
    """A validator accepting any JSON scalar (str up to 1024 chars, int, float, bool, None)."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, str) and len(value) <= 1024:
        return value
    raise ValueError(f"must be a JSON scalar (string <= 1024 chars, number, bool or null), not {value!r}")


#: the settings any job may change while it runs
DEFAULT_KEYS: dict[str, Validator] = {
    "log_level": choice("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    "checkpoint_interval": integer(1),
    "eval_interval": integer(1),
    "log_interval": integer(1),
    "lr_scale": number(0.0, 100.0, exclusive_min=True),
}


@dataclass(frozen=True)
class Snapshot:
    """One version of the global configuration as read from the file."""

    version: int
    values: dict[str, Any] = field(default_factory=dict)
    updated: dict[str, Any] = field(default_factory=dict)


def newest_recorded_version(audit_log: str | os.PathLike, task: str) -> int:
    """The newest version of task ``task``'s global configuration that the job's audit log ``audit_log`` records as
    accepted (``config_change`` records with decision ``allow`` on ``config:<task>``); 0 when it records none or the
    log does not exist."""
    from kuangchao_core.perm.audit_verify import read_records

    resource, newest = f"config:{task}", 0
    try:
        for rec in read_records(audit_log):
            if rec.get("action") != "config_change" or rec.get("decision") != "allow":
                continue
            version = rec.get("version")
            if rec.get("resource") == resource and isinstance(version, int) and not isinstance(version, bool):
                newest = max(newest, version)
    except FileNotFoundError:
        return 0
    return newest


class GlobalConfig:
    """The global configuration of job task ``task``, stored in ``path``.

    ``audit``: the job's audit log; defaults to the one the installed guard writes to. ``extra_keys``: more allowed
    keys (name -> validator, for example :func:`integer` or :func:`scalar`). ``trust``: verify every version read
    against it (see the module docstring); ``job_id``: the job the file must name (checked with ``trust``, written
    by ``set``). ``min_version``: the oldest version this reader may accept (a newer reader of a job that already
    recorded version N refuses anything older, see :func:`newest_recorded_version`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        task: str,
        *,
        audit: AuditLog | None = None,
        extra_keys: Mapping[str, Validator] | None = None,
        trust: TrustStore | None = None,
        job_id: str | None = None,
        min_version: int = 0,
    ):
        self.path = Path(path)
        self.task = task
        self.trust = trust
        self.job_id = job_id
        self._accepted = int(min_version)  # the newest version this reader accepted (an older one is a replay)
        self._refused_stamp: tuple | None = None
        self.resource = f"config:{task}"
        self.audit = audit
        self.keys: dict[str, Validator] = dict(DEFAULT_KEYS)
        bad = [
            (f"global_config.keys.{k}", "a key must match [a-z][a-z0-9_]{0,63}")
            for k in (extra_keys or {})
            if not _KEY.match(str(k))
        ]
        if bad:
            raise ConfigError(bad, str(self.path))
        self.keys.update(extra_keys or {})
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self._cache: tuple[tuple[int, int, int], Snapshot] | None = None

    # ------------------------------------------------------------------ reading
    def get(self, key: str, default: Any = None) -> Any:
        """The current value of ``key`` (``default`` if never set); needs a live token of any role."""
        self._require_token()
        self._known(key)
        return self._read().values.get(key, default)

    def snapshot(self) -> Snapshot:
        """The current version, values and last change; needs a live token of any role."""
        self._require_token()
        return self._read()

    @property
    def version(self) -> int:
        """The current version number (0 before the first change)."""
        return self.snapshot().version

    def _require_token(self) -> None:
        guard = guard_api.current_guard()
        if isinstance(guard, guard_api.AllowAll):
            return
        code = None
        if guard_api.current_token_id() is None:
            code = getattr(guard, "code", R.NO_TOKEN)
        elif getattr(guard, "expires_in", 1.0) <= 0:
            code = R.EXPIRED
        if code is None:
            return
        module = getattr(guard, "module_id", None)
        audit = getattr(guard, "audit", None)
        if audit is not None:
            audit.append(
                "config_read",
                actor=module or "?",
                decision="deny",
                resource=self.resource,
                reason=code,
                jti=guard_api.current_token_id() or "",
            )
        raise R.GuardDenied("config_read", self.resource, code, module)

    def _read(self) -> Snapshot:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return Snapshot(0)
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._cache is not None and self._cache[0] == stamp:
            return self._cache[1]
        snap = self._load()
        self._cache = (stamp, snap)
        return snap

    def _load(self) -> Snapshot:
        try:
            data = read_json_file(self.path)
        except FileNotFoundError:
            return Snapshot(0)
        except (OSError, ValueError) as exc:
            raise KuangchaoError(
                f"global config {self.path} is unreadable ({exc}); restore it from the audit log's config_change "
                "records or delete it to start from the defaults"
            ) from None
        if self.trust is not None:
            return self._verified(data)
        if isinstance(data, dict) and isinstance(data.get("body"), dict) and "sig" in data:
            data = data["body"]
        return self._snapshot_of(data)

    def _snapshot_of(self, data: Any) -> Snapshot:
        if not isinstance(data, dict) or data.get("task") != self.task or not isinstance(data.get("values"), dict):
            raise KuangchaoError(
                f"global config {self.path} does not belong to task {self.task!r} (found task "
                f"{data.get('task') if isinstance(data, dict) else None!r}); point GlobalConfig at this job's file"
            )
        return Snapshot(int(data.get("version", 0)), dict(data["values"]), dict(data.get("updated") or {}))

    def _signer_public(self, kid: str | None) -> bytes | None:
        public = self.trust.operator_public(kid)
        if public is None and kid in self.trust.keys:
            k = self.trust.keys[kid]
            if k.purpose == PURPOSE_CAPABILITY and k.status != "revoked":
                public = k.public
        return public

    def _verified(self, data: Any) -> Snapshot:
        try:
            kid = document_signer(data)
            public = self._signer_public(kid)
            if public is None:
                raise DocumentRejected(
                    str(self.path), "unsigned" if kid is None else f"signer {kid} is not trusted by this job"
                )
            body = verify_document(data, GLOBAL_CONFIG_TYP, public, where=str(self.path))
            snap = self._snapshot_of(body)
            if self.job_id is not None and body.get("job_id") != self.job_id:
                raise DocumentRejected(str(self.path), f"written for job {body.get('job_id')!r}, not {self.job_id!r}")
            if snap.version < self._accepted:
                raise DocumentRejected(
                    str(self.path),
                    f"version {snap.version} is older than {self._accepted}, the newest this job has accepted or "
                    "recorded (a rolled-back file)",
                )
            for key, value in snap.values.items():
                if key not in self.keys:
                    raise DocumentRejected(str(self.path), f"{key!r} is not a changeable setting")
                try:
                    snap.values[key] = self.keys[key](value)
                except ValueError as exc:
                    raise DocumentRejected(str(self.path), f"global_config.{key}: {exc}") from None
        except (DocumentRejected, KuangchaoError) as exc:
            self._audit_refusal(str(exc))
            raise ConfigRefused(f"global config refused, settings unchanged: {exc}") from None
        self._accepted = snap.version
        return snap

    def _audit_refusal(self, why: str) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp is not None and stamp == self._refused_stamp:
            return  # this version was already refused and recorded
        self._refused_stamp = stamp
        guard = guard_api.current_guard()
        audit = self.audit or getattr(guard, "audit", None)
        if audit is not None:
            audit.append(
                "config_change",
                actor=getattr(guard, "module_id", None) or "reader",
                decision="deny",
                resource=self.resource,
                reason=why[:300],
                jti=guard_api.current_token_id() or "",
            )

    # ------------------------------------------------------------------ writing
    def set(self, key: str, value: Any, *, signer: Any = None) -> int:
        """Change ``key`` to ``value`` for the whole job and return the new version.

        ``signer``: an :class:`~kuangchao_core.perm.operator.OperatorKey` the job trusts, or the job's
        :class:`~kuangchao_core.perm.authority.Authority` (anything with ``sign(typ, body)`` and ``actor``); without
        one the change is refused (``PermissionDenied``) and the refusal audited — except in trusted mode (an
        ``AllowAll`` guard), where the version is written unsigned. The change is recorded in the
        audit log with its signer. Setting a key to its current value changes nothing and returns the current
        version.
        """
        trusted_mode = isinstance(guard_api.current_guard(), guard_api.AllowAll)
        if signer is None and not trusted_mode:
            guard = guard_api.current_guard()
            audit = self.audit or getattr(guard, "audit", None)
            if audit is not None:
                audit.append(
                    "config_write",
                    actor=getattr(guard, "module_id", None) or "unknown",
                    decision="deny",
                    resource=self.resource,
                    reason="unsigned",
                    jti=guard_api.current_token_id() or "",
                )
            raise PermissionDenied(
                "config_write",
                self.resource,
                "a change must be signed by an operator key the job trusts (kc config set)",
            )
        self._known(key)
        try:
            value = self.keys[key](value)
        except ValueError as exc:
            raise ConfigError([(f"global_config.{key}", str(exc))], str(self.path)) from None
        guard = guard_api.current_guard()
        audit = self.audit or getattr(guard, "audit", None)
        if audit is None:
            raise KuangchaoError(
                f"cannot change global config {key!r} of task {self.task!r}: no audit log to record the change in; "
                "install the worker guard with permission.audit_log set or pass audit=AuditLog(...)"
            )
        actor = str(getattr(signer, "actor", "orchestrator")) if signer is not None else "trusted"
        kid = str(getattr(signer, "kid", None) or getattr(signer, "active_kid", "")) if signer is not None else ""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                current = self._load()
                missing = object()
                old = current.values.get(key, missing)
                if old is not missing and old == value and type(old) is type(value):
                    return current.version
                values = {**current.values, key: value}
                version = current.version + 1
                updated = {"key": key, "signer": kid, "actor": actor, "ts": time.time()}
                body = {
                    "format": FORMAT_VERSION,
                    "task": self.task,
                    "job_id": self.job_id or "",
                    "version": version,
                    "values": values,
                    "updated": updated,
                }
                previous_raw = self.path.read_bytes() if self.path.exists() else None
                self._write(signer.sign(GLOBAL_CONFIG_TYP, body) if signer is not None else body)
                try:
                    audit.append(
                        "config_change",
                        actor=actor,
                        decision="allow",
                        resource=self.resource,
                        reason=f"set {key}",
                        jti="",
                        signer=kid,
                        key=key,
                        old=None if old is missing else old,
                        new=value,
                        version=version,
                    )
                except BaseException:  # an unrecorded change must not stay in force
                    if previous_raw is not None:
                        self._write_raw(previous_raw)
                    else:
                        self.path.unlink(missing_ok=True)
                    raise
                return version
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _known(self, key: str) -> None:
        if key not in self.keys:
            raise ConfigError(
                [(f"global_config.{key}", f"not a changeable setting; allowed: {sorted(self.keys)}")], str(self.path)
            )

    def _write(self, doc: dict) -> None:
        self._write_raw(json.dumps(doc, sort_keys=True).encode())

    def _write_raw(self, raw: bytes) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
