"""Prefect blocks against a real local Prefect API (prefect_test_harness), registration via the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from kuangchao_core.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def _pem() -> str:
    return Ed25519PrivateKey.generate().private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode()


def test_register_with_prefect_cli(prefect_api):
    env = dict(os.environ, PREFECT_API_URL=prefect_api, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "prefect", "block", "register", "-m", "blocks"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        slugs = {
            client.read_block_type_by_slug(s).slug
            for s in ("kuangchao-cluster", "kuangchao-checkpoint-storage", "kuangchao-token-signing-key")
        }
    assert slugs == {"kuangchao-cluster", "kuangchao-checkpoint-storage", "kuangchao-token-signing-key"}


def test_save_load_and_resolve(prefect_api):
    from blocks import CheckpointStorage, KuangchaoCluster, NodeEntry, TokenSigningKey
    from blocks.resolve import resolve_blocks
    from kuangchao_core.config import config_from_dict

    CheckpointStorage(
        bucket="ckpts",
        prefix="team/a",
        endpoint_url="http://127.0.0.1:9000",
        region="eu-west-1",
        access_key_id="AKIA",
        secret_access_key="s3cr3t",
    ).save("my-s3", overwrite=True)
    KuangchaoCluster(
        mode="static", nodes=[NodeEntry(host="n1", gpus=8), NodeEntry(host="n2", gpus=8)], nproc_per_node=8
    ).save("two-nodes", overwrite=True)
    pem = _pem()
    TokenSigningKey(private_key_pem=pem).save("signer", overwrite=True)

    loaded = CheckpointStorage.load("my-s3")
    assert loaded.secret_access_key.get_secret_value() == "s3cr3t"
    assert "s3cr3t" not in repr(loaded)
    assert TokenSigningKey.load("signer").pem() == pem

    cfg = {
        "task": {"name": "t"},
        "checkpoint": {"storage_block": "my-s3", "interval": 5},
        "cluster": {"block": "two-nodes"},
        "permission": {"signing_key_block": "signer"},
        "parallel": {"data_parallel_size": 16},
    }
    secrets: dict = {}
    out = resolve_blocks(cfg, secrets)
    assert "storage_block" in cfg["checkpoint"]  # the input is not modified
    assert out["checkpoint"] == {"uri": "s3://ckpts/team/a", "endpoint_url": "http://127.0.0.1:9000", "interval": 5}
    assert out["cluster"]["nodes"] == [
        {"host": "n1", "gpus": 8, "role": "worker"},
        {"host": "n2", "gpus": 8, "role": "worker"},
    ]
    assert "signing_key_block" not in out["permission"] and "s3cr3t" not in repr(out) and pem not in repr(out)
    assert secrets["signing_key_pem"] == pem
    assert secrets["s3_settings"].secret_access_key == "s3cr3t" and secrets["s3_settings"].region == "eu-west-1"
    job = config_from_dict(out)  # the resolved dict validates against the real schema
    assert job.checkpoint.uri == "s3://ckpts/team/a" and job.cluster.devices == 16

    with pytest.raises(ConfigError, match="checkpoint.storage_block"):
        resolve_blocks({"task": {"name": "t"}, "checkpoint": {"storage_block": "nope"}})


def test_flow_config_loading_resolves_blocks_and_keeps_secrets_out(prefect_api, tmp_path):
    import yaml

    from blocks import CheckpointStorage
    from flows.train import load_job_config

    CheckpointStorage(bucket="bkt", prefix="p", access_key_id="AKIA2", secret_access_key="t0p-s3cr3t").save(
        "flow-s3", overwrite=True
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"task": {"name": "blk"}, "checkpoint": {"storage_block": "flow-s3"}}))
    secrets: dict = {}
    cfg = load_job_config(str(path), ["checkpoint.interval=3"], secrets)
    assert cfg.checkpoint.uri == "s3://bkt/p" and cfg.checkpoint.interval == 3
    assert secrets["s3_settings"].secret_access_key == "t0p-s3cr3t"
    assert "t0p-s3cr3t" not in cfg.to_yaml() and "AKIA2" not in cfg.to_yaml()  # what is written next to the run


def test_block_validation():
    from blocks import CheckpointStorage, KuangchaoCluster, TokenSigningKey

    with pytest.raises(ValueError, match="registry_url"):
        KuangchaoCluster(mode="dynamic")
    assert KuangchaoCluster(mode="dynamic", registry_url="http://reg:8000").to_config() == {
        "mode": "dynamic",
        "registry": "http://reg:8000",
    }
    with pytest.raises(ValueError, match="bare bucket"):
        CheckpointStorage(bucket="s3://x/y")
    with pytest.raises(ValueError, match="PEM"):
        TokenSigningKey(private_key_pem="not a key")
    key = TokenSigningKey(private_key_pem=_pem())
    assert key.public_key_pem().startswith("-----BEGIN PUBLIC KEY-----")
