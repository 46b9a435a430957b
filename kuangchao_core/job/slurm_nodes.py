"""A Slurm attempt's nodes in MLflow: ``attempt_<n>/slurm/nodes.json`` (each node's facts and leaf switch, written by
:func:`kuangchao_core.sched.slurm.facts.record_attempt_nodes` once the job runs) as the run's artifact
``slurm/attempt_<n>/nodes.json``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kuangchao_core.obs import tracking
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
