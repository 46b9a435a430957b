"""One writer per lineage: a fenced lease (owner + generation) in ``<lineage>/owner.json``.

A run that plans to write a lineage takes its lease (:func:`take_lease`): the generation goes up by one and the
record names the run. The orchestrator renews it while the job lives (:class:`LeaseKeeper`); every checkpoint
write and retention pass checks it (:func:`check_writer`) with the generation the writer was started with, so a
writer from an older generation — ranks that outlived their orchestrator, a job resumed twice — is refused before
it publishes or deletes a step. A run that finds the lease held by a live owner (renewed within ``stale_after_s``)
waits for it to go stale and then takes it over, or, when it stays alive, does not write that lineage
(:class:`LeaseHeld`; the flow forks a new lineage from the same step and says so).

``owner.json``::

    {"lineage": ..., "owner": <job/flow-run id>, "generation": 3, "host": ..., "pid": ...,
     "taken_ns": ..., "renewed_ns": ...}

Changes happen under ``owner.json.lock`` (created exclusively; a lock older than ``_LOCK_STALE_S`` is a crashed
taker's and is removed) and are written atomically (temporary file + rename).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kuangchao_core.ckpt.layout import LOGGER_NAME
from kuangchao_core.errors import CheckpointError

logger = logging.getLogger(LOGGER_NAME)

LEASE_FILE = "owner.json"
#: the environment variable that hands the workers their lineage generation
ENV_GENERATION = "KC_CKPT_LINEAGE_GENERATION"
RENEW_S = 2.0
STALE_AFTER_S = 12.0
WAIT_S = 30.0
_LOCK_STALE_S = 10.0
_MAX_BYTES = 64 * 1024
#: how far in the future a renewal may lie (clocks of the hosts sharing the lineage disagree a little) before it is a
#: clock fault rather than a live holder
CLOCK_SKEW_S = 5.0


class StaleWriter(CheckpointError):
    """A checkpoint write or retention pass by a writer that no longer holds its lineage's lease."""


class LeaseClockFault(CheckpointError):
    """The lease was renewed in the future: a clock jumped (here or on the holder's host); nobody can tell whether
    the holder is alive."""


class LeaseHeld(CheckpointError):
    """The lineage's lease is held by another run that is still alive."""

    def __init__(self, lineage: str, record: dict[str, Any], age_s: float):
        self.lineage, self.record, self.age_s = lineage, record, age_s
        super().__init__(
            f"lineage {lineage} is being written by run {record.get('owner')} (generation {record.get('generation')}, "
            f"pid {record.get('pid')} on {record.get('host')}, renewed {age_s:.1f} s ago)"
        )


@dataclass(frozen=True)
class Lease:
    """This run's hold on a lineage: its directory, owner id and generation."""

    path: Path
    owner: str
    generation: int

    @property
    def lineage(self) -> str:
        """The lineage's name (its directory's)."""
        return self.path.name


