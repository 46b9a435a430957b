"""Measuring the job's topology (the work of the Prefect tasks in ``tasks/probe_topology.py``), cached by Prefect.

The cache keys here are the cluster fingerprint (hosts, devices, world size, torch version, backend) plus the
probe's own parameters (one machine), or the fingerprint of the candidate nodes and ranks per node (a multi-node
pool), so a later flow run on the same cluster gets the stored report without measuring again; an entry expires
after ``CACHE_EXPIRATION`` so a slowly degrading network is noticed eventually.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from kuangchao_core.sched import topology as _topology
from kuangchao_core.sched.local_probe import probe_topology
from kuangchao_core.sched.topology import DEFAULT_SIZES, TopologyReport, cluster_fingerprint

CACHE_EXPIRATION = timedelta(days=1)


def topology_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """``topology-<fingerprint>-w<world>-s<small>x<large>-i<iters>``."""
    cfg = parameters.get("cfg")
    world = probe_world(cfg, parameters.get("world_size"))
    sizes = parameters.get("sizes") or DEFAULT_SIZES
    iters = parameters.get("iters") or 5
    return f"topology-{cluster_fingerprint(cfg)}-w{world}-s{sizes[0]}x{sizes[1]}-i{iters}"


def probe_world(cfg: Any, world_size: int | None) -> int:
    """The probe's world size: ``world_size``, else the job's ``parallel.world_size``, at least 2."""
    if world_size is not None:
        return int(world_size)
    return max(2, int(getattr(getattr(cfg, "parallel", None), "world_size", 2) or 2))


def measure_topology(
    cfg: Any, world_size: int | None, sizes: tuple[int, int], iters: int, log_path: str | None
) -> TopologyReport:
    """Measure this machine's ranks; the report carries the cluster fingerprint and is remembered for ``kc``."""
    report = probe_topology(probe_world(cfg, world_size), sizes=sizes, iters=iters, log_path=log_path)
    report.fingerprint = cluster_fingerprint(cfg)
    _topology.remember_report(report, report.fingerprint)
    return report


def cluster_probe_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """``topology-nodes-<pool fingerprint>``: the same nodes (names, addresses, devices) and ranks per node."""
    from kuangchao_core.sched.node_probe import pool_fingerprint
    from kuangchao_core.sched.nodes import NodeFacts, NodeStatus

    nodes = [NodeStatus(NodeFacts.from_dict(f), True, None, None) for f in parameters["node_facts"]]
    return f"topology-nodes-{pool_fingerprint(nodes, int(parameters['nproc']))}"


def measure_cluster(node_facts: list[dict], nproc: int, run_dir: str, deployment: str) -> TopologyReport:
    """Measure the links between the given nodes through their agents; the report is remembered for ``kc``."""
    from kuangchao_core.sched.node_probe import probe_nodes
    from kuangchao_core.sched.nodes import NodeFacts, NodeStatus

    nodes = [NodeStatus(NodeFacts.from_dict(f), True, None, None) for f in node_facts]
    report = probe_nodes(nodes, run_dir=run_dir, deployment=deployment, nproc=nproc)
    _topology.remember_report(report, report.fingerprint)
    return report
