"""S3 checkpoints against moto's S3 server over real HTTP (no mocks in the client path)."""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

from kuangchao_core.ckpt.integrity import verify_checkpoint
from kuangchao_core.ckpt.reader import load_shard
from kuangchao_core.ckpt.rng import capture_rng_state
from kuangchao_core.ckpt.s3 import (
    S3Settings,
    abort_incomplete_uploads,
    download_checkpoint,
    find_latest_intact_s3,
    list_checkpoints,
    make_client,
    parse_s3_uri,
    upload_checkpoint,
    verify_s3_checkpoint,
)
from kuangchao_core.ckpt.writer import CheckpointWriter
from kuangchao_core.errors import CheckpointCorrupt, CheckpointError
from kuangchao_core.perm.guard_api import AllowAll, install_guard

TASK = "s3task"
BUCKET = "kc-ckpt"


@pytest.fixture
def settings(s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    s = S3Settings(
        endpoint_url=s3_endpoint,
        region="us-east-1",
        multipart_threshold=1 << 20,
        multipart_chunksize=5 << 20,  # S3's minimum part size
        max_concurrency=2,
    )
    client = make_client(s)
    # a fresh bucket per test: a free port number can repeat, and us-east-1 answers a re-create with success
    bucket = f"{BUCKET}-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=bucket)
    return s, client, f"s3://{bucket}/runs"


@pytest.fixture(autouse=True)
def allow_all():
    previous = install_guard(AllowAll())
    yield
    install_guard(previous)


def _save(root, step, value=1.0, big=False):
    writer = CheckpointWriter(root, TASK, 0, 1, barrier=lambda: None)
    n = 1600 if big else 64  # 1600x1600 fp32 ≈ 10 MB: a multipart upload with 5 MB parts
    tensors = {"param.w": torch.full((n, n), value), "param.b": torch.arange(10.0) + value}
    return writer.save(
        step, tensors, capture_rng_state(), state={"lr": 0.1, "step": step}, meta={"model": {}, "parallel": {}}
    )


def test_parse_uri():
    assert parse_s3_uri("s3://b/a/b/") == ("b", "a/b")
    assert parse_s3_uri("s3://b") == ("b", "")
    with pytest.raises(CheckpointError, match="s3://bucket/prefix"):
        parse_s3_uri("/local/path")


def test_roundtrip_multipart_and_resume_tensors(settings, tmp_path):
    s, client, uri = settings
    step_dir = _save(tmp_path / "local", 10, value=3.0, big=True)
    step_uri = upload_checkpoint(step_dir, uri, settings=s)
    assert step_uri == f"{uri}/{TASK}/step_00000010"
    bucket, _ = parse_s3_uri(uri)
    head = client.head_object(Bucket=bucket, Key=f"runs/{TASK}/step_00000010/shards/rank_00000.safetensors")
    assert head["ETag"].strip('"').endswith("-2"), head["ETag"]  # really multipart (ETag is not an MD5)
    assert list_checkpoints(uri, TASK, settings=s) == [(10, step_uri)]
    assert verify_s3_checkpoint(step_uri, settings=s) == []
    local = download_checkpoint(step_uri, tmp_path / "dl" / "step_00000010", settings=s)
    assert verify_checkpoint(local) == []
    tensors = load_shard(local, 0)
    assert torch.equal(tensors["param.w"], torch.full((1600, 1600), 3.0))
    assert torch.equal(tensors["param.b"], torch.arange(10.0) + 3.0)


def test_corrupt_object_detected(settings, tmp_path):
    s, client, uri = settings
    step_dir = _save(tmp_path / "local", 20)
    step_uri = upload_checkpoint(step_dir, uri, settings=s)
    bucket, _ = parse_s3_uri(uri)
    key = f"runs/{TASK}/step_00000020/shards/rank_00000.safetensors"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-1] ^= 0xFF  # same size, one flipped byte: only the sha256 can tell
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    problems = verify_s3_checkpoint(step_uri, settings=s)
    assert len(problems) == 1 and "rank_00000.safetensors" in problems[0] and "sha256" in problems[0]
    dest = tmp_path / "dl" / "step_00000020"
    with pytest.raises(CheckpointCorrupt, match="sha256"):
        download_checkpoint(step_uri, dest, settings=s)
    assert not dest.exists() and not list((tmp_path / "dl").iterdir())  # the partial download was removed


