"""Ops in flight on NCCL-ruled groups: a hang named without blocking the host, told apart from waiting; device time.

On NCCL the engine waits for an op without a host timeout (the compute stream waits, the host goes on), so a hang
is not seen where the op was issued. This module's watchdog thread keeps the ops issued on NCCL-ruled groups and
names a hang before torch's own watchdog acts: the :class:`~kuangchao_core.errors.CommTimeout` names the group, the
op, its sequence number and the ranks that did not arrive (``comm.diag``); the timeout hooks run (state dumps for
``kc debug comm``) and the group is marked broken, so the next op on it raises that same error.

**An op's age is the time it has waited on its stream, not the time since the host issued it.** NCCL runs each
communicator's ops in issue order on one stream, and torch's NCCL process group puts a rank pair's sends and
receives on one stream of their own (DESIGN §2, ``reference/nccl.md``). An op queued behind others is not waiting
for its peers yet: its clock starts when it reaches the head of its stream on this rank — every op issued before
it on the same stream (the same group for a collective; the same group and peer for point-to-point, numbered by
the group's counters) has completed — at the later of its issue and the stream's last observed completion. On
CUDA the op also waits for the compute issued before it (the NCCL stream waits on the compute stream): the event
recorded before the op (``started``) completes when the device gets there, and the clock starts only then. A
grouped batch (``comm.p2p_batch``) is watched as its first op, on that op's stream.

**Waiting or hanging.** Head of stream alone cannot tell a peer that computes for a long time before it sends (a
receive posted early, while the peer compiles, evaluates or saves) from a peer that never will: both leave the op
at the head of its stream with nothing completing. What differs is the peer: one works, the other does not. Every
process keeps a progress beacon (``diag.beat``: the dispatch per op entered, the trainer per step, evaluation per
batch, a checkpoint save), and its responder reports the seconds since the last beat. When an op has
waited :data:`NOTICE_AT` of its group's timeout ``T``, the watchdog asks its members (``diag.probe``) and decides:

- members that did not reach the op (counter below its number): it is a hang when any of them has not beaten for
  a whole ``T`` or did not answer (it will never get there); while all of them work, the op is *waiting* — its
  clock restarts and it is asked again after another ``NOTICE_AT * T``;
- every member reached it (on a GPU a host runs ahead of its device; a Gloo receive completes only in its wait):
  nobody is known to hold it up, so it is a hang only when no rank, this one included, has beaten for ``T`` —
  a rank that sent and now blocks on this one is not idle for lack of arrival.

A hang is therefore named within about ``2 * T`` of the last progress of the rank that stopped (``NOTICE_AT * T``
of waiting, plus up to ``T`` for the idle window to pass) and a waiting op is never named. Limits: a rank whose
host blocks for more than ``T`` behind another rank that works (a chain of waits on hosts; on NCCL a host blocks
only at device reads), or that works for more than ``T`` without a beat (one long compile), is named hung. Because torch's NCCL watchdog counts from issue (``WorkNCCL::checkTimeout``, from
``workStartTime_``), NCCL process groups are created with :data:`BACKSTOP` times the group's timeout
(:func:`torch_timeout`): an op may wait up to that long from issue; past it torch aborts regardless.

:data:`CLOCK` and :data:`JUDGE_PROGRESS` are the seams the tests use as sabotage: ``CLOCK = "issue"`` ages every
op from its issue (the head-of-stream rule off) and ``JUDGE_PROGRESS = False`` declares every late op hung — both
together are the watchdog before issue 41, which named an early receive hung.

Not run in CI (no CUDA here); a GPU run should check, on NCCL: an all-reduce queued on the compute stream behind
a long kernel (``torch.cuda._sleep``) is not aged while the kernel runs (its ``started`` event is incomplete), then
is named about ``NOTICE_AT * T`` after the kernel when a member never issues it; a receive whose peer computes for
``1.5 * T`` before it sends completes without an abort from this watchdog or torch's (``tests/test_comm_watchdog.py``
run with ``cuda:nccl``, two GPUs).

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
from datetime import timedelta

from kuangchao_core.comm import diag
from kuangchao_core.comm.timing import COMM_STATS
from kuangchao_core.errors import CommTimeout

log = logging.getLogger("kuangchao.comm")

NOTICE_AT = 0.9  # of the group's timeout
POLL_S = 0.25
FORGET_S = 30.0  # a completed op nobody settled is dropped after this long
BACKSTOP = 4  # torch's own timeout on NCCL process groups, in group timeouts
CLOCK = "stream"  # "stream": age from the head of the op's stream; "issue": from its issue (sabotage)
JUDGE_PROGRESS = True  # False: every late op is a hang, whether its peers work or not (sabotage)

_clock = time.perf_counter  # the dispatch's clock: ``issued_at`` comes from it

_lock = threading.Lock()
_in_flight: deque[_Op] = deque()
_last_done: dict[tuple, float] = {}  # stream -> when an op on it was last seen complete
_thread: threading.Thread | None = None
_noticed: list[CommTimeout] = []
_waited: deque = deque(maxlen=64)  # (group, op, seq, ranks waited for): late ops judged waiting, newest last


class _Op:
    """One watched op: how to ask whether it is done (and ready, on CUDA), and where its clock stands."""

    __slots__ = ("done", "seconds", "ready", "op", "group", "seq", "peer", "stream", "issued_at", "nbytes")
    __slots__ += ("since", "held", "seen_done")

    def __init__(self, done, seconds, ready, op, group, seq, peer, issued_at, nbytes) -> None:
        self.done, self.seconds, self.ready = done, seconds, ready
        self.op, self.group, self.seq, self.peer = op, group, seq, peer
        self.stream = (id(group), peer)  # the group's collective stream, or the stream of the pair with ``peer``
        self.issued_at, self.nbytes = issued_at, nbytes
        self.since: float | None = None  # when its clock started (None: not yet at the head of its stream)
        self.held = False  # seen behind another op of its stream, or behind the compute before it
        self.seen_done = False


def torch_timeout(timeout_ms: int, backend: str) -> timedelta:
    """The timeout to give torch for a group of ``timeout_ms``: :data:`BACKSTOP` times longer on NCCL, whose own
    watchdog counts from issue and would otherwise abort an op this watchdog judges waiting."""
    return timedelta(milliseconds=timeout_ms * (BACKSTOP if backend == "nccl" else 1))


def start(group):
    """Before issuing an op on ``group``: a CUDA event recorded on the compute stream (NCCL), else None."""
    if group.backend != "nccl":
        return None
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def track(op: str, group, seq: int, peer: int | None, nbytes: int, issued_at: float, started=None, work=None) -> None:
    """Watch an op until it completes: on NCCL after its wait (``started`` from :func:`start`: ready when the
    device reaches the op; an event recorded now completes with the op), on Gloo through its ``work``.
    ``seq``: the group's collective number, or the point-to-point number with ``peer``. Nothing to watch: returns."""
    if started is not None:
        import torch

        ended = torch.cuda.Event(enable_timing=True)
        ended.record()
        entry = _Op(ended.query, lambda: started.elapsed_time(ended) / 1000.0, started.query, op, group, seq, peer,
                    issued_at, nbytes)  # fmt: skip
    elif work is not None:
        entry = _Op(lambda: _completed(work), lambda: None, None, op, group, seq, peer, issued_at, nbytes)
    else:
        return
    with _lock:
        _in_flight.append(entry)
    _ensure_thread()


