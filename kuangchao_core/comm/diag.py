"""Which ranks did not arrive, and are they still working? The timeout diagnosis of SPEC L2.3, at no cost on the
hot path.

Each process counts, in plain Python integers, the collectives it entered per group and the point-to-point ops
it entered per peer (``CommGroup.seq`` / ``CommGroup.p2p``), and keeps a *progress beacon*: :func:`beat` is an
integer increment and a clock read, called as the process works (every op the dispatch enters, the trainer per
step through ``watchdog.settle``, evaluation per batch, a checkpoint save before and after its files). Nothing is
written to the store while things work.
A background *responder* thread per process blocks on the c10d TCPStore (its own client connection) on its
"doorbell" key. When an op is late, the rank that noticed rings the doorbell of every other member (the only store
traffic, and only on that path); every live responder answers with its counters and the seconds since its last
beat (:func:`probe`). A member whose counter is below the late op's number never reached it — it is named in
``CommTimeout.missing_ranks``; whether it is still working (``comm.watchdog`` tells waiting from hanging by it) is
its idle time. A rank that does not answer within a short grace period is dead or stuck before it built the group,
and is named too.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from kuangchao_core.comm.registry import all_groups

_PREFIX = "kc_comm_diag"

#: called (no arguments) when an op times out, before ``CommTimeout`` is raised or logged (state dumps)
TIMEOUT_HOOKS: list = []


def run_timeout_hooks() -> None:
    """Run every :data:`TIMEOUT_HOOKS` entry; a hook that fails must not hide the timeout."""
    for hook in list(TIMEOUT_HOOKS):
        try:
            hook()
        except Exception:  # noqa: BLE001
            pass


_beacon = [0, time.monotonic()]  # beats, and the monotonic time of the last one


def beat() -> None:
    """Mark that this process is making progress (an integer increment and a clock read; no store traffic)."""
    _beacon[0] += 1
    _beacon[1] = time.monotonic()


def idle_s() -> float:
    """Seconds since this process's last :func:`beat` (since the import, before the first)."""
    return time.monotonic() - _beacon[1]


def progress() -> dict:
    """This process's beacon: ``{"beats": n, "idle_s": seconds since the last}``."""
    return {"beats": _beacon[0], "idle_s": idle_s()}


_BELL_WAIT = timedelta(days=7)

_responder: threading.Thread | None = None
_responder_store = None
_responder_rank: int | None = None
_responder_lock = threading.Lock()


def _namespace() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{_PREFIX}/{run}/{attempt}/"


def _connect(timeout_s: float = 30.0):
    """A fresh client connection to the job's store (so a blocked wait never stalls other store users)."""
    base = None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        try:
            base = dist.TCPStore(
                addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
            )
        except Exception:
            base = None
    blocking = base is not None
    if base is None:
        base = dist.distributed_c10d._get_default_store()
    return dist.PrefixStore(_namespace(), base), blocking


def snapshot() -> dict:
    """This process's progress: ``{group name: {"seq": n, "p2p": {peer: n}}}``."""
    return {g.name: {"seq": g.seq, "p2p": {str(k): v for k, v in dict(g.p2p).items()}} for g in all_groups()}


def _respond_loop(store, first: int, rank: int) -> None:
    n = first
    while True:
        try:
            started = time.monotonic()
            try:
                store.wait([f"bell/{rank}/{n}"], _BELL_WAIT)
            except Exception:
                if time.monotonic() - started < _BELL_WAIT.total_seconds() * 0.5:
                    return  # the store went away: the job is ending
                store, _ = _connect()  # a very long idle wait expired: start afresh on a new connection
                continue
            query = store.get(f"bell/{rank}/{n}").decode()
            n += 1
            if query == "stop":
                return
            store.set(f"r/{query}/{rank}", json.dumps({"groups": snapshot(), "progress": progress()}))
        except Exception:
            return


def _ring(store, rank: int, message: str) -> None:
    n = int(store.add(f"bells/{rank}", 1))
    store.set(f"bell/{rank}/{n}", message)


def _stop_responder() -> None:
    thread, store, rank = _responder, _responder_store, _responder_rank
    if thread is None or not thread.is_alive():
        return
    try:
        _ring(store, rank, "stop")
        thread.join(timeout=2.0)
    except Exception:
        thread.join(timeout=0.2)


def ensure_responder() -> None:
    """Start this process's responder thread once (called by every group constructor)."""
    global _responder, _responder_store, _responder_rank
    if _responder is not None:
        return
    with _responder_lock:
        if _responder is not None or not dist.is_initialized():
            return
        rank = dist.get_rank()
        try:
            store, blocking = _connect()
            if not blocking:
                return  # no dedicated connection possible: timeouts still raise, missing ranks unknown
            first = int(store.add(f"bells/{rank}", 0)) + 1
            control, _ = _connect()
        except Exception:
            return
        _responder_store, _responder_rank = control, rank
        _responder = threading.Thread(target=_respond_loop, args=(store, first, rank), name="kc-comm-diag", daemon=True)
        _responder.start()
        atexit.register(_stop_responder)


@dataclass
class Probe:
    """What the members told about one late op: who did not reach it, and how long each has been idle."""

    missing: list[int] = field(default_factory=list)  # below the op's number, or no answer
    idle_s: dict[int, float | None] = field(default_factory=dict)  # each rank asked: seconds since its last beat
    known: bool = False  # False when no store could be reached (nothing is known)


def find_missing(group, op: str, seq: int, peer: int | None = None, grace_s: float | None = None) -> list[int]:
    """Global ranks of ``group`` that did not reach this rank's op ``seq`` (or p2p op ``seq`` with ``peer``).

    Asks every member's responder for its counters; members that do not answer within ``grace_s`` are counted
    as missing. Returns [] when no store is reachable.
    """
    return probe(group, op, seq, peer=peer, grace_s=grace_s).missing


def probe(group, op: str, seq: int, peer: int | None = None, grace_s: float | None = None) -> Probe:
    """Ask ``peer`` (point-to-point) or every other member of ``group`` how far it got and how long it has been
    idle; a member that does not answer within ``grace_s`` is missing, with idle time None."""
    me = dist.get_rank()
    others = [peer] if peer is not None else [r for r in group.ranks if r != me]
    if grace_s is None:
        grace_s = min(1.0, max(0.2, group.timeout_ms / 2000))
    try:
        store, _ = _connect(timeout_s=max(grace_s, 1.0))
        k = int(store.add("qn", 1))
        for r in others:
            _ring(store, r, str(k))
        keys = [f"r/{k}/{r}" for r in others]
        try:
            store.wait(keys, timedelta(seconds=grace_s))
        except Exception:
            store, _ = _connect(timeout_s=max(grace_s, 1.0))  # a timed-out wait can leave the client out of step
        out = Probe(known=True)
        for r, key in zip(others, keys, strict=True):
            if not store.check([key]):
                out.missing.append(r)
                out.idle_s[r] = None
                continue
            answer = json.loads(store.get(key))
            out.idle_s[r] = float(answer["progress"]["idle_s"])
            info = answer["groups"].get(group.name)
            if info is None:
                out.missing.append(r)
            elif peer is not None:
                if info["p2p"].get(str(me), 0) < seq:
                    out.missing.append(r)
            elif info["seq"] < seq:
                out.missing.append(r)
        return out
    except Exception:
        return Probe()
