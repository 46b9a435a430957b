"""Checkpoints on S3 (``checkpoint.uri: s3://bucket/prefix``), with boto3.

Layout mirrors the local one: ``s3://bucket/prefix/<task>/<lineage>/step_<N:08d>/<relpath>`` (functions take
``task`` as ``<task>/<lineage>``; a pre-lineage ``<task>/step_<N>`` still reads). S3 has no atomic update
across keys, so a step is *committed* by its ``manifest.json``, uploaded last with ``If-None-Match: *``: it is
created once and never overwritten (a second commit of the same step gets 412 → ``CheckpointError``). Data files
go up first, big ones as multipart uploads, each with an S3 SHA256 checksum. The ETag is never trusted for
integrity: every download is checked against the sha256 and size recorded in the manifest (moto, and some S3
implementations, accept a wrong client checksum), by the local verifier of ``ckpt.integrity``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kuangchao_core import guard_api
from kuangchao_core.ckpt.integrity import read_manifest, verify_checkpoint
from kuangchao_core.ckpt.layout import LOGGER_NAME, MANIFEST, parse_step_dir, task_of_step_dir
from kuangchao_core.config.bounded_json import MANIFEST_MAX_BYTES, BoundedJSONError, loads_bounded
from kuangchao_core.errors import CheckpointCorrupt, CheckpointError

logger = logging.getLogger(LOGGER_NAME)

_MB = 1 << 20


@dataclass(frozen=True)
class S3Settings:
    """How to reach the bucket. Unset fields fall back to boto3's own chain (env vars, ~/.aws, instance role)."""

    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    multipart_threshold: int = 64 * _MB
    multipart_chunksize: int = 16 * _MB
    max_concurrency: int = 4
    max_attempts: int = 5

    def __repr__(self) -> str:
        from kuangchao_core.config.secrets import redact_url

        key = f"{self.access_key_id[:4]}…" if self.access_key_id else None
        hidden = {"secret_access_key": self.secret_access_key, "session_token": self.session_token}
        shown = ", ".join(f"{k}={'***' if v else None}" for k, v in hidden.items())
        return f"S3Settings(endpoint_url={redact_url(self.endpoint_url)!r}, region={self.region!r}, access_key_id={key!r}, {shown})"


def make_client(settings: S3Settings | None = None):
    """A boto3 S3 client for ``settings`` (bounded retries with backoff, path-style addressing for custom endpoints)."""
    import boto3
    from botocore.config import Config

    s = settings or S3Settings()
    cfg = Config(
        retries={"max_attempts": s.max_attempts, "mode": "standard"},
        s3={"addressing_style": "path"} if s.endpoint_url else None,
    )
    return boto3.client(
        "s3",
        endpoint_url=s.endpoint_url,
        region_name=s.region,
        aws_access_key_id=s.access_key_id,
        aws_secret_access_key=s.secret_access_key,
        aws_session_token=s.session_token,
        config=cfg,
    )


