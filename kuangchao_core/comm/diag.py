"""Which ranks did not arrive? The timeout diagnosis of SPEC L2.3, at no cost on the hot path.

Each process counts, in plain Python integers, the collectives it entered per group and the point-to-point ops
it entered per peer (``CommGroup.seq`` / ``CommGroup.p2p``). Nothing is written to the store while things
work. A background *responder* thread per process blocks on the c10d TCPStore (its own client connection)
waiting for a query. When an op times out, the timed-out rank posts a query; every live responder answers
with its counters; a member whose counter is below the timed-out op's number never reached it — it is named
in ``CommTimeout.missing_ranks``. A rank that does not answer within a short grace period is dead or stuck
before it built the group, and is named too.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

_PREFIX = "kc_comm_diag"
_WAIT_S = 30.0

_responder: threading.Thread | None = None
_responder_lock = threading.Lock()
_next_query: int = 1


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
    from kuangchao_core.comm.group import all_groups

    return {g.name: {"seq": g.seq, "p2p": {str(k): v for k, v in dict(g.p2p).items()}} for g in all_groups()}


def _answer(store, k: int, rank: int) -> None:
    store.set(f"r/{k}/{rank}", json.dumps(snapshot()))


def _respond_loop(store, blocking: bool, first: int, rank: int) -> None:
    k = first
    while True:
        key = f"q/{k}"
        try:
            if blocking:
                started = time.monotonic()
                try:
                    store.wait([key], timedelta(seconds=_WAIT_S))
                except Exception:
                    if time.monotonic() - started < _WAIT_S * 0.5:
                        return  # the store went away: the job is ending
                    continue
            else:
                while not store.check([key]):
                    time.sleep(0.2)
            _answer(store, k, rank)
            k += 1
        except Exception:
            return


def ensure_responder() -> None:
    """Start this process's responder thread once (called by every group constructor)."""
    global _responder
    if _responder is not None:
        return
    with _responder_lock:
        if _responder is not None or not dist.is_initialized():
            return
        try:
            store, blocking = _connect()
            first = int(store.add("qn", 0)) + 1
        except Exception:
            return  # no store reachable: timeouts still raise, with the missing ranks unknown
        _responder = threading.Thread(
            target=_respond_loop, args=(store, blocking, first, dist.get_rank()), name="kc-comm-diag", daemon=True
        )
        _responder.start()


def find_missing(group, op: str, seq: int, peer: int | None = None, grace_s: float | None = None) -> list[int]:
    """Global ranks of ``group`` that did not reach this rank's op ``seq`` (or p2p op ``seq`` with ``peer``).

    Asks every member's responder for its counters; members that do not answer within ``grace_s`` are counted
    as missing. Returns [] when no store is reachable.
    """
    me = dist.get_rank()
    others = [peer] if peer is not None else [r for r in group.ranks if r != me]
    if grace_s is None:
        grace_s = min(1.0, max(0.2, group.timeout_ms / 2000))
    try:
        store, _ = _connect(timeout_s=max(grace_s, 1.0))
        k = int(store.add("qn", 1))
        store.set(f"q/{k}", op)
        keys = [f"r/{k}/{r}" for r in others]
        try:
            store.wait(keys, timedelta(seconds=grace_s))
        except Exception:
            pass
        missing = []
        for r, key in zip(others, keys):
            if not store.check([key]):
                missing.append(r)
                continue
            info = json.loads(store.get(key)).get(group.name)
            if info is None:
                missing.append(r)
            elif peer is not None:
                if info["p2p"].get(str(me), 0) < seq:
                    missing.append(r)
            elif info["seq"] < seq:
                missing.append(r)
        return missing
    except Exception:
        return []