def test_manifest_never_overwritten(settings, tmp_path):
    s, client, uri = settings
    first = _save(tmp_path / "a", 30, value=1.0)
    second = _save(tmp_path / "b", 30, value=2.0)
    step_uri = upload_checkpoint(first, uri, settings=s)
    with pytest.raises(CheckpointError, match="already exists"):
        upload_checkpoint(second, uri, settings=s)
    # the conditional write itself refuses (412), even for a writer that skips the existence check
    bucket, _ = parse_s3_uri(uri)
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as ei:
        client.put_object(Bucket=bucket, Key=f"runs/{TASK}/step_00000030/manifest.json", Body=b"{}", IfNoneMatch="*")
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    local = download_checkpoint(step_uri, tmp_path / "dl" / "step_00000030", settings=s)
    assert torch.equal(load_shard(local, 0)["param.b"], torch.arange(10.0) + 1.0)  # the first commit is intact


def test_conditional_write_race_maps_412(settings, tmp_path, monkeypatch):
    """Two writers pass the existence check; the second one's manifest PUT gets 412 from the server."""
    s, client, uri = settings
    first = _save(tmp_path / "a", 40, value=1.0)
    second = _save(tmp_path / "b", 40, value=2.0)
    import kuangchao_core.ckpt.s3 as s3mod

    real = s3mod._object_exists
    monkeypatch.setattr(s3mod, "_object_exists", lambda *a: False)  # simulate the race window
    upload_checkpoint(first, uri, settings=s)
    with pytest.raises(CheckpointError, match="412"):
        upload_checkpoint(second, uri, settings=s)
    monkeypatch.setattr(s3mod, "_object_exists", real)


def test_latest_intact_skips_corrupt_newest(settings, tmp_path, caplog):
    s, client, uri = settings
    for step in (10, 20, 30):
        upload_checkpoint(_save(tmp_path / "local", step, value=float(step)), uri, settings=s)
    bucket, _ = parse_s3_uri(uri)
    # step 30: a shard replaced after the commit; an uncommitted step 40 (no manifest) must be ignored too
    key30 = f"runs/{TASK}/step_00000030/shards/rank_00000.safetensors"
    client.put_object(Bucket=bucket, Key=key30, Body=b"garbage")
    client.put_object(Bucket=bucket, Key=f"runs/{TASK}/step_00000040/state.json", Body=b"{}")
    assert [st for st, _ in list_checkpoints(uri, TASK, settings=s)] == [10, 20, 30]
    with caplog.at_level(logging.WARNING, logger="kuangchao.ckpt"):
        got = find_latest_intact_s3(uri, TASK, tmp_path / "cache", settings=s)
    assert got == tmp_path / "cache" / TASK / "step_00000020"
    assert torch.equal(load_shard(got, 0)["param.b"], torch.arange(10.0) + 20.0)
    assert any("step_00000030" in r.getMessage() and "skipping corrupt" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "cache" / TASK / "step_00000030").exists()


def test_latest_intact_none_and_abort_uploads(settings, tmp_path):
    s, client, uri = settings
    assert find_latest_intact_s3(uri, TASK, tmp_path / "cache", settings=s) is None
    bucket, _ = parse_s3_uri(uri)
    client.create_multipart_upload(Bucket=bucket, Key=f"runs/{TASK}/step_00000050/shards/rank_00000.safetensors")
    assert abort_incomplete_uploads(uri, settings=s) == 1
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_refuses_to_upload_corrupt_local(settings, tmp_path):
    s, _, uri = settings
    step_dir = _save(tmp_path / "local", 60)
    shard = step_dir / "shards" / "rank_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
    with pytest.raises(CheckpointCorrupt, match="refusing to upload"):
        upload_checkpoint(step_dir, uri, settings=s)
    assert list_checkpoints(uri, TASK, settings=s) == []
