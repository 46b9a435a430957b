"""Run a function on N Gloo processes on CPU and collect each rank's result.

Usage::

    from tests.mp import run_distributed

    def body(rank, world_size, x):      # module-level function (picklable)
        ...
        return something_picklable

    results = run_distributed(body, world_size=4, args=(3,))   # list indexed by rank

Each process (forked from a server that imported torch and the engine once) gets the parent's environment, RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a free port per call), and OMP_NUM_THREADS=1; the default process
group (gloo) is initialised before ``fn`` runs and destroyed after.
A failure in any rank raises ``RuntimeError`` with that rank's traceback; a hang raises after ``timeout`` s.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

from kuangchao_core.sched.launcher import free_port


def _worker(rank, world_size, port, fn, args, kwargs, queue, init_pg, env, parent_env):
    os.environ.clear()  # the parent's environment now, as a spawned process would have it (not the fork server's)
    os.environ.update(parent_env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    os.environ.update(env or {})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = None
    try:
        if init_pg:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=120))
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120), store=store
            )
        result = fn(rank, world_size, *args, **kwargs)
        queue.put((rank, True, result))
        if store is not None:
            _leave_together(store, rank, world_size)
    except BaseException:  # report every failure, including SystemExit from a rank
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if init_pg and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _leave_together(store, rank: int, world_size: int, wait_s: float = 60.0) -> None:
    """Rank 0 hosts the store every group's rendezvous goes through: it stays until every rank is done, so a rank
    still creating a group (one rank 0 is not in) is not cut off by rank 0 leaving first."""
    import time

    store.add("tests.mp.done", 1)
    if rank != 0:
        return
    deadline = time.monotonic() + wait_s
    while store.add("tests.mp.done", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)


#: imported once by the fork server; every rank process forks from it instead of importing torch (~3 s) and
#: torch._dynamo (~2 s, which torch.optim imports on first use) again
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "tests.engine_helpers", "kuangchao_core.engine.trainer"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(fn, world_size: int, args=(), kwargs=None, timeout: float = 240.0, init_pg: bool = True, env=None):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; return results by rank.

    The processes fork from a server that imported torch and the engine once (``forkserver``; nothing ran in it,
    so no thread pool or process group is inherited); each starts clean as a spawned process would."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, kwargs or {}, queue, init_pg, env, dict(os.environ)),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    import queue as queue_mod
    import time

    try:
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size and not errors:
            try:
                rank, ok, value = queue.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
                if dead:  # killed (a signal) or exited: a result it sent may still be in the pipe
                    try:
                        rank, ok, value = queue.get(timeout=2.0)
                    except queue_mod.Empty:
                        errors[dead[0]] = f"process exited with code {procs[dead[0]].exitcode} without a result"
                        break
                    (results if ok else errors)[rank] = value
                    continue
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"distributed run timed out after {timeout}s; ranks done: {sorted(results) + sorted(errors)}"
                    ) from None
                continue
            (results if ok else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]
