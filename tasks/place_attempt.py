"""Prefect tasks of a multi-node job's placement: probe the candidate nodes, then place each attempt (the work is
in :mod:`kuangchao_core.job.placement_record`; this module adds the Prefect task runs and the artifact)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from kuangchao_core.job.placement_record import (
    cluster_probe_request,
    finish_cluster_probe,
    log,
    place_and_record,
    placement_markdown,
)
from tasks.probe_topology import probe_cluster
from tasks.retry_policy import TRANSIENT_RETRIES

__all__ = ["finish_cluster_probe", "place_attempt", "start_cluster_probe"]


def start_cluster_probe(cfg: Any, run_dir: str | Path, logger: Any = log) -> Any:
    """Start measuring ``cfg``'s candidate nodes: a kept report that covers them (returned as is), a running probe
    (a Prefect future, for :func:`finish_cluster_probe`), or None when no candidate is live."""
    kept, request = cluster_probe_request(cfg, run_dir, logger)
    return probe_cluster.submit(**request) if request is not None else kept


@task(name="place_attempt", **TRANSIENT_RETRIES)
def place_attempt(
    cfg: Any, exclude: list[str], topology: dict[str, Any] | None, run_dir: str, attempt: int
) -> dict[str, Any]:
    """Nodes and rank placement of one attempt: ``{"attempt", "assignments", "placement", "links"}``, recorded in
    the run directory and as the ``kc-placement`` artifact."""
    from prefect.artifacts import create_markdown_artifact

    record = place_and_record(cfg, exclude, topology, run_dir, attempt)
    create_markdown_artifact(markdown=placement_markdown(record), key="kc-placement", description="Nodes and ranks")
    return record
