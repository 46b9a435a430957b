"""Gloo ranks of the engine for the memory benchmarks: ``run_ranks`` spawns ``world`` processes running ``target``
and collects what each puts on the queue; ``init_rank`` sets a rank up (env, one thread, trusted guard, Gloo)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
from typing import Any


def init_rank(rank: int, world: int, port: int) -> None:
    """Inside a spawned rank: the process-group env, one thread, the allow-all guard (the benchmarks measure
    tensors, not token checks) and the Gloo group."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})
    import torch

    from kuangchao_core.comm import init_distributed
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    torch.set_num_threads(1)
    install_guard(AllowAll())
    init_distributed(backend="gloo", timeout_ms=300_000)


def run_ranks(world: int, target, args: tuple = (), timeout_s: float = 900) -> dict[int, Any]:
    """Spawn ``target(rank, world, port, root, *args, queue)`` on ``world`` ranks (``root``: a scratch directory
    they share); ``{rank: what it put on the queue}``. Exits naming the exit codes when a rank fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as root:
        procs = [ctx.Process(target=target, args=(r, world, port, root, *args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < world:
            try:
                rank, out = queue.get(timeout=2)
                results[rank] = out
            except Exception:  # queue.Empty: is a rank gone?
                if any(p.exitcode for p in procs) or time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}") from None
        for p in procs:
            p.join()
    return results
