"""Prefect tasks around checkpoints: verify and record the newest one, mirror checkpoints to S3, restore from S3.

``checkpoint`` (after the last attempt) verifies the newest local checkpoint, uploads every intact local step that
S3 does not hold yet when ``checkpoint.uri`` is ``s3://…``, and logs per-checkpoint metadata (step, sha256, size,
URI) to MLflow. ``restore_checkpoint`` (before each attempt) downloads the newest intact S3 checkpoint into the
local checkpoint directory when the local one has none, so the workers' ``--resume auto`` finds it; corrupt newer
checkpoints are skipped, logged and recorded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from prefect import task

from kuangchao_core.ckpt.layout import parse_step_dir
from kuangchao_core.ckpt.reader import find_latest_intact, read_manifest, verify_checkpoint
from kuangchao_core.errors import CheckpointCorrupt, CheckpointError
from kuangchao_core.obs import tracking

log = logging.getLogger("kuangchao.tasks.checkpoint")


def task_dir_of(cfg: Any) -> Path:
    """``<checkpoint.dir>/<task.name>``: where the workers write and look for checkpoints."""
    return Path(cfg.checkpoint.dir) / cfg.task.name


def s3_settings_for(cfg: Any, secrets: dict[str, Any] | None = None):
    """``S3Settings`` for the job: a storage block's settings when one was resolved, else endpoint from the config and
    credentials from boto3's own chain (``AWS_ACCESS_KEY_ID`` … in the environment)."""
    from dataclasses import replace

    from kuangchao_core.ckpt.s3 import S3Settings

    settings = (secrets or {}).get("s3_settings") or S3Settings()
    if cfg.checkpoint.endpoint_url and not settings.endpoint_url:
        settings = replace(settings, endpoint_url=cfg.checkpoint.endpoint_url)
    if not settings.region and not os.environ.get("AWS_DEFAULT_REGION") and not os.environ.get("AWS_REGION"):
        settings = replace(settings, region="us-east-1")
    return settings


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_metadata(step_dir: Path, uri: str | None = None) -> dict[str, Any]:
    """Step, manifest sha256, total size, file count and URI of a local step directory."""
    manifest = read_manifest(step_dir)
    return {
        "step": int(manifest["step"]),
        "path": str(step_dir.resolve()),
        "files": len(manifest["files"]),
        "size_bytes": sum(int(f["size"]) for f in manifest["files"].values()),
        "manifest_sha256": _sha256_file(step_dir / "manifest.json"),
        "uri": uri or step_dir.resolve().as_uri(),
    }


def upload_intact(cfg: Any, settings=None, client=None) -> dict[int, str]:
    """Upload every intact local checkpoint that ``checkpoint.uri`` does not hold yet; ``{step: step URI}`` of all
    checkpoints present in S3 afterwards that also exist locally."""
    from kuangchao_core.ckpt.s3 import list_checkpoints, make_client, upload_checkpoint

    uri = cfg.checkpoint.uri
    s3 = client or make_client(settings)
    remote = dict(list_checkpoints(uri, cfg.task.name, client=s3))
    out: dict[int, str] = {}
    tdir = task_dir_of(cfg)
    for name in sorted(os.listdir(tdir)) if tdir.is_dir() else []:
        step = parse_step_dir(name)
        if step is None or not (tdir / name).is_dir():
            continue
        if step in remote:
            out[step] = remote[step]
            continue
        if verify_checkpoint(tdir / name):
            continue  # a torn or corrupt local step is never mirrored
        out[step] = upload_checkpoint(tdir / name, uri, cfg.task.name, client=s3, settings=settings)
        log.info("uploaded checkpoint step %d to %s", step, out[step])
    return out