def transfer_config(settings: S3Settings | None = None):
    """The boto3 ``TransferConfig`` (multipart threshold and part size) for ``settings``."""
    from boto3.s3.transfer import TransferConfig

    s = settings or S3Settings()
    return TransferConfig(
        multipart_threshold=s.multipart_threshold,
        multipart_chunksize=s.multipart_chunksize,
        max_concurrency=s.max_concurrency,
    )


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` → ``("bucket", "a/b")``; raises CheckpointError for anything else."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise CheckpointError(f"checkpoint URI {uri!r} is not an s3:// URI; write it as s3://bucket/prefix")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise CheckpointError(f"checkpoint URI {uri!r} names no bucket; write it as s3://bucket/prefix")
    return bucket, key.strip("/")


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def _uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def _error_code(exc: Exception) -> tuple[str, int]:
    resp = getattr(exc, "response", None) or {}
    code = str(resp.get("Error", {}).get("Code", ""))
    status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _safe_relpath(rel: str, where: str) -> str:
    norm = posixpath.normpath(rel)
    if not rel or rel.startswith("/") or norm.startswith("..") or norm != rel or "\\" in rel:
        raise CheckpointCorrupt(
            f"checkpoint {where}: manifest lists the unsafe path {rel!r}; refusing it (use another checkpoint)"
        )
    return rel


def _object_exists(client, bucket: str, key: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        client.head_object(Bucket=bucket, Key=key)
        return True
    except ClientError as exc:
        code, status = _error_code(exc)
        if status == 404 or code in ("404", "NoSuchKey", "NotFound"):
            return False
        raise


def _client(client, settings: S3Settings | None):
    return client if client is not None else make_client(settings)


def upload_checkpoint(
    local_step_dir: str | os.PathLike[str],
    uri: str,
    task: str | None = None,
    *,
    client=None,
    settings: S3Settings | None = None,
) -> str:
    """Upload an intact local step directory to ``<uri>/<task>/<step dir name>/``; returns that step URI.

    ``task`` defaults to the name of the step directory's parent (``<dir>/<task>/step_N``). The local copy is
    verified first; data files go up first (multipart above ``settings.multipart_threshold``), ``manifest.json``
    last with ``If-None-Match: *``. Raises ``CheckpointError`` when the step is already committed there (never
    overwritten; checked before any data file is sent, and enforced by the conditional write) or on S3 errors.
    """
    from botocore.exceptions import BotoCoreError, ClientError

    step_dir = Path(local_step_dir)
    task = task or step_dir.parent.name
    guard_api.check("checkpoint_write", f"checkpoint:{task.split('/')[0]}")  # ``task`` may be ``<task>/<lineage>``
    if parse_step_dir(step_dir.name) is None:
        raise CheckpointError(f"{step_dir} is not a step directory (step_<N:08d>); pass a published checkpoint")
    problems = verify_checkpoint(step_dir)
    if problems:
        raise CheckpointCorrupt(f"refusing to upload {step_dir}: it does not verify: {'; '.join(problems)}")
    manifest = read_manifest(step_dir)
    bucket, prefix = parse_s3_uri(uri)
    base = _join(prefix, task, step_dir.name)
    step_uri = _uri(bucket, base)
    s3 = _client(client, settings)
    tc = transfer_config(settings)
    manifest_key = f"{base}/{MANIFEST}"
    try:
        if _object_exists(s3, bucket, manifest_key):
            raise CheckpointError(
                f"checkpoint {step_uri} already exists (its {MANIFEST} is committed); "
                "committed checkpoints are never overwritten — delete it explicitly or save a different step"
            )
        for rel in sorted(manifest["files"]):
            _safe_relpath(rel, str(step_dir))
            s3.upload_file(
                str(step_dir / rel),
                bucket,
                f"{base}/{rel}",
                ExtraArgs={"ChecksumAlgorithm": "SHA256"},
                Config=tc,
            )
        body = (step_dir / MANIFEST).read_bytes()
        s3.put_object(
            Bucket=bucket,
            Key=manifest_key,
            Body=body,
            IfNoneMatch="*",
            ContentType="application/json",
            ChecksumAlgorithm="SHA256",
        )
    except ClientError as exc:
        code, status = _error_code(exc)
        if status == 412 or code == "PreconditionFailed":
            raise CheckpointError(
                f"checkpoint {step_uri} already exists: another writer committed {MANIFEST} first (412); "
                "the committed checkpoint was kept — save a different step or delete it explicitly"
            ) from None
        if status == 409 or code == "ConditionalRequestConflict":
            raise CheckpointError(
                f"checkpoint {step_uri}: a concurrent commit of the same step is in progress (409); retry the upload"
            ) from None
        raise CheckpointError(f"uploading {step_dir} to {step_uri} failed: {code or status} {exc}") from exc
    except BotoCoreError as exc:
        raise CheckpointError(
            f"uploading {step_dir} to {step_uri} failed: {exc}; check endpoint and credentials"
        ) from exc
    logger.info("uploaded checkpoint %s to %s", step_dir, step_uri, extra={"checkpoint_uri": step_uri})
    return step_uri


def _list_prefixes(s3, bucket: str, prefix: str) -> Iterator[str]:
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix + "/" if prefix else "", Delimiter="/"):
        for cp in page.get("CommonPrefixes", []):
            yield cp["Prefix"].rstrip("/").rsplit("/", 1)[-1]


def list_prefixes(uri: str, under: str, *, client=None, settings: S3Settings | None = None) -> list[str]:
    """Names of the "directories" directly below ``<uri>/<under>/`` (e.g. a task's lineages)."""
    bucket, prefix = parse_s3_uri(uri)
    return list(_list_prefixes(_client(client, settings), bucket, _join(prefix, under)))


def list_checkpoints(
    uri: str,
    task: str,
    *,
    committed_only: bool = True,
    client=None,
    settings: S3Settings | None = None,
) -> list[tuple[int, str]]:
    """Step checkpoints of ``task`` under ``uri`` as ``(step, step_uri)``, oldest first (steps parsed as integers).

    With ``committed_only`` (default) only steps whose ``manifest.json`` exists are listed.
    """
    bucket, prefix = parse_s3_uri(uri)
    s3 = _client(client, settings)
    task_prefix = _join(prefix, task)
    out = []
    for name in _list_prefixes(s3, bucket, task_prefix):
        step = parse_step_dir(name)
        if step is None:
            continue
        key = _join(task_prefix, name)
        if committed_only and not _object_exists(s3, bucket, f"{key}/{MANIFEST}"):
            continue
        out.append((step, _uri(bucket, key)))
    return sorted(out)


def _get_manifest(s3, bucket: str, base: str, where: str) -> tuple[bytes, dict[str, Any]]:
    from botocore.exceptions import ClientError

    try:
        body = s3.get_object(Bucket=bucket, Key=f"{base}/{MANIFEST}")["Body"].read()
    except ClientError as exc:
        code, status = _error_code(exc)
        if status == 404 or code in ("NoSuchKey", "404"):
            raise CheckpointCorrupt(
                f"checkpoint {where} is not usable: {MANIFEST} is missing (never committed)"
            ) from None
        raise CheckpointError(f"reading {where}/{MANIFEST} failed: {code or status} {exc}") from exc
    try:
        manifest = loads_bounded(body, max_bytes=MANIFEST_MAX_BYTES)
    except BoundedJSONError as exc:
        raise CheckpointCorrupt(f"checkpoint {where} is not usable: {MANIFEST} refused ({exc.reason})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointCorrupt(f"checkpoint {where} is not usable: {MANIFEST} has no 'files' table")
    return body, manifest


def download_checkpoint(
    uri_step: str,
    local_dir: str | os.PathLike[str],
    *,
    client=None,
    settings: S3Settings | None = None,
) -> Path:
    """Download committed checkpoint ``uri_step`` into the local step directory ``local_dir`` and verify it.

    Files land in a temporary sibling directory; only when every file's size and sha256 match the manifest (and
    the manifest's structure verifies) is it renamed to ``local_dir``, which is returned. Otherwise the partial
    download is removed and ``CheckpointCorrupt`` names each bad file. An existing ``local_dir`` is replaced.
    """
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, base = parse_s3_uri(uri_step)
    dest = Path(local_dir)
    guard_api.check("checkpoint_read", f"checkpoint:{task_of_step_dir(base)}")
    s3 = _client(client, settings)
    tc = transfer_config(settings)
    body, manifest = _get_manifest(s3, bucket, base, uri_step)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.download-{uuid.uuid4().hex[:8]}")
    try:
        for rel in sorted(manifest["files"]):
            _safe_relpath(rel, uri_step)
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                s3.download_file(bucket, f"{base}/{rel}", str(target), Config=tc)
            except ClientError as exc:
                code, status = _error_code(exc)
                if status == 404 or code in ("NoSuchKey", "404"):
                    raise CheckpointCorrupt(f"checkpoint {uri_step} is not usable: {rel}: missing") from None
                raise
        (tmp / MANIFEST).write_bytes(body)
        problems = verify_checkpoint(tmp)
        if problems:
            raise CheckpointCorrupt(f"checkpoint {uri_step} is not usable: {'; '.join(problems)}")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except (ClientError, BotoCoreError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"downloading {uri_step} failed: {exc}; check endpoint and credentials") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def verify_s3_checkpoint(uri_step: str, *, client=None, settings: S3Settings | None = None) -> list[str]:
    """Every problem of checkpoint ``uri_step`` in S3 (empty list = intact), streaming each object through sha256."""
    from botocore.exceptions import ClientError

    bucket, base = parse_s3_uri(uri_step)
    s3 = _client(client, settings)
    try:
        _, manifest = _get_manifest(s3, bucket, base, uri_step)
    except CheckpointCorrupt as exc:
        return [str(exc)]
    problems = []
    for rel, entry in sorted(manifest["files"].items()):
        try:
            _safe_relpath(rel, uri_step)
        except CheckpointCorrupt as exc:
            problems.append(str(exc))
            continue
        if not isinstance(entry, dict) or "sha256" not in entry or "size" not in entry:
            problems.append(f"{rel}: manifest entry lacks sha256/size")
            continue
        try:
            stream = s3.get_object(Bucket=bucket, Key=f"{base}/{rel}")["Body"]
        except ClientError as exc:
            code, status = _error_code(exc)
            problems.append(f"{rel}: missing" if status == 404 or code == "NoSuchKey" else f"{rel}: {code} {exc}")
            continue
        h, size = hashlib.sha256(), 0
        while chunk := stream.read(_MB):
            h.update(chunk)
            size += len(chunk)
        if size != entry["size"]:
            problems.append(f"{rel}: size {size} bytes, manifest says {entry['size']} (truncated or replaced)")
        elif h.hexdigest() != entry["sha256"]:
            problems.append(f"{rel}: sha256 {h.hexdigest()[:16]}… does not match the manifest")
    return problems


def find_latest_intact_s3(
    uri: str,
    task: str,
    cache_dir: str | os.PathLike[str],
    *,
    log: logging.Logger | None = None,
    client=None,
    settings: S3Settings | None = None,
) -> Path | None:
    """Download and return (as ``cache_dir/<task>/step_<N>``) the newest committed checkpoint that verifies.

    A newer checkpoint that fails (corrupt, missing file, bad manifest) is skipped with a WARNING naming the step and
    the reasons. A cached local copy that still verifies is reused without downloading. None when nothing verifies.
    """
    log = log or logger
    s3 = _client(client, settings)
    for step, step_uri in reversed(list_checkpoints(uri, task, client=s3)):
        local = Path(cache_dir) / task / step_uri.rsplit("/", 1)[-1]
        if local.is_dir() and not verify_checkpoint(local):
            return local
        try:
            return download_checkpoint(step_uri, local, client=s3, settings=settings)
        except CheckpointError as exc:
            log.warning(
                "skipping corrupt S3 checkpoint %s (step %d): %s",
                step_uri,
                step,
                exc,
                extra={"checkpoint": step_uri, "step": step, "problems": [str(exc)]},
            )
    return None


def abort_incomplete_uploads(uri: str, *, client=None, settings: S3Settings | None = None) -> int:
    """Abort every unfinished multipart upload under ``uri`` (left by a crashed writer; billed but invisible)."""
    bucket, prefix = parse_s3_uri(uri)
    s3 = _client(client, settings)
    n = 0
    resp = s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    for up in resp.get("Uploads", []):
        s3.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        n += 1
    return n
