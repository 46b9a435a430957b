"""Prefect tasks ``probe_topology`` and ``probe_cluster_topology``: measure latency/bandwidth once per cluster and
reuse it (Prefect caching by the keys of :mod:`kuangchao_core.job.topology_probe`); each report is published."""

from __future__ import annotations

from typing import Any

from prefect import task

from kuangchao_core.job.topology_probe import (
    CACHE_EXPIRATION,
    cluster_probe_cache_key,
    measure_cluster,
    measure_topology,
    topology_cache_key,
)
from kuangchao_core.sched.topology import DEFAULT_SIZES, TopologyReport
from tasks.retry_policy import TRANSIENT_RETRIES


def _publish(report: TopologyReport) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(
        markdown=report.to_markdown() + f"\nCluster fingerprint: `{report.fingerprint}`\n",
        key="kc-topology",
        description="Topology probe: latency and bandwidth between ranks and nodes",
    )


_CACHED = {"cache_expiration": CACHE_EXPIRATION, "persist_result": True}


@task(name="probe_topology", cache_key_fn=topology_cache_key, **TRANSIENT_RETRIES, **_CACHED)
def probe_topology(
    cfg: Any = None,
    world_size: int | None = None,
    sizes: tuple[int, int] = DEFAULT_SIZES,
    iters: int = 5,
    log_path: str | None = None,
) -> dict:
    """Measure the topology (``world_size`` defaults to the job's ``parallel.world_size``, at least 2); returns its dict."""
    report = measure_topology(cfg, world_size, sizes, iters, log_path)
    _publish(report)
    return report.to_dict()


probe_topology_task = probe_topology


@task(name="probe_cluster_topology", cache_key_fn=cluster_probe_cache_key, **TRANSIENT_RETRIES, **_CACHED)
def probe_cluster(node_facts: list[dict], nproc: int, run_dir: str, deployment: str) -> dict:
    """Measure the links between the given nodes through their agents (cached by the nodes' fingerprint)."""
    report = measure_cluster(node_facts, nproc, run_dir, deployment)
    _publish(report)
    return report.to_dict()
