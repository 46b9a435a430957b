"""An append-only audit pin store: pins a worker with the job's files and uid can add to but never remove (issue 38).

The MLflow store and the run's ``authority/audit_pins.json`` are files of the uid the job runs as; a worker of that
uid can rewrite them and re-seal a cut log there. A pin store is a directory holding ``pins.jsonl``, one pin per
line, which the kernel keeps append-only (``chattr +a``, ``FS_APPEND_FL``): its owner may append, but neither
truncate, overwrite, rename nor delete it. Setting the flag needs ``CAP_LINUX_IMMUTABLE`` (root), so an operator
creates the store once (``kc operator pin-store DIR --owner USER``, root-owned directory, file owned by the jobs'
uid) and jobs name it in ``permission.pin_store`` (or ``$KC_AUDIT_PIN_STORE``); ``kc audit --verify`` reads it with
``--pin-store`` (default ``$KC_AUDIT_PIN_STORE``).

A worker can still append forged pins. That cannot make a log verify: every pin of a job must agree with its log
(:func:`~kuangchao_core.perm.pin_check.verify_against_pins`), so a job's real sealed pin keeps failing a cut or
rewritten log, and an added pin only adds disagreement. Each line is read with the bounded JSON reader; a line that
cannot be read is a note that voids only itself.
"""

from __future__ import annotations

import array
import fcntl
import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from kuangchao_core.config.bounded_json import loads_bounded
from kuangchao_core.errors import KuangchaoError

log = logging.getLogger("kuangchao.perm.pin_store")
PIN_STORE_ENV = "KC_AUDIT_PIN_STORE"
PIN_STORE_FILE = "pins.jsonl"
#: the longest pin line read (a pin is about 700 bytes)
MAX_LINE = 1 << 16
#: the most lines read from one store
MAX_LINES = 1_000_000
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_APPEND_FL = 0x00000020


class PinStoreError(KuangchaoError, OSError):
    """A pin store that is missing, not a regular file or cannot be appended to (an ``OSError`` too, so a shutdown
    path that logs an unwritable authority directory logs this the same way)."""


def store_file(directory: str | os.PathLike) -> Path:
    """The pins file of the store in ``directory``."""
    return Path(directory) / PIN_STORE_FILE


def configured_store(setting: str | None) -> str | None:
    """The pin store a job publishes to: ``permission.pin_store``, else ``$KC_AUDIT_PIN_STORE``, else None."""
    return setting or os.environ.get(PIN_STORE_ENV) or None


def _flags(fd: int) -> int:
    buf = array.array("l", [0])
    fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf, True)
    return buf[0]


def is_append_only(path: str | os.PathLike) -> bool:
    """Whether the kernel keeps ``path`` append-only (``FS_APPEND_FL``); False where the file system cannot say."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return bool(_flags(fd) & _FS_APPEND_FL)
    except OSError:
        return False
    finally:
        os.close(fd)


def init_store(directory: str | os.PathLike, owner_uid: int | None = None) -> Path:
    """Create the store in ``directory`` (mode 0755; its ``pins.jsonl`` 0644, owned by ``owner_uid`` when given) and
    make the file append-only. Raises :class:`PinStoreError` naming what failed (not root: no
    ``CAP_LINUX_IMMUTABLE``; a file system without the flag)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o755)
    path = store_file(directory)
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        if owner_uid is not None:
            os.fchown(fd, owner_uid, -1)
        os.fchmod(fd, 0o644)
        flags = array.array("l", [_flags(fd) | _FS_APPEND_FL])
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, flags, True)
    except OSError as exc:
        raise PinStoreError(
            f"{path}: cannot be made append-only ({exc.strerror}): run this as root (CAP_LINUX_IMMUTABLE) on a file "
            "system that keeps the flag (ext4, xfs, btrfs)"
        ) from None
    finally:
        os.close(fd)
    return path


def check_store(directory: str | os.PathLike, field: str = "permission.pin_store") -> list[str]:
    """Before a job starts: the store must exist as a regular file this process can append to (raises
    :class:`PinStoreError` naming ``field``). Returns warnings (not append-only: a worker of the job's uid could
    rewrite it)."""
    path = store_file(directory)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        raise PinStoreError(
            f"{field}: {path}: {exc.strerror}; create the store with `kc operator pin-store {directory} --owner USER` "
            "(as root)"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise PinStoreError(f"{field}: {path} is not a regular file")
    if not os.access(path, os.W_OK):
        raise PinStoreError(
            f"{field}: {path} cannot be written by uid {os.getuid()}; the store's owner must be the job's"
        )
    warnings = []
    if not is_append_only(path):
        warnings.append(
            f"{field}: {path} is not append-only: a process with the job's uid can rewrite its pins; "
            f"run `kc operator pin-store {directory} --owner USER` as root (chattr +a)"
        )
    store_dir = Path(directory).resolve()
    for place in (store_dir, store_dir.parent):
        if os.access(place, os.W_OK) and os.getuid() != 0:
            warnings.append(
                f"{field}: uid {os.getuid()} may write {place}, so a process with the job's uid can put another "
                "store in this one's place; the store's directory and its parent belong to another user (root)"
            )
            break
    return warnings


def checked_pin_store(setting: str | None) -> str | None:
    """The store a job publishes its pins to (:func:`configured_store`), checked by :func:`check_store` before the
    job's first pin (its warnings logged); None when no store is configured."""
    store = configured_store(setting)
    if store:
        for warning in check_store(store):
            log.warning(warning)
    return store


def append_pin(directory: str | os.PathLike, pin_json: dict) -> Path:
    """Append one pin (its JSON form) as one line, in one ``write``, then fsync. Never creates the file: a store
    that is not there is :class:`PinStoreError`."""
    path = store_file(directory)
    line = (json.dumps(pin_json, sort_keys=True, separators=(",", ":")) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise PinStoreError(f"audit pin store {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PinStoreError(f"audit pin store {path} is not a regular file")
        if os.write(fd, line) != len(line):
            raise PinStoreError(f"audit pin store {path}: a short write")
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def read_store(directory: str | os.PathLike) -> Iterator[tuple[int, dict | None, str]]:
    """Each line of the store as ``(line number, pin JSON or None, why not)``, read bounded: a line over
    :data:`MAX_LINE` bytes or not bounded JSON gives None and the reason. Raises ``OSError`` when the file cannot be
    opened (a FIFO or link is refused, never waited on)."""
    path = store_file(directory)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        for number in range(1, MAX_LINES + 1):
            raw = f.readline(MAX_LINE + 1)
            if not raw:
                return
            if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # skip the rest of the long line
                    raw = f.readline(MAX_LINE)
                yield number, None, f"longer than {MAX_LINE} bytes"
                continue
            if not raw.strip():
                continue
            try:
                yield number, loads_bounded(raw, where=f"{path}:{number}"), ""
            except ValueError as exc:
                yield number, None, str(exc)