def noticed() -> list[CommTimeout]:
    """The timeouts this process's watchdog has noticed (newest last)."""
    with _lock:
        return list(_noticed)


def waited() -> list[tuple]:
    """Late ops judged waiting, not hung (newest last): ``(group, op, seq, ranks waited for)``."""
    with _lock:
        return list(_waited)


def settle() -> None:
    """Account the device time of every completed op in ``COMM_STATS`` and forget it; never blocks. The trainer
    calls it after the step's read of device values, when the step's ops are done (a beat of progress too)."""
    diag.beat()
    with _lock:
        entries = list(_in_flight)
    done = [e for e in entries if _safe(e.done, True)]
    now = _clock()
    for entry in done:
        seconds = _safe(entry.seconds, None)
        if seconds is not None:
            COMM_STATS.add(entry.op, seconds, entry.nbytes, calls=0)
        _mark_done(entry, now)
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


def _mark_done(entry: _Op, now: float) -> None:
    if not entry.seen_done:
        entry.seen_done = True
        _last_done[entry.stream] = max(now, _last_done.get(entry.stream, now))


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
        _poll()


def _poll() -> None:
    """One look at every op in flight: forget the finished, start the clocks of the ops that reached the head of
    their stream, and judge those late past :data:`NOTICE_AT` of their group's timeout."""
    now = _clock()
    with _lock:
        entries = sorted(_in_flight, key=lambda e: e.seq)  # within a stream, issue order
    gone, late, heads = [], [], set()
    for e in entries:
        if _safe(e.done, True):
            _mark_done(e, now)
            if now - e.issued_at > FORGET_S:  # nobody settled it (no trainer): forget it
                gone.append(e)
            continue
        if e.group.broken is not None:  # already named (or failed): its next op raises that error
            gone.append(e)
            continue
        if CLOCK == "issue":
            e.since = e.issued_at if e.since is None else e.since
        elif e.stream in heads or (e.ready is not None and not _safe(e.ready, True)):
            heads.add(e.stream)
            e.held = True  # an earlier op of its stream, or the compute before it, still runs
            continue
        elif e.since is None:
            e.since = now if e.held else max(e.issued_at, _last_done.get(e.stream, e.issued_at))
        heads.add(e.stream)
        if now - e.since >= NOTICE_AT * e.group.timeout_ms / 1000.0:
            late.append(e)
    for e in late:
        if e.group.broken is not None or _judge(e):  # one hang per group: the rest of it raises that error
            gone.append(e)
    _forget(gone)


