"""The job's checkpoints as the orchestrator handles them: verify and record the newest one, mirror checkpoints to
S3, restore from S3 (the work of the Prefect tasks in ``tasks/checkpoint.py``).

Every function works on one lineage (``<checkpoint.dir>/<task>/<lineage>/``, see ``kuangchao_core.ckpt.lineage``): a
run records, uploads and reports its own checkpoints only. ``verify_and_record`` (after the last attempt) verifies the
lineage's newest checkpoint, uploads every intact step of the lineage that S3 does not hold yet when
``checkpoint.uri`` is ``s3://…`` (``<uri>/<task>/<lineage>/step_<N>``), and logs per-checkpoint metadata (step,
sha256, size, URI) to MLflow. ``restore_from_s3`` (before planning a resume) downloads the newest intact S3
checkpoint of the newest S3 lineage when no local lineage has one, so ``resume: auto`` finds it; corrupt newer
checkpoints are skipped, logged and recorded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from kuangchao_core.ckpt.layout import parse_step_dir
from kuangchao_core.ckpt.lineage import LEGACY, create_lineage, lineage_dir, list_lineages, task_dir
from kuangchao_core.ckpt.reader import find_latest_intact, read_manifest, verify_checkpoint
from kuangchao_core.config.settings import lineage_key
from kuangchao_core.errors import CheckpointCorrupt, CheckpointError
from kuangchao_core.obs import tracking

log = logging.getLogger("kuangchao.tasks.checkpoint")


def task_dir_of(cfg: Any) -> Path:
    """``<checkpoint.dir>/<task.name>``: the task's lineages live below it."""
    return task_dir(lineage_key(cfg))


def _s3_task(cfg: Any, lineage: str) -> str:
    """The S3 key part below ``checkpoint.uri`` of a lineage: ``<task>/<lineage>`` (``<task>`` for ``legacy``)."""
    return cfg.task.name if lineage == LEGACY else f"{cfg.task.name}/{lineage}"


def s3_settings_for(cfg: Any, secrets: dict[str, Any] | None = None):
    """``S3Settings`` for the job: a storage block's settings when one was resolved, else endpoint from the config and
    credentials from boto3's own chain (``AWS_ACCESS_KEY_ID`` … in the environment)."""
    from dataclasses import replace

    from kuangchao_core.ckpt.s3 import S3Settings

    settings = (secrets or {}).get("s3_settings") or S3Settings()
    if cfg.checkpoint.endpoint_url and not settings.endpoint_url:
        settings = replace(settings, endpoint_url=cfg.checkpoint.endpoint_url)
    user, password = (secrets or {}).get("s3_url_credentials") or (None, None)
    if user is not None and not settings.access_key_id:  # credentials that came inside the endpoint URL
        settings = replace(settings, access_key_id=user, secret_access_key=password)
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


def upload_intact(cfg: Any, settings=None, client=None, lineage: str | None = None) -> dict[int, str]:
    """Upload every intact local checkpoint of ``lineage`` (default: the newest) that ``checkpoint.uri`` does not
    hold yet; ``{step: step URI}`` of all its checkpoints present in S3 afterwards that also exist locally."""
    from kuangchao_core.ckpt.s3 import list_checkpoints, make_client, upload_checkpoint

    lineage = lineage or _newest_lineage(cfg)
    uri = cfg.checkpoint.uri
    s3 = client or make_client(settings)
    s3_task = _s3_task(cfg, lineage)
    remote = dict(list_checkpoints(uri, s3_task, client=s3))
    out: dict[int, str] = {}
    tdir = lineage_dir(lineage_key(cfg), lineage)
    for name in sorted(os.listdir(tdir)) if tdir.is_dir() else []:
        step = parse_step_dir(name)
        if step is None or not (tdir / name).is_dir():
            continue
        if step in remote:
            out[step] = remote[step]
            continue
        if verify_checkpoint(tdir / name):
            continue  # a torn or corrupt local step is never mirrored
        out[step] = upload_checkpoint(tdir / name, uri, s3_task, client=s3, settings=settings)
        log.info("uploaded checkpoint step %d to %s", step, out[step])
    return out


def _newest_lineage(cfg: Any) -> str:
    found = list_lineages(task_dir_of(cfg))
    if not found:
        raise CheckpointCorrupt(f"no checkpoint lineage under {task_dir_of(cfg)}; the job wrote no checkpoint")
    return found[-1].name


