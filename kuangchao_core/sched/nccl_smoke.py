"""The doctor's NCCL all-reduce smoke (issue 44 item 5): one small all-reduce over NCCL across the nodes when every
node has CUDA, skipped with the reason otherwise (:func:`~kuangchao_core.sched.gpu_versions.nccl_smoke_skip`).

Each rank is :mod:`~kuangchao_core.sched.nccl_smoke_worker`. Across node agents it runs as the topology probe does
(:func:`~kuangchao_core.sched.multinode.launch_on_nodes`, one share per node, a rank per GPU, under
``<runs>/doctor-nccl-<id>/``, removed afterwards); on a local cluster as one process per local GPU. Either way the
ranks' files are judged by :func:`verify_rank_files`: every rank wrote, and every element is ``world(world+1)/2``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kuangchao_core.sched.doctor_report import Check
from kuangchao_core.sched.gpu_versions import nccl_smoke_skip

WORKER = "kuangchao_core.sched.nccl_smoke_worker"
_FIX = (
    "read the ranks' logs; check NCCL_SOCKET_IFNAME / NCCL_IB_HCA name the training network, that the nodes reach "
    "each other on it, and NCCL_DEBUG=INFO's first error"
)


def verify_rank_files(out: str | Path, world: int) -> str | None:
    """None when ``world`` ranks each wrote ``rank_<r>.json`` under ``out`` with the full sum, else what is wrong."""
    out = Path(out)
    want = world * (world + 1) / 2
    wrong = []
    for rank in range(world):
        path = out / f"rank_{rank}.json"
        try:
            got = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            wrong.append(f"rank {rank} wrote no result")
            continue
        if got.get("world") != world or got.get("value") != want or not got.get("uniform"):
            wrong.append(
                f"rank {rank} on {got.get('node')}: sum {got.get('value')} (uniform {got.get('uniform')}) "
                f"in a world of {got.get('world')}, expected {want:g} in {world}"
            )
    return "; ".join(wrong) or None


def _passed(world: int, nodes: int, backend: str, t0: float) -> Check:
    where = f"across {nodes} nodes" if nodes > 1 else "on this machine"
    return Check(
        "nccl_smoke", True, f"{world}-rank {backend.upper()} all_reduce {where} ok in {time.monotonic() - t0:.1f} s"
    )


def run_local_smoke(world: int, backend: str = "nccl", timeout_s: float = 120.0) -> Check:
    """``world`` local processes (one per GPU with NCCL) all-reduce once; the ``nccl_smoke`` check."""
    from kuangchao_core.sched.launcher import free_port

    t0 = time.monotonic()
    out = Path(tempfile.mkdtemp(prefix="kc-nccl-smoke-"))
    port = free_port()
    try:
        procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            argv = [
                sys.executable,
                "-m",
                WORKER,
                "--out",
                str(out),
                "--backend",
                backend,
                "--timeout-s",
                str(timeout_s),
            ]
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        tails = []
        deadline = t0 + timeout_s
        for rank, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                return Check(
                    "nccl_smoke", False, f"{world}-rank {backend} all_reduce did not finish in {timeout_s:g} s", _FIX
                )
            if p.returncode != 0:
                tails.append(f"rank {rank} exit {p.returncode}: {(err.strip().splitlines() or ['no output'])[-1]}")
        wrong = "; ".join(tails) or verify_rank_files(out, world)
        if wrong:
            return Check(
                "nccl_smoke", False, f"{world}-rank {backend} all_reduce on this machine failed: {wrong}", _FIX
            )
        return _passed(world, 1, backend, t0)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_node_smoke(nodes: list[Any], deployment: str, runs_dir: str | Path, timeout_s: float = 180.0) -> Check:
    """One NCCL all-reduce over every GPU of ``nodes`` (``NodeStatus``) started through their node agents."""
    from kuangchao_core.sched.multinode import launch_on_nodes
    from kuangchao_core.sched.placement import NodeAssignment

    t0 = time.monotonic()
    ordered = sorted(nodes, key=lambda n: n.facts.address)  # the rendezvous ranks nodes by address
    assignments = [
        NodeAssignment(n.name, n.facts.address, n.facts.ifname, node_rank=i, nproc=max(1, n.facts.device_count))
        for i, n in enumerate(ordered)
    ]
    world = sum(a.nproc for a in assignments)
    base = Path(runs_dir).absolute() / f"doctor-nccl-{uuid.uuid4().hex[:8]}"
    out = base / "ranks"
    try:
        launch_on_nodes(
            assignments,
            run_dir=base,
            attempt=0,
            module=WORKER,
            args=["--out", str(out), "--backend", "nccl", "--timeout-s", str(timeout_s)],
            env_for=lambda a: {"OMP_NUM_THREADS": "1"},
            deployment=deployment,
            start_timeout_s=timeout_s,
        )
        wrong = verify_rank_files(out, world)
    except Exception as exc:  # noqa: BLE001 - a failed launch is the smoke's failure, said in one line
        wrong = f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if wrong:
        names = ", ".join(a.name for a in assignments)
        return Check("nccl_smoke", False, f"{world}-rank NCCL all_reduce across {names} failed: {wrong}", _FIX)
    return _passed(world, len(assignments), "nccl", t0)


def nccl_smoke_check(
    per_node: dict[str, dict[str, Any] | None], run: Callable[[], Check] | None, cannot: str = ""
) -> Check:
    """The ``nccl_smoke`` check: skipped (passed, with the reason) when :func:`nccl_smoke_skip` says so; a warning
    when the nodes have GPUs but this transport cannot start processes on them (``cannot``); else ``run()``."""
    skip = nccl_smoke_skip(per_node)
    if skip:
        return Check("nccl_smoke", True, f"skipped: {skip}")
    if run is None:
        fix = "start node agents (`kc node start --pool POOL`) on the nodes so kc doctor can run ranks there"
        return Check("nccl_smoke", True, f"not run: {cannot}", fix, warn=True)
    return run()


def cluster_smoke(gpu: dict[str, Any], runs_dir: str | Path | None = None) -> Check:
    """The smoke for what the doctor's node checks found (``gpu``: their ``gpu_out``): through the node agents
    (``nodes``), on this machine's GPUs (a local cluster, or no node check ran), or not at all through the TCP
    doctor agents, which only answer with versions. ``runs_dir``: ``KC_RUNS_DIR`` or ``runs``, as ``kc train``."""
    from kuangchao_core.sched.gpu_versions import probe_gpu_versions

    per_node = gpu.get("per_node")
    if per_node is None:
        per_node = {"(this machine)": probe_gpu_versions()}
    if gpu.get("nodes"):
        runs = runs_dir or os.environ.get("KC_RUNS_DIR", "runs")
        return nccl_smoke_check(per_node, lambda: run_node_smoke(gpu["nodes"], gpu["deployment"], runs))
    if gpu.get("local", True) and len(per_node) == 1:
        gpus = next(iter(per_node.values())) or {}
        return nccl_smoke_check(per_node, lambda: run_local_smoke(len(gpus.get("gpus") or [])))
    return nccl_smoke_check(per_node, None, "the TCP doctor agents (`kc doctor --serve`) only report versions")
