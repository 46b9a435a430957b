"""Where the time of a run goes before its first step and after its last one (issue 27 §2), measured.

A :class:`PhaseClock` adds up wall-clock seconds per named phase (``imports``, ``prefect``, ``doctor`` …) and
stamps the ranks' first and last step events. ``kc train`` starts one at the process's start
(:func:`begin`); the flow takes it over (:func:`claim`, a fresh one from now when nothing began it, as under a
deployment) and puts :meth:`PhaseClock.startup` and :meth:`PhaseClock.after_last_step` into the run summary.
The time no phase covers is reported as ``other``, so the phases always add up to the measured total.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: the phases before the first step, in the order they run (``other``: what none of them covers)
STARTUP_PHASES = ("imports", "config", "prefect", "doctor", "topology", "mlflow", "validation", "tokens", "workers")
#: the phases after the last step
AFTER_PHASES = ("workers_exit", "launch_close", "checkpoint", "export", "summary", "flow_end")
#: the mark ``kc train`` sets just before it calls the flow: from there to the flow's body is ``prefect``
FLOW_CALLED = "flow_called"


def process_start_time() -> float:
    """When this process started (epoch seconds), from the OS (Linux: ``/proc``, else psutil); now when neither
    can tell."""
    try:  # field 22 of /proc/self/stat: the start in clock ticks after boot; /proc/stat's btime: the boot
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration, AttributeError):
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - no psutil: measure from now
        return time.time()


class PhaseClock:
    """Seconds per phase since ``origin`` (epoch seconds), plus the times of the first and last step events."""

    def __init__(self, origin: float | None = None):
        self.origin = time.time() if origin is None else float(origin)
        self.seconds: dict[str, float] = {}
        self.first_step: tuple[int, float] | None = None  # (step, epoch seconds) of the first step event
        self.last_step: tuple[int, float] | None = None
        self.marks: dict[str, float] = {}  # named moments (epoch seconds) a later phase is measured from
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to phase ``name`` (phases that run twice, e.g. imports, add up)."""
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, seconds)

    def since(self, name: str, start: float) -> None:
        """Add the time from ``start`` (epoch seconds) to now to phase ``name``."""
        self.add(name, time.time() - start)

    def mark(self, name: str) -> None:
        """Remember now as moment ``name``."""
        self.marks[name] = time.time()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` body as phase ``name`` (also when it raises)."""
        start = time.time()
        try:
            yield
        finally:
            self.since(name, start)

    def on_event(self, event: dict[str, Any]) -> None:
        """A :class:`~kuangchao_core.obs.console.LiveView` listener: stamps the ranks' step events — the ``steps``
        batches of every step (rank 0's step feed, at most 0.2 s late) and the ``step`` lines of ``log_interval``."""
        kind = event.get("event")
        if kind not in ("step", "steps"):
            return
        at = time.time()
        first, step = int(event.get("first_step" if kind == "steps" else "step") or 0), int(event.get("step") or 0)
        with self._lock:
            if self.first_step is None:
                self.first_step = (first, at)
            if self.last_step is None or step > self.last_step[0]:  # a step's first sighting
                self.last_step = (step, at)

    def _breakdown(self, names: tuple[str, ...], total: float) -> dict[str, float]:
        out = {"total": round(total, 2)}
        covered = 0.0
        for name in names:
            if name in self.seconds:
                out[name] = round(self.seconds[name], 2)
                covered += self.seconds[name]
        out["other"] = round(max(0.0, total - covered), 2)
        return out

    def startup(self) -> dict[str, float] | None:
        """``{"total": s, <phase>: s, …, "other": s, "first_step": N}`` from the origin to the first step event;
        None before any step."""
        if self.first_step is None:
            return None
        step, at = self.first_step
        return {**self._breakdown(STARTUP_PHASES, at - self.origin), "first_step": step}

    def after_last_step(self, now: float | None = None) -> dict[str, float] | None:
        """The phases from the last step event to ``now`` (default: now); None before any step."""
        if self.last_step is None:
            return None
        end = time.time() if now is None else now
        return self._breakdown(AFTER_PHASES, end - self.last_step[1])


_pending: PhaseClock | None = None  # begun by kc train, not yet taken by a flow
_active: PhaseClock | None = None  # the running flow's
_slot_lock = threading.Lock()


def begin(origin: float | None = None) -> PhaseClock:
    """Start the clock of the flow this process is about to run (``kc train``: at the process's start)."""
    global _pending
    with _slot_lock:
        _pending = PhaseClock(origin)
        return _pending


def pending() -> PhaseClock | None:
    """The clock begun for the next flow, if any (``kc train`` times its own phases on it)."""
    return _pending


def claim() -> PhaseClock:
    """The clock of the flow starting now: the one :func:`begin` started (then no longer pending), else a new one
    from now. It is also :func:`active` until :func:`release`. The time since ``kc train`` called the flow
    (:data:`FLOW_CALLED`) is the ``prefect`` phase: the flow run's creation, and the temporary server's start."""
    global _pending, _active
    with _slot_lock:
        clock, _pending = (_pending or PhaseClock()), None
        _active = clock
    called = clock.marks.pop(FLOW_CALLED, None)
    if called is not None:
        clock.since("prefect", called)
    return clock


def active() -> PhaseClock | None:
    """The running flow's clock (the launch task stamps its step events on it), or None."""
    return _active


def release(clock: PhaseClock) -> None:
    """The flow of ``clock`` has ended."""
    global _active
    with _slot_lock:
        if _active is clock:
            _active = None


def compact(startup: dict[str, float] | None, after: dict[str, float] | None) -> str:
    """One line for people: ``start-up 9.8 s to step 1 (imports 1.2, prefect 3.0, …); after the last step 2.1 s
    (…)``; phases under 0.05 s are left out."""

    def parts(d: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in d.items() if k not in ("total", "first_step") and v >= 0.05)

    out = []
    if startup:
        out.append(f"start-up {startup['total']:.1f} s to step {startup.get('first_step', 1)} ({parts(startup)})")
    if after:
        out.append(f"after the last step {after['total']:.1f} s ({parts(after)})")
    return "; ".join(out)
