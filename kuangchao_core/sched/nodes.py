"""The node registry (SPEC L4.3): which machines can run ranks, what they have, and whether they are alive.

The registry *is* the Prefect API. Each machine runs a node agent (``kc node start``): a Prefect worker of a
process work pool, polling a work queue named after the node, whose worker heartbeats say that the node is alive.
The agent publishes the node's facts (address and interface for training traffic, devices, versions, free memory)
as a Prefect variable ``kc_node__<pool>__<node>``. :func:`list_nodes` joins the two: facts plus liveness.

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


# ---------------------------------------------------------------------------------------------- Prefect API
def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def ensure_pool(pool: str) -> None:
    """Create the process work pool ``pool`` when it does not exist."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with _client() as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            try:
                client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            except ObjectAlreadyExists:
                pass


def ensure_queue(pool: str, node: str) -> None:
    """Create the work queue of ``node`` in ``pool`` when it does not exist."""
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with _client() as client:
        try:
            client.read_work_queue_by_name(node, work_pool_name=pool)
        except ObjectNotFound:
            try:
                client.create_work_queue(name=node, work_pool_name=pool)
            except ObjectAlreadyExists:
                pass


def ensure_agent_deployment(pool: str, project_dir: str) -> None:
    """Create (or update) the node-agent deployment of ``pool``: the flow runs from ``project_dir`` on the node."""
    with _client() as client:
        flow_id = client.create_flow_from_name(AGENT_FLOW)
        client.create_deployment(
            flow_id=flow_id,
            name=pool,
            work_pool_name=pool,
            entrypoint=AGENT_ENTRYPOINT,
            path=project_dir,
            pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": project_dir}}],
            description="Runs one node's share of a Kuangchao job (torch.distributed.run with a c10d rendezvous)",
            tags=["kuangchao", "node-agent"],
            enforce_parameter_schema=False,
        )


def publish_facts(pool: str, facts: NodeFacts) -> None:
    """Store ``facts`` in the registry (overwrites the node's earlier facts)."""
    from prefect.variables import Variable

    Variable.set(facts_variable(pool, facts.name), asdict(facts), tags=["kuangchao", "node"], overwrite=True)


def _age_s(when: datetime | None) -> float | None:
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - when).total_seconds()


def list_nodes(pool: str) -> list[NodeStatus]:
    """Every node that published facts for ``pool``, with liveness from its worker's heartbeat, by name."""
    prefix = facts_variable(pool, "")
    with _client() as client:
        variables = [v for v in client.read_variables() if v.name.startswith(prefix)]
        try:
            workers = {w.name: w for w in client.read_workers_for_work_pool(pool)}
        except Exception:  # noqa: BLE001 - no pool yet: no live workers
            workers = {}
    out = []
    for var in variables:
        if not isinstance(var.value, dict):
            continue
        facts = NodeFacts.from_dict(var.value)
        w = workers.get(worker_name(facts.name))
        age = _age_s(w.last_heartbeat_time) if w else None
        interval = float(getattr(w, "heartbeat_interval_seconds", None) or 30) if w else 30.0
        status = str(getattr(w.status, "value", w.status)) if w else None
        live = bool(w) and status == "ONLINE" and age is not None and age < LIVE_FACTOR * interval
        out.append(
            NodeStatus(facts, live, w.last_heartbeat_time.isoformat() if w and w.last_heartbeat_time else None, status)
        )
    return sorted(out, key=lambda n: n.name)


def running_shares(pool: str) -> dict[str, int]:
    """Node shares (node-agent flow runs) running or about to run on each node of ``pool``: the node's load."""
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    flow_name, _, dep_name = deployment_name(pool).partition("/")
    busy = FlowRunFilter(
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]))
    )
    try:
        with _client() as client:
            runs = client.read_flow_runs(
                flow_run_filter=busy, deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[dep_name]))
            )
    except Exception:  # noqa: BLE001 - no deployment yet: nothing runs
        return {}
    out: dict[str, int] = {}
    for run in runs:
        if run.work_queue_name:
            out[run.work_queue_name] = out.get(run.work_queue_name, 0) + 1
    return out