def verify_and_record(
    cfg: Any, mlflow_run_id: str | None = None, settings=None, lineage: str | None = None
) -> dict[str, Any]:
    """Find the newest intact checkpoint of ``lineage`` (default: the task's newest lineage), mirror it (and the
    lineage's older intact ones) to S3 when ``checkpoint.uri`` is set, log each one's metadata and the newest
    manifest to MLflow; return the newest one's metadata plus ``steps`` (every intact step of the lineage)."""
    lineage = lineage or _newest_lineage(cfg)
    tdir = lineage_dir(lineage_key(cfg), lineage)
    step_dir = find_latest_intact(tdir) if tdir.exists() else None
    if step_dir is None:
        raise CheckpointCorrupt(f"no intact checkpoint under {tdir}; the job wrote none or all are corrupt")
    uploaded = upload_intact(cfg, settings, lineage=lineage) if cfg.checkpoint.uri else {}
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
    return {**summary, "lineage": lineage, "steps": [r["step"] for r in records]}


def _s3_lineages(cfg: Any, s3) -> list[str]:
    """Lineage names under ``<uri>/<task>/`` in S3, newest first (``legacy`` last when bare steps exist)."""
    from kuangchao_core.ckpt.layout import is_lineage_name
    from kuangchao_core.ckpt.s3 import list_checkpoints, list_prefixes

    names = sorted(n for n in list_prefixes(cfg.checkpoint.uri, cfg.task.name, client=s3) if is_lineage_name(n))
    out = list(reversed(names))
    if list_checkpoints(cfg.checkpoint.uri, cfg.task.name, client=s3):
        out.append(LEGACY)
    return out


def restore_from_s3(cfg: Any, settings=None, client=None) -> dict[str, Any]:
    """Make the newest intact checkpoint available locally before a run plans its resume.

    Nothing happens when ``checkpoint.uri`` is unset or a local lineage already has an intact checkpoint.
    Otherwise the newest S3 lineage's committed checkpoints are tried newest first; each one that fails its
    sha256/size check is skipped with a WARNING and listed under ``skipped``; the first that verifies lands in
    ``<checkpoint.dir>/<task>/<lineage>/step_<N>``. Returns ``{"source", "step", "path", "lineage",
    "skipped": [{step, uri, reason}]}``.
    """
    from kuangchao_core.ckpt.s3 import download_checkpoint, list_checkpoints, make_client

    local = None
    for lin in reversed(list_lineages(task_dir_of(cfg))):
        local = find_latest_intact(lin.path)
        if local is not None:
            break
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
    for lineage in _s3_lineages(cfg, s3):
        for step, step_uri in reversed(list_checkpoints(cfg.checkpoint.uri, _s3_task(cfg, lineage), client=s3)):
            tdir = create_lineage(lineage_key(cfg), lineage) if lineage != LEGACY else task_dir_of(cfg)
            dest = tdir / step_uri.rsplit("/", 1)[-1]
            try:
                download_checkpoint(step_uri, dest, client=s3, settings=settings)
            except CheckpointError as exc:
                log.warning("skipping corrupt S3 checkpoint %s (step %d): %s", step_uri, step, exc)
                skipped.append({"step": step, "uri": step_uri, "reason": str(exc)})
                continue
            log.info("restored checkpoint step %d from %s into %s", step, step_uri, dest)
            return {"source": step_uri, "step": step, "path": str(dest), "lineage": lineage, "skipped": skipped}
        if skipped:
            break  # the newest lineage had checkpoints, all corrupt: do not silently fall back to an older run
    return {"source": None, "step": None, "path": None, "lineage": None, "skipped": skipped}


def restore_and_tag(cfg: Any, mlflow_run_id: str | None = None, settings: Any = None) -> dict[str, Any]:
    """:func:`restore_from_s3`; skipped corrupt checkpoints (and an S3 source) are tagged on the MLflow run."""
    result = restore_from_s3(cfg, settings)
    if mlflow_run_id and (result["skipped"] or (result["source"] or "").startswith("s3://")):
        tags = {"kuangchao.resume.source": str(result["source"])}
        if result["skipped"]:
            tags["kuangchao.resume.skipped"] = json.dumps(result["skipped"])[:5000]
        tracking.set_tags(cfg, mlflow_run_id, tags)
    return result
