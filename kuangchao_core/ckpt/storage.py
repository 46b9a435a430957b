"""Where checkpoint files live: a small storage interface and its local-disk implementation.

Keys are ``/``-separated paths relative to the storage root (``task/step_00000010/manifest.json``).
The writer and reader only talk to a :class:`Storage`, so another backend (S3, in ``ckpt/s3.py``) can be
plugged in. Every write is durable and atomic: it lands under a temporary name, is flushed and fsynced,
and is then renamed over its final key, so a reader never sees half a file.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from kuangchao_core.errors import CheckpointError

_CHUNK = 1 << 20


class Storage(ABC):
    """The operations the checkpoint writer, reader and retention need from a place that holds files."""

    @abstractmethod
    def write_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` atomically and durably (temp name, fsync, rename)."""

    @abstractmethod
    def write_with(self, key: str, fill: Callable[[Path], None]) -> None:
        """Store the file that ``fill(local_path)`` writes, atomically and durably.

        ``fill`` receives a local temporary path to write to (for writers that want a file name, such as
        ``safetensors.torch.save_file``).
        """

    @abstractmethod
    def open_read(self, key: str) -> BinaryIO:
        """Open ``key`` for binary reading; raises FileNotFoundError when it does not exist."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a file or directory exists at ``key``."""

    @abstractmethod
    def is_dir(self, key: str) -> bool:
        """Whether ``key`` is a directory (a prefix holding files)."""

    @abstractmethod
    def list_dir(self, key: str) -> list[str]:
        """Names (not keys) of the direct children of directory ``key``, sorted; [] if it does not exist."""

    @abstractmethod
    def list_files(self, key: str) -> list[str]:
        """Every file below directory ``key``, as ``/``-separated paths relative to ``key``, sorted."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes of the file at ``key``."""

    @abstractmethod
    def mtime(self, key: str) -> float:
        """Last modification time (seconds since the epoch) of ``key``."""

    @abstractmethod
    def make_dir(self, key: str) -> None:
        """Create directory ``key`` (and parents); durable once this returns."""

    @abstractmethod
    def rename_dir(self, src: str, dst: str) -> None:
        """Move directory ``src`` to ``dst`` atomically; fails when ``dst`` exists. Durable once this returns."""

    @abstractmethod
    def remove_tree(self, key: str) -> None:
        """Delete directory ``key`` and everything below it (no error if it is already gone)."""

    @abstractmethod
    def sync_dir(self, key: str) -> None:
        """Make the entries of directory ``key`` durable (fsync on local disks; a no-op where meaningless)."""

    def local_path(self, key: str) -> Path | None:
        """A local file-system path for ``key`` when the storage has one (enables memory-mapped loads)."""
        return None

    def read_bytes(self, key: str) -> bytes:
        """The whole content of ``key``."""
        with self.open_read(key) as f:
            return f.read()

    def sha256(self, key: str) -> str:
        """Hex sha256 of the file at ``key``, read in chunks."""
        h = hashlib.sha256()
        with self.open_read(key) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskFull(CheckpointError):
    """A checkpoint write found no space (ENOSPC) or no quota (EDQUOT) left: deterministic, never retried."""


def _full_disk(exc: BaseException, path: Path) -> DiskFull | None:
    """``DiskFull`` for an OSError with ENOSPC/EDQUOT, or a serializer's error wrapping one (safetensors reports
    ``IoError(Os { code: 28, kind: StorageFull, .. })``); None otherwise."""
    if isinstance(exc, OSError):
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return None
    elif not any(s in str(exc) for s in ("StorageFull", "QuotaExceeded", "No space left on device")):
        return None
    return DiskFull(
        f"{path}: {getattr(exc, 'strerror', None) or 'no space left on device'}; free space there or point checkpoint.dir at a larger "
        "file system (the last published checkpoint is kept)"
    )


@contextmanager
def _tmp_removed_on_error(tmp: Path, final: Path) -> Iterator[None]:
    """Remove ``tmp`` when the body fails; a full disk is raised as :class:`DiskFull`."""
    try:
        yield
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        full = _full_disk(exc, final) if isinstance(exc, Exception) else None
        if full is not None:
            raise full from None
        raise


class LocalStorage(Storage):
    """Files on a local (or shared, POSIX) file system below ``root``."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """The file-system path of ``key``."""
        if key in ("", "."):
            return self.root
        parts = key.split("/")
        if any(p in ("", "..") for p in parts) or key.startswith("/"):
            raise CheckpointError(f"storage key {key!r} is not a plain relative path; use names below {self.root}")
        return self.root.joinpath(*parts)

    def local_path(self, key: str) -> Path | None:
        return self.path(key)

    def _tmp_for(self, final: Path) -> Path:
        return final.with_name(f".{final.name}.tmp-{os.getpid()}")

    def _commit_file(self, tmp: Path, final: Path) -> None:
        _fsync_path(tmp)
        os.replace(tmp, final)
        _fsync_path(final.parent, directory=True)

    def write_bytes(self, key: str, data: bytes) -> None:
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp_for(final)
        with _tmp_removed_on_error(tmp, final):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        _fsync_path(final.parent, directory=True)

    def write_with(self, key: str, fill: Callable[[Path], None]) -> None:
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp_for(final)
        with _tmp_removed_on_error(tmp, final):
            fill(tmp)
            self._commit_file(tmp, final)

    def open_read(self, key: str) -> BinaryIO:
        return open(self.path(key), "rb")

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def is_dir(self, key: str) -> bool:
        return self.path(key).is_dir()

    def list_dir(self, key: str) -> list[str]:
        p = self.path(key)
        return sorted(os.listdir(p)) if p.is_dir() else []

    def list_files(self, key: str) -> list[str]:
        base = self.path(key)
        out = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                out.append(Path(dirpath, name).relative_to(base).as_posix())
        return sorted(out)

    def size(self, key: str) -> int:
        return self.path(key).stat().st_size

    def mtime(self, key: str) -> float:
        return self.path(key).stat().st_mtime

    def make_dir(self, key: str) -> None:
        p = self.path(key)
        missing = [q for q in [p, *p.parents] if not q.exists()]
        p.mkdir(parents=True, exist_ok=True)
        for q in missing:
            _fsync_path(q.parent, directory=True)

    def rename_dir(self, src: str, dst: str) -> None:
        s, d = self.path(src), self.path(dst)
        if d.exists():
            raise CheckpointError(f"cannot rename {s} to {d}: the destination exists; move it away first")
        os.rename(s, d)
        _fsync_path(d.parent, directory=True)
        if s.parent != d.parent:
            _fsync_path(s.parent, directory=True)

    def remove_tree(self, key: str) -> None:
        p = self.path(key)
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
        if p.parent.exists():
            _fsync_path(p.parent, directory=True)

    def sync_dir(self, key: str) -> None:
        _fsync_path(self.path(key), directory=True)
