"""The ``kuangchao-train`` flow: the whole job lifecycle as Prefect tasks.

    doctor → probe_topology → validate_data → issue_tokens → launch → (recover → launch)* → checkpoint

``kc train`` runs this flow in-process (Prefect's ephemeral API unless ``PREFECT_API_URL`` is set); a Prefect
deployment runs the same flow on a worker. MLflow holds one run per flow run: params = flattened config, per-step
metrics from rank 0, checkpoint manifests as artifacts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from kuangchao_core.config import load_config
from kuangchao_core.errors import WorkerFailed
from kuangchao_core.obs import tracking
from tasks.checkpoint import checkpoint
from tasks.doctor import doctor
from tasks.issue_tokens import issue_tokens
from tasks.launch import launch
from tasks.probe_topology import probe_topology
from tasks.recover import recover
from tasks.validate_data import validate_data


def make_run_dir(cfg: Any, flow_run_id: str | None) -> Path:
    """``runs/<task>/<UTC time>-<flow run id>/``: resolved config, launcher logs, tokens, reports."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    run_dir = Path(os.environ.get("KC_RUNS_DIR", "runs")) / cfg.task.name / f"{stamp}-{(flow_run_id or 'local')[:8]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _summary_markdown(cfg: Any, summary: dict[str, Any]) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    return f"# Kuangchao run summary: {cfg.task.name}\n\n| field | value |\n|---|---|\n{rows}\n"


@flow(name="kuangchao-train", log_prints=True)
def train_flow(config_path: str, overrides: list[str] | None = None, resume: str | None = None) -> dict[str, Any]:
    """Run a training job end to end from a YAML config (plus ``--set`` style overrides)."""
    logger = get_run_logger()
    cfg = load_config(config_path, list(overrides or []))
    fr_id = flow_run.get_id()
    run_dir = make_run_dir(cfg, fr_id)
    resolved = run_dir / "config.yaml"
    resolved.write_text(cfg.to_yaml(), encoding="utf-8")
    logger.info("resolved config written to %s", resolved)

    doctor(cfg)
    probe_topology(cfg)
    run_id = tracking.open_run(cfg, fr_id)
    logger.info("MLflow run %s (experiment %s, store %s)", run_id, tracking.experiment_name(cfg), cfg.tracking.uri)
    t0 = time.time()
    attempts = 0
    try:
        validate_data(cfg, mlflow_run_id=run_id)
        resume_arg = resume or cfg.checkpoint.resume
        result: dict[str, Any] | None = None
        max_restarts = cfg.cluster.max_restarts
        for attempt in range(max_restarts + 1):
            attempts = attempt + 1
            env = issue_tokens(cfg, str(run_dir), attempt)
            try:
                result = launch(cfg, str(resolved), str(run_dir), attempt, resume_arg, run_id, env)
                break
            except WorkerFailed as exc:
                if attempt == max_restarts:
                    raise WorkerFailed(
                        exc.rank, f"{exc.cause}; gave up after {attempts} attempts", exc.exit_code
                    ) from exc
                recover(cfg, attempt, str(exc), run_id)
                resume_arg = "auto"
        assert result is not None
        ckpt = checkpoint(cfg, run_id)
        summary = {
            "task": cfg.task.name,
            "layout": tracking.layout_tag(cfg),
            "steps": result["steps"],
            "final_loss": result["final_loss"],
            "tokens_per_s": result["tokens_per_s"],
            "heldout_accuracy": result["heldout_accuracy"],
            "loss_floor": result["loss_floor"],
            "attempts": attempts,
            "checkpoint_step": ckpt["step"],
            "checkpoint_path": ckpt["path"],
            "mlflow_run_id": run_id,
            "wall_s": round(time.time() - t0, 1),
            "run_dir": str(run_dir),
        }
        create_markdown_artifact(_summary_markdown(cfg, summary), key="kuangchao-run-summary", description="training run summary")
        tracking.log_json_artifact(cfg, run_id, summary, "summary", "summary.json")
        tracking.close_run(cfg, run_id, "FINISHED")
        return summary
    except BaseException:
        tracking.close_run(cfg, run_id, "FAILED")
        raise
