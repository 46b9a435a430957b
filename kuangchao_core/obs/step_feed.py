"""Every step's metrics for the orchestrator (issue 27 §4), off the step loop's critical path.

Rank 0 calls :meth:`StepFeed.record` once per optimizer step: it appends a tuple to a list under a lock and returns.
A daemon thread sends what accumulated every ``period_s`` as one ``steps`` event (``KC_EVENT`` line): the step
times of every step since the last one (for the ``kuangchao_train_step_seconds`` histogram) and the latest step's
metrics (for the gauges). The console's ``step`` lines stay at ``train.log_interval``; each of them is marked
``in_steps`` so the Prometheus metrics do not count that step twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kuangchao_core.obs.jsonlog import emit_event

#: how often the feed sends the steps it holds: well under any scrape interval, a few lines a second at most
PERIOD_S = 0.2


class StepFeed:
    """Batches per-step records and sends them as ``steps`` events from a background thread."""

    def __init__(self, period_s: float = PERIOD_S, emit: Callable[..., None] = emit_event):
        self.period_s = period_s
        self._emit = emit
        self._lock = threading.Lock()  # the pending records
        self._send = threading.Lock()  # one sender at a time, so the batches go out in step order
        self._pending: list[tuple[int, float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kc-step-feed", daemon=True)
        self._thread.start()

    def record(self, step: int, step_time_s: float, metrics: dict[str, float]) -> None:
        """Note one finished step (the caller's ``metrics`` dict is kept as it is: do not mutate it later)."""
        with self._lock:
            self._pending.append((step, step_time_s, metrics))

    def flush(self) -> None:
        """Send what is pending now, as one ``steps`` event (nothing when nothing is)."""
        with self._send:
            with self._lock:
                batch, self._pending = self._pending, []
            if not batch:
                return
            step, _, latest = batch[-1]
            self._emit(
                "steps",
                **latest,
                step=step,
                first_step=batch[0][0],
                step_times=[round(t, 6) for _, t, _ in batch],
            )

    def close(self) -> None:
        """Stop the thread and send the last steps (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.flush()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.flush()
            except Exception:  # a closed stdout at shutdown: the step loop is not the place to learn it
                return
