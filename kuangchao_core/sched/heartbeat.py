"""Worker heartbeats (L4.5): a background thread per worker writes ``<dir>/rank_<r>.hb``; the launcher reads them.

The beat comes from a daemon thread, so a long checkpoint write or a slow step does not stop it; a process that is
stopped (SIGSTOP) or wedged in the interpreter as a whole stops beating, which is what the launcher detects.
Each beat file is replaced atomically and holds JSON: ``rank``, ``pid``, ``attempt``, ``counter`` (monotonic
per writer), ``mono`` (``time.monotonic()`` of the writer) and ``wall`` (``time.time()``).
The launcher judges liveness by when *it* last saw ``counter`` change, on its own monotonic clock, so clocks of
different processes never have to agree.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kuangchao_core.config.bounded_json import read_json_object

#: a beat file is a few hundred bytes; a larger one is not ours
MAX_BEAT_BYTES = 1 << 16

ENV_DIR = "KC_HEARTBEAT_DIR"
ENV_INTERVAL = "KC_HEARTBEAT_INTERVAL_S"
ENV_ATTEMPT = "KC_ATTEMPT"


def heartbeat_path(directory: str | os.PathLike, rank: int) -> Path:
    """Path of the beat file of ``rank`` in ``directory``."""
    return Path(directory) / f"rank_{rank}.hb"


@dataclass(frozen=True)
class Beat:
    """One beat as read back from a beat file."""

    rank: int
    pid: int
    attempt: int
    counter: int
    mono: float
    wall: float
    stopped: bool = False


def read_beat(path: str | os.PathLike) -> Beat | None:
    """Read a beat file; ``None`` if it does not exist (yet) or cannot be parsed."""
    try:
        d = read_json_object(path, max_bytes=MAX_BEAT_BYTES)
        return Beat(
            rank=int(d["rank"]),
            pid=int(d["pid"]),
            attempt=int(d.get("attempt", 0)),
            counter=int(d["counter"]),
            mono=float(d["mono"]),
            wall=float(d["wall"]),
            stopped=bool(d.get("stopped", False)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


class HeartbeatWriter:
    """Beat every ``interval_s`` seconds from a daemon thread into ``<dir>/rank_<rank>.hb``.

    Call ``start()`` (or use it as a context manager) and ``stop()`` at the end. The first beat is written
    synchronously by ``start()`` so the launcher sees the rank at once.
    """

    def __init__(self, directory: str | os.PathLike, rank: int, interval_s: float = 1.0, attempt: int = 0):
        if interval_s <= 0:
            raise ValueError(f"heartbeat interval must be > 0 s, got {interval_s}")
        self.dir = Path(directory)
        self.rank = int(rank)
        self.interval_s = float(interval_s)
        self.attempt = int(attempt)
        self.path = heartbeat_path(self.dir, self.rank)
        self.counter = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, rank: int | None = None) -> HeartbeatWriter | None:
        """A writer configured by the launcher's environment (``KC_HEARTBEAT_DIR`` …), or ``None`` if unset."""
        directory = os.environ.get(ENV_DIR)
        if not directory:
            return None
        if rank is None:
            rank = int(os.environ.get("RANK", "0"))
        interval = float(os.environ.get(ENV_INTERVAL, "1.0"))
        attempt = int(os.environ.get(ENV_ATTEMPT, "0"))
        return cls(directory, rank, interval, attempt)

    def beat(self, stopped: bool = False) -> None:
        """Write one beat now (atomically: temp file + rename); ``stopped`` marks the last beat of a clean stop."""
        self.counter += 1
        payload = {
            "stopped": stopped,
            "rank": self.rank,
            "pid": os.getpid(),
            "attempt": self.attempt,
            "counter": self.counter,
            "mono": time.monotonic(),
            "wall": time.time(),
        }
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(payload, f)
        os.replace(tmp, self.path)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except OSError:
                # A transient file-system error must not kill the beat thread; the next beat retries.
                pass

    def start(self) -> HeartbeatWriter:
        """Create the directory, write the first beat and start the background thread."""
        if self._thread is not None:
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        self.beat()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"kc-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and write a final ``stopped`` beat, after which the launcher no longer watches this rank."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1.0)
            self._thread = None
            try:
                self.beat(stopped=True)
            except OSError:
                pass

    def __enter__(self) -> HeartbeatWriter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux ``/proc``; elsewhere ``kill(pid, 0)``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class HeartbeatMonitor:
    """Launcher side: watch the beat files of ``ranks`` and say which one has been silent too long.

    A rank is watched from its first beat of this ``attempt`` (beats with another attempt id are stale and
    ignored) until it writes a ``stopped`` beat or its process is gone (its exit is the launcher's business). ``startup_grace_s`` (optional) bounds how long a rank may take to send its first beat.
    ``clock`` is injectable for unit tests.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        ranks: list[int],
        timeout_s: float,
        attempt: int = 0,
        startup_grace_s: float | None = None,
        clock=time.monotonic,
    ):
        self.dir = Path(directory)
        self.ranks = list(ranks)
        self.timeout_s = float(timeout_s)
        self.attempt = attempt
        self.startup_grace_s = startup_grace_s
        self.clock = clock
        self.started = clock()
        self._last_counter: dict[int, int] = {}
        self._last_change: dict[int, float] = {}
        self.stale_beats = 0
        self._done: set[int] = set()

    def poll(self) -> tuple[int, float] | None:
        """Read every beat file; return ``(rank, silent_seconds)`` of the first lost rank, else ``None``."""
        now = self.clock()
        for r in self.ranks:
            beat = read_beat(heartbeat_path(self.dir, r))
            if beat is not None and beat.attempt != self.attempt:
                self.stale_beats += 1
                beat = None
            if beat is not None and self._last_counter.get(r) != beat.counter:
                self._last_counter[r] = beat.counter
                self._last_change[r] = now
            if beat is not None and (beat.stopped or not pid_alive(beat.pid)):
                self._done.add(r)
            if r in self._done:
                continue
            if r in self._last_change:
                silent = now - self._last_change[r]
                if silent > self.timeout_s:
                    return r, silent
            elif self.startup_grace_s is not None and now - self.started > self.startup_grace_s:
                return r, now - self.started
        return None

    def seen(self, rank: int) -> bool:
        """Whether ``rank`` has beaten at least once in this attempt."""
        return rank in self._last_change
