"""Which nodes run a multi-node attempt, and which ranks each hosts (SPEC L4.3).

- ``cluster.mode: static``: exactly the configured worker nodes, each matched to a registered agent by name or
  address; a node without a live agent fails the launch before any rank starts, naming it.
- ``cluster.mode: dynamic`` (``registry: prefect://POOL``): live nodes of the pool, by name, until the world size
  is covered (``cluster.nproc_per_node`` ranks each, else the node's own device count or CPU cores).

Nodes are then ordered by their address as a string — the order in which torch's c10d rendezvous ranks the nodes
that announce those addresses — so node ``i`` hosts global ranks ``[i * nproc, (i + 1) * nproc)`` and the first
node hosts the rendezvous. Nodes lost in an earlier attempt are left out (``exclude``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kuangchao_core.errors import KuangchaoError
from kuangchao_core.sched.nodes import NodeStatus


class NodeUnavailable(KuangchaoError):
    """The cluster cannot be placed: a named node has no live agent, or too few live nodes remain."""

    def __init__(self, message: str, nodes: list[str] | None = None):
        self.nodes = list(nodes or [])
        super().__init__(message)


@dataclass
class NodeAssignment:
    """One node of an attempt: where it is, and the ranks it hosts."""

    name: str
    address: str
    ifname: str | None
    node_rank: int
    nproc: int

    @property
    def ranks(self) -> list[int]:
        """The global ranks of this node."""
        return [self.node_rank * self.nproc + i for i in range(self.nproc)]


def registry_pool(registry: str | None) -> str:
    """The work pool of ``cluster.registry`` (``prefect://POOL``)."""
    if not registry or not registry.startswith("prefect://") or not registry[len("prefect://") :].strip("/"):
        raise NodeUnavailable(
            f"cluster.registry {registry!r}: use prefect://POOL, the work pool the node agents serve (kc node start)"
        )
    return registry[len("prefect://") :].strip("/")


def _match(host: str, registered: list[NodeStatus]) -> NodeStatus | None:
    return next((n for n in registered if host in (n.name, n.facts.address)), None)


def _describe(n: NodeStatus) -> str:
    return f"{n.name} ({n.facts.address}, last heartbeat {n.last_heartbeat or 'never'})"


def choose_nodes(
    cfg: Any, registered: list[NodeStatus], exclude: set[str] | frozenset = frozenset()
) -> list[NodeAssignment]:
    """The nodes of one attempt, ordered as the rendezvous will rank them; raises NodeUnavailable naming nodes."""
    cluster, world = cfg.cluster, cfg.parallel.world_size
    if cluster.mode == "static":
        picked: list[tuple[NodeStatus, int]] = []
        problems, names = [], []
        for spec in cluster.worker_nodes:
            node = _match(spec.host, registered)
            if node is None:
                problems.append(f"{spec.host}: no node agent registered (run `kc node start` there)")
                names.append(spec.host)
            elif node.name in exclude:
                problems.append(f"{spec.host}: lost in an earlier attempt")
                names.append(node.name)
            elif not node.live:
                problems.append(f"{spec.host}: its agent is not live ({_describe(node)})")
                names.append(node.name)
            else:
                picked.append((node, int(cluster.nproc_per_node or spec.gpus or node.facts.slots)))
        if problems:
            raise NodeUnavailable("static cluster cannot start: " + "; ".join(problems), names)
    elif cluster.mode == "dynamic":
        live = [n for n in registered if n.live and n.name not in exclude]
        picked, covered = [], 0
        for node in live:
            if covered >= world:
                break
            nproc = int(cluster.nproc_per_node or node.facts.slots)
            picked.append((node, nproc))
            covered += nproc
        if covered < world:
            have = ", ".join(f"{n.name}×{p}" for n, p in picked) or "none"
            raise NodeUnavailable(
                f"dynamic cluster: world size {world} needs more live nodes than the pool has "
                f"(live: {have}; left out: {sorted(exclude) or 'none'}); start more node agents or shrink the layout",
                sorted(exclude),
            )
    else:
        raise NodeUnavailable(f"cluster.mode {cluster.mode!r} runs on this machine, not on nodes")
    sizes = {p for _, p in picked}
    if len(sizes) != 1 or sum(p for _, p in picked) != world:
        layout = ", ".join(f"{n.name}×{p}" for n, p in picked)
        raise NodeUnavailable(
            f"the nodes ({layout}) do not split world size {world} evenly; set cluster.nproc_per_node so that "
            f"nodes × nproc_per_node = {world}"
        )
    nproc = sizes.pop()
    ordered = sorted(picked, key=lambda item: item[0].facts.address)
    return [
        NodeAssignment(n.name, n.facts.address, n.facts.ifname, node_rank=i, nproc=nproc)
        for i, (n, _) in enumerate(ordered)
    ]


#: the work pool of a static cluster's node agents when ``cluster.registry`` does not name one
DEFAULT_POOL = "kuangchao-nodes"


def cluster_pool(cfg: Any) -> str:
    """The work pool whose node agents run the job: ``cluster.registry`` (``prefect://POOL``), else, for a static
    cluster, :data:`DEFAULT_POOL`."""
    registry = cfg.cluster.registry
    if registry is None and cfg.cluster.mode == "static":
        return DEFAULT_POOL
    return registry_pool(registry)
