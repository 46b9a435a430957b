"""Prefect task ``checkpoint``: verify the newest checkpoint's manifest and record it in MLflow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import task

from kuangchao_core.ckpt.reader import find_latest_intact, read_manifest
from kuangchao_core.errors import CheckpointCorrupt
from kuangchao_core.obs import tracking


def verify_and_record(cfg: Any, mlflow_run_id: str | None = None) -> dict[str, Any]:
    """Find the newest intact checkpoint of the job, log its manifest and metadata to MLflow; return a summary."""
    task_dir = Path(cfg.checkpoint.dir) / cfg.task.name
    step_dir = find_latest_intact(task_dir) if task_dir.exists() else None
    if step_dir is None:
        raise CheckpointCorrupt(f"no intact checkpoint under {task_dir}; the job wrote none or all are corrupt")
    manifest = read_manifest(step_dir)
    total_size = sum(int(f["size"]) for f in manifest["files"].values())
    summary = {
        "step": int(manifest["step"]),
        "path": str(step_dir.resolve()),
        "files": len(manifest["files"]),
        "size_bytes": total_size,
        "manifest_sha256": _sha256_file(step_dir / "manifest.json"),
        "uri": cfg.checkpoint.uri or step_dir.resolve().as_uri(),
    }
    if mlflow_run_id:
        tracking.log_json_artifact(cfg, mlflow_run_id, manifest, f"checkpoints/step_{summary['step']:08d}", "manifest.json")
        tracking.log_json_artifact(cfg, mlflow_run_id, summary, f"checkpoints/step_{summary['step']:08d}", "checkpoint.json")
        tracking.set_tags(cfg, mlflow_run_id, {"kuangchao.checkpoint.latest": json.dumps(summary)})
    return summary


def _sha256_file(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@task(name="checkpoint", retries=1, retry_delay_seconds=2)
def checkpoint(cfg: Any, mlflow_run_id: str | None = None) -> dict[str, Any]:
    """Prefect task: verify the newest manifest, log it to MLflow (see :func:`verify_and_record`)."""
    return verify_and_record(cfg, mlflow_run_id)
