"""The topology probe on this machine: ``world_size`` Gloo processes spawned here run
:func:`~kuangchao_core.sched.topology.measure_rank` and the report is assembled from their figures."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

from kuangchao_core.errors import CommError
from kuangchao_core.sched.interrupt import children_spared, ignore_terminal_interrupt
from kuangchao_core.sched.launcher import free_port
from kuangchao_core.sched.topology import DEFAULT_SIZES, TopologyReport, assemble_report, measure_rank


def _spawned_rank(rank: int, world_size: int, port: int, sizes, iters: int, timeout_s: float, queue) -> None:
    from datetime import timedelta

    ignore_terminal_interrupt()  # kc train's Ctrl-C is kc train's: the probe stops its ranks itself
    # torch's C++ lines of this rendezvous ([W… ] the hostname of the client socket…) would reach kc train's
    # console raw, beside its one voice (issue 45 §3); the probe reports its outcome through the queue
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)

    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        queue.put((rank, True, measure_rank(sizes, iters)))
    except BaseException as exc:  # report to the parent instead of dying silently
        queue.put((rank, False, f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def probe_topology(
    world_size: int = 2,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    iters: int = 5,
    node_of_rank: Sequence[str] | None = None,
    timeout_s: float = 120.0,
    log_path: str | os.PathLike | None = None,
) -> TopologyReport:
    """Spawn ``world_size`` local Gloo processes, measure, and return the report.

    ``sizes`` = (small bytes for latency, large bytes for bandwidth). ``node_of_rank`` names the node of each
    rank (default: the hostname each rank reports). When ``log_path`` is given, one JSON line per measurement
    (probe id, time, headline figures) is appended to it, a history of when the probe actually ran.
    """
    import queue as queue_mod

    import torch.multiprocessing as mp

    if world_size < 2:
        raise CommError(f"probe_topology needs world_size >= 2, got {world_size}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    t0 = time.monotonic()
    procs = [
        ctx.Process(target=_spawned_rank, args=(r, world_size, port, tuple(sizes), iters, timeout_s, q))
        for r in range(world_size)
    ]
    results: list[dict] = []
    try:
        with children_spared():
            for p in procs:
                p.start()
        for _ in range(world_size):
            try:
                rank, ok, value = q.get(timeout=timeout_s)
            except queue_mod.Empty:
                raise CommError(
                    f"topology probe: no answer within {timeout_s:.0f} s from ranks "
                    f"{sorted(set(range(world_size)) - {d['rank'] for d in results})}; check loopback TCP"
                ) from None
            if not ok:
                raise CommError(f"topology probe failed on rank {rank}: {value}")
            results.append(value)
    except BaseException:  # a failed rank, a timeout, kc train interrupted: the others need not finish
        for p in procs:
            if p.pid is not None:  # started
                p.kill()
        raise
    finally:
        for p in (p for p in procs if p.pid is not None):
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    report = assemble_report(results, sizes, iters, node_of_rank, time.monotonic() - t0)
    if log_path is not None:
        with open(log_path, "a") as f:
            line = {
                "probe_id": report.probe_id,
                "measured_at": report.measured_at,
                "world_size": world_size,
                "allreduce_latency_us": report.allreduce_latency_us,
                "allreduce_busbw_gbps": report.allreduce_busbw_gbps,
            }
            f.write(json.dumps(line) + "\n")
    return report
