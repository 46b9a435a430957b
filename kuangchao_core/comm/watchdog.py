"""Ops in flight on NCCL-ruled groups: a collective timeout named without blocking the host, and device comm time.

On NCCL the engine waits for an op without a host timeout (the compute stream waits, the host goes on), so a hang
is not seen where the op was issued: torch's NCCL watchdog aborts the communicator after the group's timeout,
naming neither the ranks that never arrived nor writing our state dumps. This module's watchdog thread keeps the
ops issued on NCCL-ruled groups; when one is still not complete at :data:`NOTICE_AT` of its group's timeout —
before torch's watchdog acts — the rank that noticed asks every member how far it got (``comm.diag``), logs the
:class:`~kuangchao_core.errors.CommTimeout` naming the group, the op, its sequence number and the missing ranks,
runs the timeout hooks (state dumps for ``kc debug comm``) and marks the group broken, so the next op on it raises
that same error.

On CUDA an op is followed by two events on the compute stream, recorded before it is issued and after its wait:
the second completes when the op does, and the time between them is the device time the op held the stream.
No reference to torch's work object (nor the tensors it keeps) is held. :func:`settle` adds the device time of
completed ops to ``COMM_STATS``, so a step's ``comm_share`` counts communication on the device rather than the
host's queueing. On Gloo (CI under ``KC_COMM_RULES=nccl``) only asynchronous ops are watched, through their work
objects; blocking Gloo ops are bounded by Gloo's own timeout and timed on the host by the dispatch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from kuangchao_core.comm import diag
from kuangchao_core.comm.timing import COMM_STATS
from kuangchao_core.errors import CommTimeout

log = logging.getLogger("kuangchao.comm")

NOTICE_AT = 0.9  # of the group's timeout
POLL_S = 0.25
FORGET_S = 30.0  # a completed op nobody settled is dropped after this long

_lock = threading.Lock()
_in_flight: deque = deque()  # [done() -> bool, seconds() -> float | None, op, group, seq, peer, issued_at, nbytes]
_thread: threading.Thread | None = None
_noticed: list[CommTimeout] = []


def start(group):
    """Before issuing an op on ``group``: a CUDA event recorded on the compute stream (NCCL), else None."""
    if group.backend != "nccl":
        return None
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def track(op: str, group, seq: int, peer: int | None, nbytes: int, issued_at: float, started=None, work=None) -> None:
    """Watch an op until it completes: on NCCL after its wait (``started`` from :func:`start`; an event recorded
    now completes with the op), on Gloo through its ``work``. Nothing to watch: returns."""
    if started is not None:
        import torch

        ended = torch.cuda.Event(enable_timing=True)
        ended.record()
        entry = [ended.query, lambda: started.elapsed_time(ended) / 1000.0]
    elif work is not None:
        entry = [lambda: _completed(work), lambda: None]
    else:
        return
    with _lock:
        _in_flight.append([*entry, op, group, seq, peer, issued_at, nbytes])
    _ensure_thread()


def noticed() -> list[CommTimeout]:
    """The timeouts this process's watchdog has noticed (newest last)."""
    with _lock:
        return list(_noticed)


def settle() -> None:
    """Account the device time of every completed op in ``COMM_STATS`` and forget it; never blocks. The trainer
    calls it after the step's read of device values, when the step's ops are done."""
    with _lock:
        entries = list(_in_flight)
    done = [e for e in entries if _safe(e[0], True)]
    for entry in done:
        seconds = _safe(entry[1], None)
        if seconds is not None:
            COMM_STATS.add(entry[2], seconds, entry[7], calls=0)
    _forget(done)


def _safe(fn, default):
    try:
        return fn()
    except Exception:  # a failed op counts as finished here: its error surfaces through the process group
        return default


def _completed(work) -> bool:
    """Done and successful: a Gloo op that failed on its own timeout is still a hang to name."""
    if not work.is_completed():
        return False
    try:
        return bool(work.is_success())
    except Exception:  # noqa: BLE001 - a backend that cannot say: completed counts as done
        return True


def _forget(entries: list) -> None:
    if not entries:
        return
    ids = {id(e) for e in entries}
    with _lock:
        kept = [e for e in _in_flight if id(e) not in ids]
        _in_flight.clear()
        _in_flight.extend(kept)


def _ensure_thread() -> None:
    global _thread
    if _thread is not None and _thread.is_alive():
        return
    with _lock:
        if _thread is not None and _thread.is_alive():
            return
        _thread = threading.Thread(target=_watch, name="kc-comm-watchdog", daemon=True)
        _thread.start()


def _watch() -> None:
    while True:
        time.sleep(POLL_S)
        now = time.monotonic()
        with _lock:
            entries = list(_in_flight)
        gone = []
        for entry in entries:
            age = now - entry[6]
            if _safe(entry[0], True):
                if age > FORGET_S:  # nobody settled it (no trainer): forget it
                    gone.append(entry)
            elif age >= NOTICE_AT * entry[3].timeout_ms / 1000.0:
                _notice(entry)
                gone.append(entry)
        _forget(gone)


def _notice(entry) -> None:
    op, group, seq, peer = entry[2:6]
    missing = diag.find_missing(group, op, seq, peer=peer)
    error = CommTimeout(group.name, op, seq, missing, group.timeout_ms)
    group.timed_out = (op, seq, error)  # the wait that later fails on it raises this same error
    group.broken = f"{op} seq {seq} timed out; ranks {missing} did not arrive"
    with _lock:
        _noticed.append(error)
    log.error("%s", error)
    diag.run_timeout_hooks()
