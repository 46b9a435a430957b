"""Bytes the gathers and reduce-scatters copy through staging buffers, per op (issue 41, item 4).

A collective is cheapest when the backend reads its input and writes its output where the caller keeps them:
``all_gather_single`` / ``reduce_scatter_single`` on one flat buffer. An ``all_gather`` into a list makes torch
gather into a flat buffer of its own and copy out of it, and a reduce-scatter of chunks concatenated first copies
its whole input — for ZeRO-3, which gathers every unit every micro-batch, a second full copy of every byte.

:data:`STAGING` accounts every gather and reduce-scatter of ``comm.primitives``, by op:

- ``payload``: the bytes the op delivers (the gathered output; the reduce-scatter's full input);
- ``copied``: bytes the comm layer itself copies into or out of a staging buffer (counted where the copy is made);
- ``backend``: bytes the group's backend stages inside torch for the form of call made (:data:`BACKEND_STAGING`,
  read from torch 2.13's ``ProcessGroupNCCL.cpp`` / ``ProcessGroupGloo.cpp``), for the backend whose rules the
  group runs (``CommGroup.rules``: NCCL also under ``KC_COMM_RULES=nccl``, whose job this models);
- ``fallbacks``: calls that could not take the flat path, by reason: the backend stages its flat op anyway
  (``gloo``: its all-gather goes through a flat buffer and a copy out, its reduce-scatter clones the input and
  all-reduces it), the backend refused the flat op (``unsupported``), the group's rank order differs from torch's
  (``order``), the caller passed lists (``list``), or the flat path was switched off (``staged``, the sabotage
  switch :func:`use_flat`).

``copies(op)`` is then ``(payload + copied + backend) / payload``: 1.0 when every byte is written once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

#: (backend, op, form) -> (bytes staged per payload byte, per output byte); unlisted forms stage nothing
BACKEND_STAGING: dict[tuple[str, str, str], tuple[int, int]] = {
    ("nccl", "all_gather", "list"): (1, 0),  # allgather: newLikeFlat(outputs), then copy out to each entry
    ("gloo", "all_gather", "flat"): (1, 0),  # _allgather_base -> allgather: flat output, copied to the chunks
    ("gloo", "all_gather", "list"): (1, 0),
    ("gloo", "reduce_scatter", "flat"): (1, 1),  # _reduce_scatter_base: input.clone(), all-reduce, copy chunk out
}
#: backends whose flat ops stage nothing of their own
FLAT_NATIVE = frozenset({"nccl"})

_flat = [True]


def flat_enabled() -> bool:
    """Whether the primitives take the flat forms (off only under :func:`use_flat`'s sabotage)."""
    return _flat[0]


@contextlib.contextmanager
def use_flat(enabled: bool) -> Iterator[None]:
    """Inside the block the gathers and reduce-scatters take the flat forms (``True``) or the list forms of before
    (``False``: the negative control of the staging tests and the benchmark)."""
    before, _flat[0] = _flat[0], bool(enabled)
    try:
        yield
    finally:
        _flat[0] = before


def backend_staged(backend: str, op: str, form: str, payload: int, output: int) -> int:
    """Bytes ``backend`` copies through a buffer of its own for one ``op`` call of ``form`` (``flat``/``list``)."""
    per_payload, per_output = BACKEND_STAGING.get((backend, op, form), (0, 0))
    return per_payload * payload + per_output * output


class StagingStats:
    """Per-op counters of payload, staged bytes and fallbacks (see the module docstring)."""

    __slots__ = ("_lock", "_ops")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: dict[str, dict] = {}

    def add(self, op: str, payload: int, copied: int, backend: int, fallback: str | None = None) -> None:
        """Account one call of ``op``."""
        with self._lock:
            s = self._ops.setdefault(op, {"calls": 0, "payload": 0, "copied": 0, "backend": 0, "fallbacks": {}})
            s["calls"] += 1
            s["payload"] += payload
            s["copied"] += copied
            s["backend"] += backend
            if fallback is not None:
                s["fallbacks"][fallback] = s["fallbacks"].get(fallback, 0) + 1

    def snapshot(self) -> dict[str, dict]:
        """``{op: {"calls", "payload", "copied", "backend", "fallbacks": {reason: calls}}}``."""
        with self._lock:
            return {op: {**s, "fallbacks": dict(s["fallbacks"])} for op, s in self._ops.items()}

    def copies(self, op: str) -> float:
        """Bytes written per payload byte of ``op`` (1.0: each byte once; 0.0 when none ran)."""
        with self._lock:
            s = self._ops.get(op)
            if not s or not s["payload"]:
                return 0.0
            return (s["payload"] + s["copied"] + s["backend"]) / s["payload"]

    def reset(self) -> None:
        """Zero every counter."""
        with self._lock:
            self._ops.clear()


STAGING = StagingStats()


def account(op: str, group, form: str, payload: int, output: int, copied: int = 0, fallback: str | None = None):
    """Record one ``op`` call of ``form`` on ``group`` in :data:`STAGING` (backend staging from the table)."""
    backend = group.rules
    if fallback is None and form == "flat" and backend not in FLAT_NATIVE and (backend, op, form) in BACKEND_STAGING:
        fallback = backend
    STAGING.add(op, payload, copied, backend_staged(backend, op, form, payload, output), fallback)
