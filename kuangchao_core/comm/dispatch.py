"""The one dispatch point every communication primitive passes (SPEC L2.1, L2.3, L2.7).

In order: the permission guard (interface = op name, resource = ``group:<name>``), membership and health of the
group, the per-group sequence number, the op itself under the group's timeout, the timers of ``COMM_STATS``.
A timeout becomes ``CommTimeout`` naming the ranks that did not arrive (found by ``comm.diag`` only on that
path); any other backend failure becomes ``CommError`` naming group, op and sequence number.

The hot path is a few attribute updates and three clock reads (one is the progress beacon, ``diag.beat``: an op
entered is this process making progress): no store traffic, no allocation beyond a closure.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kuangchao_core import guard_api
from kuangchao_core.comm import diag, stream_trace, watchdog
from kuangchao_core.comm.timing import COMM_STATS
from kuangchao_core.errors import CommError, CommTimeout

_perf = time.perf_counter


def _enter(op: str, group, peer: int | None) -> int:
    guard_api.check(op, group.resource)
    if group.rank is None:
        raise CommError(
            f"{op} on group {group.name!r}: this process (rank {group.global_rank}) is not a member of ranks "
            f"{group.ranks}; call it only on member ranks"
        )
    if group.broken is not None:
        raise CommError(
            f"{op} on group {group.name!r}: the group is unusable after an earlier failure ({group.broken}); "
            "restart the job (or rebuild the group on every rank)"
        )
    group.ops[op] = group.ops.get(op, 0) + 1
    diag.beat()
    if peer is None:
        group.seq += 1
        return group.seq
    n = group.p2p.get(peer, 0) + 1
    group.p2p[peer] = n
    return n


def _looks_like_timeout(exc: BaseException, elapsed_s: float, timeout_ms: int) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text or elapsed_s * 1000 >= 0.95 * timeout_ms


def _fail(op: str, group, seq: int, peer: int | None, elapsed_s: float, exc: BaseException) -> None:
    noticed = getattr(group, "timed_out", None)
    if noticed is not None and noticed[:2] == (op, seq):  # the watchdog named it already (and ran the dumps)
        raise noticed[2] from exc
    if _looks_like_timeout(exc, elapsed_s, group.timeout_ms):
        missing = diag.find_missing(group, op, seq, peer=peer)
        group.broken = f"{op} seq {seq} timed out"
        diag.run_timeout_hooks()  # e.g. the worker's state dumps for `kc debug comm`
        raise CommTimeout(group.name, op, seq, missing, group.timeout_ms) from exc
    group.broken = f"{op} seq {seq} failed: {exc}"
    raise CommError(
        f"{op} on group {group.name!r} (ranks {group.ranks}, backend {group.backend}) failed at seq {seq}: {exc}"
    ) from exc


def run(op: str, group, nbytes: int, issue: Callable[[bool], object], peer: int | None = None):
    """Run one blocking op: ``issue(async_op)`` calls torch and returns its work handle when async.

    Groups under NCCL's rules issue the op async and wait without a host timeout: on NCCL that wait only orders
    the device's compute stream after the op (the host goes on queueing work), and a hang is named by
    ``comm.watchdog`` before the process group's own timeout; on Gloo under ``KC_COMM_RULES=nccl`` the same path
    runs, blocking as Gloo does.
    Other Gloo ops run synchronously under the process group's own timeout.
    """
    seq = _enter(op, group, peer)
    trace_id = stream_trace.last_issued() if group.rules == "nccl" else None
    t0 = _perf()
    try:
        if group.rules == "nccl":
            started = watchdog.start(group)
            work = issue(True)
            if work is not None:
                work.wait()
            watchdog.track(op, group, seq, peer, nbytes, t0, started=started)
            stream_trace.wait(trace_id)
        else:
            issue(False)
    except CommError:
        raise
    except Exception as exc:  # the backend's failure, turned into ours
        _fail(op, group, seq, peer, _perf() - t0, exc)
    finally:
        COMM_STATS.add(op, _perf() - t0, nbytes)
    return seq


class CommHandle:
    """The handle of an async op. ``wait()`` blocks until done; its blocking time is added to ``COMM_STATS``."""

    __slots__ = (
        "_work",
        "op",
        "group",
        "seq",
        "_nbytes",
        "_issue_s",
        "_finish",
        "_done",
        "peer",
        "_started",
        "trace_id",
    )

    def __init__(self, work, op, group, seq, nbytes, issue_s, finish, peer=None) -> None:
        self._work = work
        self.op = op
        self.group = group
        self.seq = seq
        self._nbytes = nbytes
        self._issue_s = issue_s
        self._finish = finish
        self._done = False
        self.peer = peer
        self._started = (None, 0.0)  # NCCL: the CUDA event before the op, and when it was issued
        self.trace_id = None  # under KC_COMM_RULES=nccl: the op in this rank's stream trace

    def is_completed(self) -> bool:
        """Whether the op has finished (never blocks)."""
        return self._done or self._work is None or self._work.is_completed()

    def wait(self) -> None:
        """Block until the op completes; raises ``CommTimeout`` if it exceeds the group timeout."""
        if self._done:
            return
        t0 = _perf()
        try:
            if self._work is not None:
                self._work.wait()
            started, issued_at = self._started
            if started is not None:  # NCCL: watched from here (the compute stream now waits for the op)
                watchdog.track(self.op, self.group, self.seq, self.peer, self._nbytes, issued_at, started=started)
            stream_trace.wait(self.trace_id)
            if self._finish is not None:
                self._finish()
        except CommError:
            raise
        except Exception as exc:
            _fail(self.op, self.group, self.seq, self.peer, _perf() - t0, exc)
        finally:
            self._done = True
            COMM_STATS.add(self.op, self._issue_s + _perf() - t0, self._nbytes)


def run_async(
    op: str,
    group,
    nbytes: int,
    issue: Callable[[bool], object],
    finish: Callable[[], None] | None = None,
    peer: int | None = None,
) -> CommHandle:
    """Issue one op asynchronously and return its ``CommHandle`` (``finish`` runs after the wait)."""
    seq = _enter(op, group, peer)
    trace_id = stream_trace.last_issued() if group.rules == "nccl" else None
    t0 = _perf()
    started = watchdog.start(group) if group.rules == "nccl" else None
    try:
        work = issue(True)
    except CommError:
        raise
    except Exception as exc:
        _fail(op, group, seq, peer, _perf() - t0, exc)
    if group.rules == "nccl" and started is None:  # Gloo under NCCL's rules: watched until waited
        watchdog.track(op, group, seq, peer, nbytes, t0, work=work)
    handle = CommHandle(work, op, group, seq, nbytes, _perf() - t0, finish, peer)
    handle._started = (started, t0)
    handle.trace_id = trace_id
    return handle
