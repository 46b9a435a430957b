"""The image decode pool and the data-wait timer (issue 31).

:func:`ordered_map` runs a function over items on a pool of threads (Pillow releases the GIL while it decodes and
resizes) with at most ``depth`` items in flight, and yields the results in the items' order: the output is the same
whatever the number of workers, and memory is bounded by ``depth`` results however long the input. A result is
``(value, None)`` or ``(None, exception)``, so one bad file does not stop the others being checked.

:class:`DataWait` measures how long the training step waits for its data: wrap the loader's ``next_step`` in
:meth:`DataWait.measure` and log :meth:`DataWait.summary` (seconds per step and, given the step times, the share).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def ordered_map(
    fn: Callable[[Any], Any], items: Iterable[Any], workers: int = 4, depth: int | None = None
) -> Iterator[tuple[Any, BaseException | None]]:
    """``(fn(item), None)`` or ``(None, error)`` for each item, in order; ``workers`` threads, at most ``depth``
    (default ``2 * workers``) submitted ahead of the one being yielded. ``workers=0`` runs in the caller's thread."""

    def call(item: Any) -> tuple[Any, BaseException | None]:
        try:
            return fn(item), None
        except Exception as exc:  # returned to the caller in order, with the item's place
            return None, exc

    if workers <= 0:
        for item in items:
            yield call(item)
        return
    depth = max(1, depth or 2 * workers)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kc-decode") as pool:
        pending: collections.deque = collections.deque()
        for item in items:
            pending.append(pool.submit(call, item))
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class DataWait:
    """Seconds the step spent waiting for its data, per step (``waits``)."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def measure(self, fetch: Callable[[], Any]) -> Any:
        """``fetch()``, timing how long it blocked."""
        t0 = time.perf_counter()
        out = fetch()
        self.waits.append(time.perf_counter() - t0)
        return out

    @property
    def last(self) -> float:
        """The latest step's wait (0 before the first)."""
        return self.waits[-1] if self.waits else 0.0

    def summary(self, step_seconds: Iterable[float] | None = None, skip: int = 1) -> dict[str, float]:
        """Mean and max wait over the steps after the first ``skip`` (the first waits for the pipeline to fill);
        with the steps' durations, ``share``: total wait / total step time over the same steps."""
        w = self.waits[skip:] or self.waits
        out = {"steps": float(len(w)), "mean_s": sum(w) / max(1, len(w)), "max_s": max(w, default=0.0)}
        if step_seconds is not None:
            s = list(step_seconds)[skip:] or list(step_seconds)
            out["share"] = sum(w) / max(sum(s), 1e-12)
        return out
