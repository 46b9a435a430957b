"""The ``CheckpointStorage`` block: an S3 bucket and prefix, endpoint, region and credentials (secret)."""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator

from kuangchao_core.ckpt.s3 import S3Settings


class CheckpointStorage(Block):
    """S3 (or S3-compatible) storage for checkpoints; the secret key is stored encrypted by Prefect."""

    _block_type_name = "Kuangchao Checkpoint Storage"
    _block_type_slug = "kuangchao-checkpoint-storage"
    _description = "S3 bucket/prefix, endpoint, region and credentials for Kuangchao checkpoints."

    bucket: str = Field(min_length=3, description="bucket name")
    prefix: str = Field(default="", description="key prefix inside the bucket")
    endpoint_url: str | None = Field(default=None, description="custom endpoint (MinIO, Ceph, moto); None = AWS")
    region: str | None = Field(default=None, description="region name")
    access_key_id: str | None = Field(default=None, description="access key id; None = boto3's credential chain")
    secret_access_key: SecretStr | None = Field(default=None, description="secret access key")

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, value: str) -> str:
        if "/" in value or value.startswith("s3:"):
            raise ValueError(f"give the bare bucket name (put the path in 'prefix'), got {value!r}")
        return value

    @property
    def uri(self) -> str:
        """``s3://bucket/prefix``."""
        prefix = self.prefix.strip("/")
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def to_config(self) -> dict[str, Any]:
        """The ``checkpoint:`` fields this block stands for (no secrets: those go through ``s3_settings``)."""
        out: dict[str, Any] = {"uri": self.uri}
        if self.endpoint_url:
            out["endpoint_url"] = self.endpoint_url
        return out

    def s3_settings(self) -> S3Settings:
        """Connection settings for ``kuangchao_core.ckpt.s3`` including the credentials."""
        return S3Settings(
            endpoint_url=self.endpoint_url,
            region=self.region,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key.get_secret_value() if self.secret_access_key else None,
        )
