"""Prefect task ``probe_topology``: measure latency/bandwidth once per cluster and reuse it (Prefect caching).

The cache key is the cluster fingerprint (hosts, devices, world size, torch version, backend) plus the probe's
own parameters, so a later flow run on the same cluster gets the stored report without measuring again; the
entry expires after ``CACHE_EXPIRATION`` so a slowly degrading network is noticed eventually.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from kuangchao_core.sched import topology as _topology
from kuangchao_core.sched.topology import DEFAULT_SIZES, TopologyReport, cluster_fingerprint

CACHE_EXPIRATION = timedelta(days=1)


def topology_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """``topology-<fingerprint>-w<world>-s<small>x<large>-i<iters>``."""
    cfg = parameters.get("cfg")
    world = _world(cfg, parameters.get("world_size"))
    sizes = parameters.get("sizes") or DEFAULT_SIZES
    iters = parameters.get("iters") or 5
    return f"topology-{cluster_fingerprint(cfg)}-w{world}-s{sizes[0]}x{sizes[1]}-i{iters}"


def _world(cfg: Any, world_size: int | None) -> int:
    if world_size is not None:
        return int(world_size)
    return max(2, int(getattr(getattr(cfg, "parallel", None), "world_size", 2) or 2))


def _publish(report: TopologyReport, fingerprint: str) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(
        markdown=report.to_markdown() + f"\nCluster fingerprint: `{fingerprint}`\n",
        key="kc-topology",
        description="Topology probe: latency and bandwidth between ranks and nodes",
    )


@task(
    name="probe_topology",
    cache_key_fn=topology_cache_key,
    cache_expiration=CACHE_EXPIRATION,
    persist_result=True,
    retries=1,
    retry_delay_seconds=2,
)
def probe_topology(
    cfg: Any = None,
    world_size: int | None = None,
    sizes: tuple[int, int] = DEFAULT_SIZES,
    iters: int = 5,
    log_path: str | None = None,
) -> dict:
    """Measure the topology (``world_size`` defaults to ``cfg.parallel.world_size``, at least 2); returns its dict."""
    report = _topology.probe_topology(_world(cfg, world_size), sizes=sizes, iters=iters, log_path=log_path)
    report.fingerprint = cluster_fingerprint(cfg)
    _publish(report, report.fingerprint)
    _topology.remember_report(report, report.fingerprint)
    return report.to_dict()


probe_topology_task = probe_topology


def cluster_probe_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """``topology-nodes-<pool fingerprint>``: the same nodes (names, addresses, devices) and ranks per node."""
    from kuangchao_core.sched.node_probe import pool_fingerprint
    from kuangchao_core.sched.nodes import NodeFacts, NodeStatus

    nodes = [NodeStatus(NodeFacts.from_dict(f), True, None, None) for f in parameters["node_facts"]]
    return f"topology-nodes-{pool_fingerprint(nodes, int(parameters['nproc']))}"


@task(
    name="probe_cluster_topology",
    cache_key_fn=cluster_probe_cache_key,
    cache_expiration=CACHE_EXPIRATION,
    persist_result=True,
    retries=0,
)
def probe_cluster(node_facts: list[dict], nproc: int, run_dir: str, deployment: str) -> dict:
    """Measure the links between the given nodes through their agents (cached by the nodes' fingerprint)."""
    from kuangchao_core.sched.node_probe import probe_nodes
    from kuangchao_core.sched.nodes import NodeFacts, NodeStatus

    nodes = [NodeStatus(NodeFacts.from_dict(f), True, None, None) for f in node_facts]
    report = probe_nodes(nodes, run_dir=run_dir, deployment=deployment, nproc=nproc)
    _publish(report, report.fingerprint)
    _topology.remember_report(report, report.fingerprint)
    return report.to_dict()
