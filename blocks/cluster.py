"""The ``KuangchaoCluster`` block: a static node list or a dynamic registry URL (L4.3)."""

from __future__ import annotations

from typing import Any, Literal

from prefect.blocks.core import Block
from pydantic import BaseModel, Field, model_validator


class NodeEntry(BaseModel):
    """One machine of a static cluster."""

    host: str = Field(min_length=1)
    gpus: int = Field(default=0, ge=0)
    role: Literal["worker", "parameter_server", "coordinator"] = "worker"


class KuangchaoCluster(Block):
    """Where a job's workers run: ``static`` (``nodes``) or ``dynamic`` (nodes register with ``registry_url``)."""

    _block_type_name = "Kuangchao Cluster"
    _block_type_slug = "kuangchao-cluster"
    _description = "Nodes of a Kuangchao training cluster: a static list or a registry URL for dynamic discovery."

    mode: Literal["static", "dynamic"] = Field(default="static", description="static node list or dynamic registry")
    nodes: list[NodeEntry] = Field(default_factory=list, description="static nodes (host, gpus, role)")
    nproc_per_node: int | None = Field(default=None, ge=1, description="training processes per node")
    registry_url: str | None = Field(default=None, description="registry that live nodes register with (dynamic)")

    @model_validator(mode="after")
    def _complete(self) -> KuangchaoCluster:
        if self.mode == "static" and not self.nodes:
            raise ValueError("a static cluster needs at least one node (host, gpus, role) in 'nodes'")
        if self.mode == "dynamic" and not self.registry_url:
            raise ValueError("a dynamic cluster needs 'registry_url' (where nodes register)")
        return self

    def to_config(self) -> dict[str, Any]:
        """The ``cluster:`` section of a job config this block stands for."""
        out: dict[str, Any] = {"mode": self.mode}
        if self.mode == "static":
            out["nodes"] = [n.model_dump() for n in self.nodes]
        else:
            out["registry"] = self.registry_url
        if self.nproc_per_node is not None:
            out["nproc_per_node"] = self.nproc_per_node
        return out
