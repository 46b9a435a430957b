"""The store key of one multi-host attempt, handed to its nodes in a file (issue 38 item 2).

The orchestrator draws a fresh key for each multi-host attempt (node agents, Slurm) and writes it to
``<run_dir>/tokens/attempt_<n>.store_key`` (0600 in a 0700 directory, as the nodes' token bundles); the nodes'
launch settings carry only the file's path (``KC_STORE_KEY_FILE``), since Prefect stores a flow run's parameters and
Slurm its job's environment. Each node's launcher reads the key and hands it to torchrun by pipe
(:func:`~kuangchao_core.sched.store_gate.bind_env`), so no rank's environment holds it; the orchestrator removes the
file when the attempt ends.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

ENV_KEY_FILE = "KC_STORE_KEY_FILE"
_MAX = 256


def new_key() -> str:
    """A fresh per-job store key (hex, 256 bits)."""
    return secrets.token_hex(32)


def key_path(run_dir: str | os.PathLike, attempt: int) -> Path:
    """Where attempt ``attempt``'s store key lies."""
    return Path(run_dir) / "tokens" / f"attempt_{int(attempt)}.store_key"


def write_attempt_key(run_dir: str | os.PathLike, attempt: int) -> dict[str, str]:
    """Draw a fresh key for the attempt, write it (atomically, 0600) and return the nodes' setting naming it."""
    path = key_path(run_dir, attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_key() + "\n")
    os.replace(tmp, path)
    return {ENV_KEY_FILE: str(path.resolve())}


def drop_attempt_key(run_dir: str | os.PathLike, attempt: int) -> None:
    """Remove the attempt's key file (the attempt ended)."""
    key_path(run_dir, attempt).unlink(missing_ok=True)


def read_key_file(path: str) -> str:
    """The hex key in ``path``, read without following a link or waiting on a FIFO; ``ValueError`` naming the file
    when it is not a regular file of a key."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"{ENV_KEY_FILE} {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{ENV_KEY_FILE} {path} is not a regular file")
        text = f.read(_MAX).decode("ascii", "replace").strip()
    try:
        if len(bytes.fromhex(text)) < 16:
            raise ValueError
    except ValueError:
        raise ValueError(f"{ENV_KEY_FILE} {path} holds no store key") from None
    return text
