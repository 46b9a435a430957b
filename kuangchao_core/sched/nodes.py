"""The node registry (SPEC L4.3): which machines can run ranks, what they have, and whether they are alive.

The registry *is* the Prefect API. Each machine runs a node agent (``kc node start``): a Prefect worker of a
process work pool, polling a work queue named after the node, whose worker heartbeats say that the node is alive.
The agent publishes the node's facts (address and interface for training traffic, devices, versions, free memory)
as a Prefect variable ``kc_node__<pool>__<node>``. :func:`~kuangchao_core.sched.node_registry.list_nodes` joins
the two: facts plus liveness. This module holds the names, the facts and their probing, and imports no Prefect; the
Prefect side of the registry is :mod:`kuangchao_core.sched.node_registry` (issue 43 item 6).

A node counts as live when its worker (named ``kc-node-<node>``) is ONLINE and its last heartbeat is younger than
``LIVE_FACTOR`` heartbeat intervals.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from kuangchao_core.errors import ConfigError

#: the flow every node agent runs (``flows/node_agent.py``) and the deployment name it is reached by
AGENT_FLOW = "kuangchao-node-agent"
AGENT_ENTRYPOINT = "flows/node_agent.py:node_agent"
LIVE_FACTOR = 2.5
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def check_node_name(name: str, what: str = "node name") -> str:
    """``name`` if it can name a node (lowercase letters, digits, ``-`` and ``_``), else ConfigError."""
    if not _NAME.match(name or ""):
        raise ConfigError(
            [(what, f"{name!r} cannot name a node: use lowercase letters, digits, '-' and '_' (at most 63)")]
        )
    return name


def default_node_name() -> str:
    """This machine's hostname, made a valid node name."""
    name = re.sub(r"[^a-z0-9_-]", "-", socket.gethostname().lower()).strip("-_") or "node"
    return name[:63]


def worker_name(node: str) -> str:
    """The Prefect worker name of a node's agent."""
    return f"kc-node-{node}"


def facts_variable(pool: str, node: str) -> str:
    """The Prefect variable holding a node's facts."""
    return f"kc_node__{re.sub(r'[^a-z0-9_-]', '_', pool.lower())}__{node}"


def deployment_name(pool: str) -> str:
    """``flow/deployment`` of the node-agent deployment of ``pool``."""
    return f"{AGENT_FLOW}/{pool}"


@dataclass
class NodeFacts:
    """What a node agent publishes about its machine."""

    name: str
    address: str  # where other nodes reach this one for training traffic
    ifname: str | None = None  # the network interface of that address (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)
    device_kind: str = "cpu"
    device_count: int = 0
    cpu_count: int = 0
    cuda: str | None = None
    nccl: str | None = None
    torch: str | None = None
    free_memory_bytes: int | None = None
    started_at: str = ""
    gpu: dict[str, Any] | None = None  # driver, CUDA, NCCL, GPU names (gpu_versions.probe_gpu_versions)

    @property
    def slots(self) -> int:
        """Ranks this node can host by default: its GPUs, else its CPU cores (at least one)."""
        return self.device_count if self.device_kind != "cpu" and self.device_count else max(1, self.cpu_count)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeFacts:
        """Facts read back from the registry (unknown keys of a newer agent are ignored)."""
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class NodeStatus:
    """A registered node: its facts, whether its agent is alive, and its last heartbeat."""

    facts: NodeFacts
    live: bool
    last_heartbeat: str | None = None
    worker_status: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The node's name."""
        return self.facts.name

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``kc node list --json``)."""
        return {
            "name": self.name,
            "live": self.live,
            "last_heartbeat": self.last_heartbeat,
            "worker_status": self.worker_status,
            **asdict(self.facts),
        }


def _free_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def route_address(peer: str = "198.18.0.1") -> str:
    """The local address this machine uses to reach ``peer`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def local_facts(name: str, address: str | None = None, ifname: str | None = None) -> NodeFacts:
    """The facts of this machine: devices and versions from torch, free memory from ``/proc/meminfo``."""
    import torch

    from kuangchao_core.sched.gpu_versions import probe_gpu_versions

    kind, count, cuda, nccl = "cpu", 0, None, None
    if torch.cuda.is_available():
        kind, count, cuda = "cuda", torch.cuda.device_count(), torch.version.cuda
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a build without NCCL still runs Gloo
            nccl = None
    if address is None:
        api = os.environ.get("PREFECT_API_URL", "")
        host = re.sub(r"^\w+://", "", api).split("/")[0].split(":")[0]
        address = route_address(host) if host else route_address()
    return NodeFacts(
        name=check_node_name(name),
        address=address,
        ifname=ifname,
        device_kind=kind,
        device_count=count,
        cpu_count=os.cpu_count() or 1,
        cuda=cuda,
        nccl=nccl,
        torch=torch.__version__,
        free_memory_bytes=_free_memory_bytes(),
        started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        gpu=probe_gpu_versions(),
    )