def read_lease(lineage_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The lease record of a lineage; None when it has none. A record that cannot be read is an error: a writer
    must not guess who owns a lineage."""
    path = Path(lineage_dir) / LEASE_FILE
    try:  # never follows a symlink, never blocks on a FIFO, reads at most _MAX_BYTES + 1
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        hint = " (a symbolic link: refused)" if path.is_symlink() else ""
        raise CheckpointError(f"{path}: cannot read the lineage's lease{hint} ({exc}); remove it by hand") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: the lineage's lease is not a regular file; remove it by hand")
        raw = os.read(fd, _MAX_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the lineage's lease ({exc})") from None
    finally:
        os.close(fd)
    try:
        if len(raw) > _MAX_BYTES:
            raise ValueError(f"larger than {_MAX_BYTES} bytes")
        record = json.loads(raw)
        if not isinstance(record, dict) or not isinstance(record.get("generation"), int):
            raise ValueError("not a lease record")
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: the lineage's lease is unreadable ({exc}); remove it by hand") from None
    return record


def _write(lineage_dir: Path, record: dict[str, Any]) -> None:
    tmp = lineage_dir / f".{LEASE_FILE}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, lineage_dir / LEASE_FILE)


@contextmanager
def _locked(lineage_dir: Path, timeout_s: float = 15.0) -> Iterator[None]:
    lock = lineage_dir / f"{LEASE_FILE}.lock"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.close(fd)
            break
        except FileExistsError:
            try:
                if time.time() - lock.stat().st_mtime > _LOCK_STALE_S:
                    lock.unlink(missing_ok=True)
                    continue
            except FileNotFoundError:
                continue
            if time.monotonic() > deadline:
                raise CheckpointError(f"{lock}: the lineage's lease stayed locked for {timeout_s:g} s") from None
            time.sleep(0.05)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _utc(ns: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns / 1e9))


def lease_age_s(record: dict[str, Any], now_ns: int | None = None) -> float:
    """Seconds since the record's owner last renewed it."""
    renewed = record.get("renewed_ns")
    if not isinstance(renewed, int):
        return float("inf")
    return ((now_ns if now_ns is not None else time.time_ns()) - renewed) / 1e9


def take_lease(
    lineage_dir: str | os.PathLike[str],
    owner: str,
    *,
    stale_after_s: float = STALE_AFTER_S,
    wait_s: float = WAIT_S,
    say: Callable[[str], None] | None = None,
    skew_s: float = CLOCK_SKEW_S,
) -> Lease:
    """Take the lease of the lineage in ``lineage_dir`` for ``owner`` with the next generation.

    A lease renewed by another owner within ``stale_after_s`` is waited for (up to ``wait_s``, said once through
    ``say``); :class:`LeaseHeld` when it is still alive then. The same owner taking it again (a new attempt of the
    same run) also gets a new generation, which fences the ranks of its earlier attempts. Another owner's renewal more
    than ``skew_s`` in the future is :class:`LeaseClockFault`, not a live holder."""
    path = Path(lineage_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such lineage directory")
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        with _locked(path):
            record = read_lease(path)
            age = lease_age_s(record) if record else float("inf")
            if record is not None and record.get("owner") != owner and age < -skew_s:
                raise LeaseClockFault(
                    f"{path / LEASE_FILE}: run {record.get('owner')} renewed the lease at {_utc(record['renewed_ns'])}, "
                    f"{-age:.1f} s after this host's clock ({_utc(time.time_ns())}): a clock jumped here or on "
                    f"{record.get('host')}; fix the clock, or remove the lease by hand once that run is gone"
                )
            if record is None or record.get("owner") == owner or age > stale_after_s:
                generation = (record["generation"] if record else 0) + 1
                now = time.time_ns()
                _write(
                    path,
                    {
                        "lineage": path.name,
                        "owner": owner,
                        "generation": generation,
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "taken_ns": now,
                        "renewed_ns": now,
                        "previous_owner": record.get("owner") if record else None,
                    },
                )
                if record is not None and record.get("owner") != owner and record.get("renewed_ns") == 0:
                    logger.info("lineage %s: run %s released it when it ended", path.name, record.get("owner"))
                elif record is not None and record.get("owner") != owner:
                    logger.warning(
                        "lineage %s: took over from run %s (generation %d, last renewed %.1f s ago); its writers are "
                        "now refused",
                        path.name,
                        record.get("owner"),
                        record["generation"],
                        age,
                    )
                return Lease(path, owner, generation)
        if time.monotonic() >= deadline:
            raise LeaseHeld(path.name, record, age)
        if not told and say is not None:
            say(f"{LeaseHeld(path.name, record, age)}; waiting up to {wait_s:g} s for it to end")
            told = True
        time.sleep(min(0.5, max(0.05, deadline - time.monotonic())))


def renew_lease(lease: Lease) -> bool:
    """Renew ``lease``; False (and nothing written) when another generation holds the lineage now."""
    with _locked(lease.path):
        record = read_lease(lease.path)
        if record is None or record.get("generation") != lease.generation or record.get("owner") != lease.owner:
            return False
        record["renewed_ns"] = time.time_ns()
        _write(lease.path, record)
        return True


def release_lease(lease: Lease) -> None:
    """Mark ``lease`` as no longer renewed (the run ended), so the next run takes the lineage without waiting. The
    generation stays, so this run's writers stay fenced."""
    try:
        with _locked(lease.path):
            record = read_lease(lease.path)
            if record is not None and record.get("generation") == lease.generation:
                record["renewed_ns"] = 0
                _write(lease.path, record)
    except (OSError, CheckpointError) as exc:
        logger.warning("lineage %s: could not release the lease (%s)", lease.lineage, exc)


def check_writer(lineage_dir: str | os.PathLike[str], generation: int, what: str) -> None:
    """Raise :class:`StaleWriter` unless the lineage's lease still has ``generation`` (``what``: the act refused,
    e.g. ``publish step_00000020``)."""
    record = read_lease(lineage_dir)
    if record is None or record.get("generation") != generation:
        holder = (
            f"run {record.get('owner')} holds it at generation {record.get('generation')}"
            if record
            else "it has no lease"
        )
        raise StaleWriter(
            f"lineage {Path(lineage_dir).name}: {what} refused: this writer has generation {generation} but {holder} "
            "(the run that started this writer was replaced; its ranks must stop)"
        )


class LeaseKeeper(threading.Thread):
    """Renews a lease every ``interval_s`` until :meth:`stop`; stops renewing (and logs it) if the lease was taken
    over. ``lost`` is set then."""

    def __init__(self, lease: Lease, interval_s: float = RENEW_S):
        super().__init__(daemon=True, name=f"kc-lease-{lease.lineage}")
        self.lease, self.interval_s = lease, interval_s
        self.halt = threading.Event()
        self.lost = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.interval_s):
            try:
                if not renew_lease(self.lease):
                    self.lost.set()
                    logger.error(
                        "lineage %s: the lease of generation %d was taken over by another run; this run's checkpoint "
                        "writes will be refused",
                        self.lease.lineage,
                        self.lease.generation,
                    )
                    return
            except (OSError, CheckpointError) as exc:
                logger.warning("lineage %s: renewing the lease failed (%s); retrying", self.lease.lineage, exc)

    def stop(self, release: bool = True) -> None:
        """Stop renewing; ``release`` marks the lease free for the next run at once."""
        self.halt.set()
        self.join(timeout=5)
        if release and not self.lost.is_set():
            release_lease(self.lease)