def verify_and_record(cfg: Any, mlflow_run_id: str | None = None, settings=None) -> dict[str, Any]:
    """Find the newest intact checkpoint, mirror it (and older intact ones) to S3 when ``checkpoint.uri`` is set,
    log every checkpoint's metadata and the newest manifest to MLflow; return the newest one's metadata."""
    tdir = task_dir_of(cfg)
    step_dir = find_latest_intact(tdir) if tdir.exists() else None
    if step_dir is None:
        raise CheckpointCorrupt(f"no intact checkpoint under {tdir}; the job wrote none or all are corrupt")
    uploaded = upload_intact(cfg, settings) if cfg.checkpoint.uri else {}
    records = []
    for name in sorted(os.listdir(tdir)):
        step = parse_step_dir(name)
        if step is None or verify_checkpoint(tdir / name):
            continue
        records.append(checkpoint_metadata(tdir / name, uploaded.get(step)))
    summary = next(r for r in records if r["path"] == str(step_dir.resolve()))
    if mlflow_run_id:
        for rec in records:
            tracking.log_json_artifact(
                cfg, mlflow_run_id, rec, f"checkpoints/step_{rec['step']:08d}", "checkpoint.json"
            )
        tracking.log_json_artifact(
            cfg, mlflow_run_id, read_manifest(step_dir), f"checkpoints/step_{summary['step']:08d}", "manifest.json"
        )
        tracking.set_tags(
            cfg,
            mlflow_run_id,
            {
                "kuangchao.checkpoint.latest": json.dumps(summary),
                "kuangchao.checkpoint.latest_uri": summary["uri"],
            },
        )
    return summary


def restore_from_s3(cfg: Any, settings=None, client=None) -> dict[str, Any]:
    """Make the newest intact checkpoint available locally before an attempt.

    Nothing happens when ``checkpoint.uri`` is unset or the local directory already has an intact checkpoint.
    Otherwise S3's committed checkpoints are tried newest first; each one that fails its sha256/size check is
    skipped with a WARNING and listed under ``skipped``; the first that verifies lands in
    ``<checkpoint.dir>/<task>/step_<N>``. Returns ``{"source", "step", "path", "skipped": [{step, uri, reason}]}``.
    """
    from kuangchao_core.ckpt.s3 import download_checkpoint, list_checkpoints, make_client

    tdir = task_dir_of(cfg)
    local = find_latest_intact(tdir) if tdir.exists() else None
    if local is not None or not cfg.checkpoint.uri:
        step = parse_step_dir(local.name) if local else None
        return {
            "source": "local" if local else None,
            "step": step,
            "path": str(local) if local else None,
            "skipped": [],
        }
    s3 = client or make_client(settings)
    skipped: list[dict[str, Any]] = []
    for step, step_uri in reversed(list_checkpoints(cfg.checkpoint.uri, cfg.task.name, client=s3)):
        dest = tdir / step_uri.rsplit("/", 1)[-1]
        try:
            download_checkpoint(step_uri, dest, client=s3, settings=settings)
        except CheckpointError as exc:
            log.warning("skipping corrupt S3 checkpoint %s (step %d): %s", step_uri, step, exc)
            skipped.append({"step": step, "uri": step_uri, "reason": str(exc)})
            continue
        log.info("restored checkpoint step %d from %s into %s", step, step_uri, dest)
        return {"source": step_uri, "step": step, "path": str(dest), "skipped": skipped}
    return {"source": None, "step": None, "path": None, "skipped": skipped}


@task(name="checkpoint", retries=1, retry_delay_seconds=2)
def checkpoint(cfg: Any, mlflow_run_id: str | None = None, settings: Any = None) -> dict[str, Any]:
    """Prefect task: verify the newest checkpoint, mirror to S3, record in MLflow (see :func:`verify_and_record`)."""
    return verify_and_record(cfg, mlflow_run_id, settings)


@task(name="restore_checkpoint", retries=2, retry_delay_seconds=2)
def restore_checkpoint(cfg: Any, mlflow_run_id: str | None = None, settings: Any = None) -> dict[str, Any]:
    """Prefect task: :func:`restore_from_s3`; skipped corrupt checkpoints are tagged on the MLflow run."""
    result = restore_from_s3(cfg, settings)
    if mlflow_run_id and (result["skipped"] or (result["source"] or "").startswith("s3://")):
        tags = {"kuangchao.resume.source": str(result["source"])}
        if result["skipped"]:
            tags["kuangchao.resume.skipped"] = json.dumps(result["skipped"])[:5000]
        tracking.set_tags(cfg, mlflow_run_id, tags)
    return result