def _judge(entry: _Op) -> bool:
    """Ask the members about a late op; name it as a hang (True) or restart its clock as waiting (False)."""
    group, window = entry.group, entry.group.timeout_ms / 1000.0
    if not JUDGE_PROGRESS:
        _notice(entry, diag.find_missing(group, entry.op, entry.seq, peer=entry.peer))
        return True
    found = diag.probe(group, entry.op, entry.seq, peer=entry.peer)
    if _safe(entry.done, True):
        return False  # it completed while its members were asked: the next look forgets it

    def idle(rank: int) -> bool:
        seconds = found.idle_s.get(rank)
        return seconds is None or seconds >= window

    if found.missing:
        hung, waiting_on = any(idle(r) for r in found.missing), found.missing
    else:
        hung = all(idle(r) for r in found.idle_s) and diag.idle_s() >= window
        waiting_on = sorted(found.idle_s)
    if hung or not found.known:
        _notice(entry, found.missing)
        return True
    entry.since = _clock()
    with _lock:
        _waited.append((group.name, entry.op, entry.seq, list(waiting_on)))
    log.info(
        "%s seq %d on group %r is waiting for ranks %s, which are making progress (not a hang); asking again in %.0f s",
        entry.op, entry.seq, group.name, waiting_on, NOTICE_AT * window,
    )  # fmt: skip
    return False


def _notice(entry: _Op, missing: list[int]) -> None:
    op, group, seq = entry.op, entry.group, entry.seq
    error = CommTimeout(group.name, op, seq, missing, group.timeout_ms)
    group.timed_out = (op, seq, error)  # the wait that later fails on it raises this same error
    group.broken = f"{op} seq {seq} timed out; ranks {missing} did not arrive"
    with _lock:
        _noticed.append(error)
    log.error("%s", error)
    diag.run_timeout_hooks()
