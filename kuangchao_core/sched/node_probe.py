"""Probe the links between the nodes of a pool (SPEC L4.2), through their node agents.

:func:`probe_nodes` starts :mod:`kuangchao_core.sched.probe_worker` on every candidate node, ``nproc`` ranks each,
as one share per node (:func:`~kuangchao_core.sched.multinode.launch_on_nodes`, under ``<run>/probe/``), and folds
the ranks' files into a :class:`~kuangchao_core.sched.topology.TopologyReport`: the node matrices (diagonal: the
best pair inside a node; off-diagonal: the best pair between two nodes), each rank's compute rate and each node's
device links. :func:`pool_fingerprint` identifies what was measured (names, addresses, devices, ranks per node) —
the cache key of the flow's probe task, so a second job on the same nodes reuses the matrix.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from kuangchao_core.errors import CommError
from kuangchao_core.sched.nodes import NodeStatus
from kuangchao_core.sched.placement import NodeAssignment
from kuangchao_core.sched.topology import DEFAULT_SIZES, TopologyReport, assemble_report


def pool_fingerprint(nodes: list[NodeStatus], nproc: int, sizes=DEFAULT_SIZES) -> str:
    """sha256 of what a node probe measures: each node's name, address and devices, ranks per node, sizes."""
    facts = sorted(
        (n.name, n.facts.address, n.facts.device_kind, n.facts.device_count, n.facts.torch or "") for n in nodes
    )
    blob = json.dumps({"nodes": facts, "nproc": nproc, "sizes": list(sizes)}, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def probe_nodes(
    nodes: list[NodeStatus],
    *,
    run_dir: str | Path,
    deployment: str,
    nproc: int = 2,
    sizes=DEFAULT_SIZES,
    iters: int = 5,
    timeout_s: float = 300.0,
) -> TopologyReport:
    """Measure every pair of ranks on ``nodes`` (``nproc`` ranks each) through the pool's node agents."""
    from kuangchao_core.sched.multinode import launch_on_nodes

    if len(nodes) < 1:
        raise CommError("node probe: no nodes to measure")
    ordered = sorted(nodes, key=lambda n: n.facts.address)  # the rendezvous ranks nodes by address
    assignments = [
        NodeAssignment(n.name, n.facts.address, n.facts.ifname, node_rank=i, nproc=nproc) for i, n in enumerate(ordered)
    ]
    base = Path(run_dir) / "probe"
    out = base / "ranks"
    t0 = time.monotonic()
    launch_on_nodes(
        assignments,
        run_dir=base,
        attempt=0,
        module="kuangchao_core.sched.probe_worker",
        args=["--out", str(out.resolve()), "--small", str(sizes[0]), "--large", str(sizes[1]), "--iters", str(iters)],
        env_for=lambda a: {"OMP_NUM_THREADS": "1"},
        deployment=deployment,
        start_timeout_s=timeout_s,
    )
    report = report_from_rank_files(out, len(assignments) * nproc, sizes, iters, time.monotonic() - t0)
    report.fingerprint = pool_fingerprint(nodes, nproc, sizes)
    report.node_facts = {n.name: _facts_key(n) for n in nodes}
    report.nproc = nproc
    return report


def report_from_rank_files(out: str | Path, world: int, sizes=DEFAULT_SIZES, iters: int = 5, elapsed_s: float = 0.0):
    """The :class:`TopologyReport` of the ``world`` ranks' ``rank_<r>.json`` files that
    :mod:`~kuangchao_core.sched.probe_worker` wrote under ``out`` (node matrices, compute rates, device links);
    ``CommError`` when some rank's file is missing."""
    out = Path(out)
    per_rank = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(out.glob("rank_*.json"))]
    if len(per_rank) != world:
        raise CommError(f"node probe: {len(per_rank)} of {world} ranks wrote their measurements to {out}")
    per_rank.sort(key=lambda d: d["rank"])
    report = assemble_report(per_rank, sizes, iters, [d["node"] for d in per_rank], elapsed_s)
    report.flops_per_s = [float(d.get("flops_per_s", 0.0)) for d in per_rank]
    report.device_links = {d["node"]: d["device_links"] for d in per_rank if "device_links" in d}
    return report


def _facts_key(n: NodeStatus) -> list[Any]:
    return [n.facts.address, n.facts.device_kind, n.facts.device_count, n.facts.torch or ""]


def covering_report(nodes: list[NodeStatus], nproc: int, max_age_s: float) -> TopologyReport | None:
    """A kept node-probe report (``kc topology show``'s cache) that measured every node of ``nodes`` as they are
    now (address, devices, torch) with ``nproc`` ranks each, less than ``max_age_s`` ago; the newest such."""
    from datetime import datetime, timezone

    from kuangchao_core.sched.topology import remembered_reports

    now = datetime.now(timezone.utc)
    for report in remembered_reports():
        facts = getattr(report, "node_facts", None) or {}
        if getattr(report, "nproc", None) != nproc or not facts:
            continue
        try:
            age = (now - datetime.fromisoformat(report.measured_at)).total_seconds()
        except ValueError:
            continue
        if age < max_age_s and all(facts.get(n.name) == _facts_key(n) for n in nodes):
            return report
    return None


def report_summary(report: TopologyReport) -> dict[str, Any]:
    """Headline figures of a node probe: intra- and inter-node bandwidth (GB/s) and latency (us), worst case."""
    n = len(report.nodes)
    intra_bw = [report.node_bandwidth_gbps[i][i] for i in range(n) if report.node_bandwidth_gbps[i][i] is not None]
    inter_bw = [
        report.node_bandwidth_gbps[i][j]
        for i in range(n)
        for j in range(n)
        if i != j and report.node_bandwidth_gbps[i][j] is not None
    ]
    inter_lat = [
        report.node_latency_us[i][j] for i in range(n) for j in range(n) if i != j and report.node_latency_us[i][j]
    ]
    return {
        "nodes": list(report.nodes),
        "intra_bandwidth_gbps_min": min(intra_bw) if intra_bw else None,
        "inter_bandwidth_gbps_min": min(inter_bw) if inter_bw else None,
        "inter_latency_us_max": max(inter_lat) if inter_lat else None,
    }
