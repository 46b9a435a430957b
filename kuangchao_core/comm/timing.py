"""Per-process accounting of time spent in communication (SPEC L2.7).

Every primitive passes ``comm.dispatch``, which adds its wall time, call count and payload bytes here under
the op's name. The engine reads ``COMM_STATS.total_seconds()`` around a step to compute the communication
share; ``kc`` metrics and benchmarks read ``seconds_by_op()``.
"""

from __future__ import annotations

import threading

OP_KINDS = ("broadcast", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv")


class CommStats:
    """Counters per op kind: calls, seconds (blocking time in this process) and bytes moved by this rank."""

    __slots__ = ("_calls", "_seconds", "_bytes", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._seconds: dict[str, float] = {}
        self._bytes: dict[str, int] = {}

    def add(self, op: str, seconds: float, nbytes: int = 0, calls: int = 1) -> None:
        """Account ``seconds`` of blocking time, ``nbytes`` of payload and ``calls`` calls to ``op``."""
        with self._lock:
            self._calls[op] = self._calls.get(op, 0) + calls
            self._seconds[op] = self._seconds.get(op, 0.0) + seconds
            self._bytes[op] = self._bytes.get(op, 0) + nbytes

    def seconds_by_op(self) -> dict[str, float]:
        """Seconds spent per op kind since the last ``reset()``."""
        with self._lock:
            return dict(self._seconds)

    def counts_by_op(self) -> dict[str, int]:
        """Number of calls per op kind since the last ``reset()``."""
        with self._lock:
            return dict(self._calls)

    def bytes_by_op(self) -> dict[str, int]:
        """Payload bytes per op kind since the last ``reset()``."""
        with self._lock:
            return dict(self._bytes)

    def total_seconds(self) -> float:
        """Seconds spent in all communication since the last ``reset()``."""
        with self._lock:
            return sum(self._seconds.values())

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{op: {"calls", "seconds", "bytes"}}`` for logging."""
        with self._lock:
            return {
                op: {"calls": self._calls.get(op, 0), "seconds": self._seconds[op], "bytes": self._bytes.get(op, 0)}
                for op in self._seconds
            }

    def reset(self) -> None:
        """Zero every counter."""
        with self._lock:
            self._calls.clear()
            self._seconds.clear()
            self._bytes.clear()


COMM_STATS = CommStats()
