"""Prefect tasks of a multi-node job's placement: probe the candidate nodes, then place each attempt.

- :func:`start_cluster_probe` / :func:`finish_cluster_probe` (the flow validates the data meanwhile) measure the
  links between the nodes the job may use (a static cluster's nodes, a dynamic pool's live nodes) through their
  agents, cached by the nodes' fingerprint (``probe_cluster``); a kept report that already covers every candidate
  (same names, addresses, devices, ranks per node, younger than the cache expiration) is reused without
  measuring; a probe that fails leaves the job placeable (by load and name, ranks by the traffic model) with a
  warning.
- :func:`place_attempt` picks the attempt's nodes (cluster level) and which mesh rank each slot plays (node level)
  and records both: ``<run>/placement.attempt_<n>.json``, a Prefect artifact, and (by the flow) an MLflow artifact.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import task

from kuangchao_core.engine.traffic import group_traffic, link_report
from kuangchao_core.sched.multinode import place_cluster_attempt, probe_candidates
from kuangchao_core.sched.node_probe import covering_report
from kuangchao_core.sched.nodes import deployment_name
from kuangchao_core.sched.placement import cluster_pool
from kuangchao_core.sched.topology import TopologyReport
from tasks.probe_topology import CACHE_EXPIRATION, probe_cluster

log = logging.getLogger("kuangchao.flow")


def start_cluster_probe(cfg: Any, run_dir: str | Path, logger: Any = log) -> Any:
    """Start measuring ``cfg``'s candidate nodes: a kept report that covers them (returned as is), a running probe
    (a Prefect future, for :func:`finish_cluster_probe`), or None when no candidate is live."""
    candidates = probe_candidates(cfg)
    if not candidates:
        return None
    nproc = int(cfg.cluster.nproc_per_node or min(n.facts.slots for n in candidates))
    kept = covering_report(candidates, nproc, CACHE_EXPIRATION.total_seconds())
    if kept is not None:
        logger.info(
            "node topology: reusing the probe of %s measured at %s (it covers %s)",
            ", ".join(kept.nodes),
            kept.measured_at,
            ", ".join(n.name for n in candidates),
        )
        return kept
    return probe_cluster.submit(
        node_facts=[asdict(n.facts) for n in candidates],
        nproc=nproc,
        run_dir=str(run_dir),
        deployment=deployment_name(cluster_pool(cfg)),
    )


def finish_cluster_probe(started: Any, logger: Any = log) -> TopologyReport | None:
    """The report of :func:`start_cluster_probe` (waits for a running probe); None when it failed (warned)."""
    if started is None or isinstance(started, TopologyReport):
        return started
    try:
        return TopologyReport.from_dict(started.result())
    except Exception as exc:  # noqa: BLE001 - the job can still be placed without measured links
        logger.warning("node probe failed (%s); placing without measured links", exc)
        return None


def _markdown(record: dict[str, Any]) -> str:
    lines = [f"# Placement of attempt {record['attempt']} ({record['placement']['mode']})", ""]
    lines += ["| node | ranks | groups inside | groups across | bytes/step inside | bytes/step across |"]
    lines += ["|---|---|---|---|---|---|"]
    for row in record["links"]:
        inside = [g for g, v in row["groups"].items() if not v["crosses_nodes"]]
        across = [g for g, v in row["groups"].items() if v["crosses_nodes"]]
        lines.append(
            f"| {row['node']} | {row['ranks']} | {', '.join(inside) or '—'} | {', '.join(across) or '—'} | "
            f"{row['bytes_per_step_inside']:.4g} | {row['bytes_per_step_across']:.4g} |"
        )
    return "\n".join(lines) + "\n"


@task(name="place_attempt", retries=0)
def place_attempt(
    cfg: Any, exclude: list[str], topology: dict[str, Any] | None, run_dir: str, attempt: int
) -> dict[str, Any]:
    """Nodes and rank placement of one attempt: ``{"attempt", "assignments", "placement", "links"}``."""
    from prefect.artifacts import create_markdown_artifact

    report = TopologyReport.from_dict(topology) if topology else None
    assignments, placement = place_cluster_attempt(cfg, exclude, report, group_traffic(cfg))
    record = {
        "attempt": attempt,
        "assignments": [asdict(a) for a in assignments],
        "placement": placement.to_dict(),
        "links": link_report(placement, cfg),
        "measured": report is not None,
    }
    path = Path(run_dir) / f"placement.attempt_{attempt}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2), encoding="utf-8")
    tmp.replace(path)
    create_markdown_artifact(markdown=_markdown(record), key="kc-placement", description="Nodes and ranks")
    return record
