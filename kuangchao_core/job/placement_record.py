"""A multi-node job's placement as the orchestrator handles it (the work of ``tasks/place_attempt.py``).

- :func:`cluster_probe_request` / :func:`finish_cluster_probe` (the flow validates the data meanwhile) measure the
  links between the nodes the job may use (a static cluster's nodes, a dynamic pool's live nodes) through their
  agents, cached by the nodes' fingerprint; a kept report that already covers every candidate (same names,
  addresses, devices, ranks per node, younger than the cache expiration) is reused without measuring; a probe
  that fails leaves the job placeable (by load and name, ranks by the traffic model) with a warning.
- :func:`place_and_record` picks the attempt's nodes (cluster level) and which mesh rank each slot plays (node
  level) and records both in ``<run>/placement.attempt_<n>.json``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kuangchao_core.engine.traffic import group_traffic, link_report
from kuangchao_core.job.topology_probe import CACHE_EXPIRATION
from kuangchao_core.sched.multinode import place_cluster_attempt, probe_candidates
from kuangchao_core.sched.node_probe import covering_report
from kuangchao_core.sched.nodes import deployment_name
from kuangchao_core.sched.placement import cluster_pool
from kuangchao_core.sched.topology import TopologyReport

log = logging.getLogger("kuangchao.flow")


def cluster_probe_request(cfg: Any, run_dir: str | Path, logger: Any = log) -> tuple[Any, dict[str, Any] | None]:
    """``(kept report, None)`` when a kept report covers ``cfg``'s candidate nodes, ``(None, probe arguments)`` when
    they must be measured (the arguments of the ``probe_cluster_topology`` task), ``(None, None)`` when no candidate
    is live."""
    candidates = probe_candidates(cfg)
    if not candidates:
        return None, None
    nproc = int(cfg.cluster.nproc_per_node or min(n.facts.slots for n in candidates))
    kept = covering_report(candidates, nproc, CACHE_EXPIRATION.total_seconds())
    if kept is not None:
        logger.info(
            "node topology: reusing the probe of %s measured at %s (it covers %s)",
            ", ".join(kept.nodes),
            kept.measured_at,
            ", ".join(n.name for n in candidates),
        )
        return kept, None
    request = {
        "node_facts": [asdict(n.facts) for n in candidates],
        "nproc": nproc,
        "run_dir": str(run_dir),
        "deployment": deployment_name(cluster_pool(cfg)),
    }
    return None, request


def finish_cluster_probe(started: Any, logger: Any = log) -> TopologyReport | None:
    """The report of a started probe (a kept report, or a future whose ``result()`` is the measured report's dict:
    waits for it); None when none was started or it failed (warned)."""
    if started is None or isinstance(started, TopologyReport):
        return started
    try:
        return TopologyReport.from_dict(started.result())
    except Exception as exc:  # noqa: BLE001 - the job can still be placed without measured links
        logger.warning("node probe failed (%s); placing without measured links", exc)
        return None


def placement_markdown(record: dict[str, Any]) -> str:
    """The placement record as a markdown table (the ``kc-placement`` artifact)."""
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


def place_and_record(
    cfg: Any, exclude: list[str], topology: dict[str, Any] | None, run_dir: str, attempt: int
) -> dict[str, Any]:
    """Nodes and rank placement of one attempt, written to ``<run_dir>/placement.attempt_<n>.json``:
    ``{"attempt", "assignments", "placement", "links", "measured"}``."""
    report = TopologyReport.from_dict(topology) if topology else None
    assignments, placement = place_cluster_attempt(cfg, exclude, report, group_traffic(cfg))
    record = {
        "attempt": attempt,
        "assignments": [asdict(a) for a in assignments],
        "placement": placement.to_dict(),
        "links": link_report(placement, cfg),
        "measured": report is not None,
    }
    save_record(run_dir, attempt, record)
    return record


def save_record(run_dir: str | Path, attempt: int, record: dict[str, Any]) -> Path:
    """Write an attempt's placement record to ``<run_dir>/placement.attempt_<n>.json`` (atomically)."""
    path = Path(run_dir) / f"placement.attempt_{attempt}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2), encoding="utf-8")
    tmp.replace(path)
    return path
