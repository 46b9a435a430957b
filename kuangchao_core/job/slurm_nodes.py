"""A Slurm attempt's nodes and placement in the run's records (issue 32 §5).

- ``attempt_<n>/slurm/nodes.json`` (each node's facts and leaf switch, written by
  :func:`kuangchao_core.sched.slurm.facts.record_attempt_nodes` once the job runs) as the MLflow artifact
  ``slurm/attempt_<n>/nodes.json``;
- the job's own placement (``attempt_<n>/slurm/placement.json``, :mod:`kuangchao_core.sched.slurm.placement`)
  recorded as on the node-agent path: ``<run>/placement.attempt_<n>.json`` with the bytes each node's groups move
  inside and across nodes, the MLflow artifacts ``placement/attempt_<n>.json`` (and ``topology/attempt_<n>.json``
  when the job measured its links) and the ``kc-placement`` Prefect artifact.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kuangchao_core.engine.traffic import link_report
from kuangchao_core.job.placement_record import placement_markdown, save_record
from kuangchao_core.obs import tracking
from kuangchao_core.obs.run_hooks import NO_HOOKS, RunHooks
from kuangchao_core.sched.rank_placement import RankPlacement
from kuangchao_core.sched.slurm.script import slurm_dir


def log_slurm_nodes(
    cfg: Any, run_id: str | None, run_dir: str | Path, attempt: int, say: Callable[[str], None]
) -> bool:
    """Log the attempt's ``nodes.json`` to MLflow run ``run_id`` when the job ran (True when logged). A store that
    refuses is said, not raised: the attempt's own outcome must not be hidden by it."""
    path = slurm_dir(run_dir, attempt) / "nodes.json"
    if not run_id or not path.is_file():
        return False
    try:
        tracking.log_file_artifact(cfg, run_id, path, f"slurm/attempt_{attempt}")
    except Exception as exc:  # noqa: BLE001 - MLflow's client raises many kinds; the file stays in the run directory
        say(f"could not log {path} to MLflow: {type(exc).__name__}: {exc}")
        return False
    return True


def record_slurm_placement(
    cfg: Any,
    run_id: str | None,
    run_dir: str | Path,
    attempt: int,
    placed: dict[str, Any],
    say: Callable[[str], None],
    hooks: RunHooks = NO_HOOKS,
) -> dict[str, Any]:
    """The run's record of the placement the Slurm job made (``placed``: its ``placement.json``): written to the
    run directory and logged to MLflow and, through ``hooks`` (the orchestrator's), Prefect as the other paths'
    placements are; returns the record."""
    placement = RankPlacement.from_dict(placed["placement"])
    record = {
        "attempt": attempt,
        "job_id": placed.get("job_id", ""),
        "assignments": [
            {
                "name": n["name"],
                "address": n["address"],
                "ifname": None,
                "node_rank": n["node_rank"],
                "nproc": placement.nproc,
            }
            for n in placed["nodes"]
        ],  # fmt: skip
        "placement": placed["placement"],
        "links": link_report(placement, cfg),
        "measured": bool(placed.get("measured")),
        "warning": placed.get("warning"),
    }
    save_record(run_dir, attempt, record)
    try:
        if run_id:
            tracking.log_json_artifact(cfg, run_id, record, "placement", f"attempt_{attempt}.json")
            if placed.get("topology"):
                tracking.log_json_artifact(cfg, run_id, placed["topology"], "topology", f"attempt_{attempt}.json")
    except Exception as exc:  # noqa: BLE001 - the record stays in the run directory; the job goes on
        say(f"could not log the placement of attempt {attempt} to MLflow: {type(exc).__name__}: {exc}")
    try:
        hooks.artifact(placement_markdown(record), "kc-placement", "Nodes and ranks")
    except Exception:  # noqa: BLE001 - outside a flow run there is no artifact to make; the files are kept
        pass
    return record
