"""Which nodes run a multi-node attempt, and which ranks each hosts (SPEC L4.3).

- ``cluster.mode: static``: exactly the configured worker nodes, each matched to a registered agent by name or
  address; a node without a live agent fails the launch before any rank starts, naming it.
- ``cluster.mode: dynamic`` (``registry: prefect://POOL``): live nodes of the pool until the world size is covered
  (``cluster.nproc_per_node`` ranks each, else the node's own device count or CPU cores). With the node probe's
  matrix (``topology``) the group of nodes with the best bottleneck link is chosen (highest bandwidth, then lowest
  latency; bandwidths within 25 % and latencies within 2× of the best count as equal — the probe's own noise:
  large messages time the bandwidth well, small ones are at the mercy of scheduling), then the least loaded
  (``loads``: node shares already running there), then by name. ``task.priority`` weighs the two: ``high`` takes
  the best-connected nodes whatever their load, ``normal`` the least loaded among the best-connected, ``low`` the
  least loaded nodes first and the links only among those. Without a matrix (``cluster.placement: blind``, or no
  probe) nodes are taken by load, then by name.

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


#: measured bandwidths within this factor of the best count as equally good
LINK_TOLERANCE = 1.25
#: measured latencies within this factor of the best count as equally good (small-message timings are noisy)
LATENCY_TOLERANCE = 2.0
#: above this many candidate groups the choice is greedy (grow from the best pair) instead of exhaustive
MAX_GROUPS = 5000


def _group_links(names: tuple[str, ...], topology: Any) -> tuple[float, float]:
    """(bottleneck bandwidth GB/s, worst latency us) among ``names``; a single node: its own figures."""
    idx = [topology.node_index(n) for n in names]
    pairs = [(i, j) for i in idx for j in idx if i != j] or [(idx[0], idx[0])]
    bws = [topology.node_bandwidth_gbps[i][j] or 0.0 for i, j in pairs]
    lats = [topology.node_latency_us[i][j] or 0.0 for i, j in pairs]
    return min(bws), max(lats)


def _groups(names: list[str], k: int, topology: Any) -> list[tuple[str, ...]]:
    from itertools import combinations
    from math import comb

    if comb(len(names), k) <= MAX_GROUPS:
        return list(combinations(names, k))
    best_pair = max(combinations(names, 2), key=lambda g: _group_links(g, topology)[0])
    group = list(best_pair)
    while len(group) < k:
        rest = [n for n in names if n not in group]
        group.append(max(rest, key=lambda n: _group_links((*group, n), topology)[0]))
    return [tuple(group)]


def pick_dynamic(
    live: list[NodeStatus], k: int, topology: Any = None, loads: dict[str, int] | None = None, priority: str = "normal"
) -> list[NodeStatus]:
    """``k`` nodes of ``live`` for a job of ``priority`` (see the module docstring)."""
    loads = loads or {}
    by_name = {n.name: n for n in live}
    seen = set(getattr(topology, "nodes", []) or [])
    measured = [n.name for n in live if n.name in seen]
    if topology is None or len(measured) < k:
        chosen = sorted(live, key=lambda n: (loads.get(n.name, 0), n.name))[:k]
        return chosen
    groups = _groups(sorted(measured), k, topology)

    def load(g) -> int:
        return sum(loads.get(n, 0) for n in g)

    if priority == "low":
        least = min(load(g) for g in groups)
        groups = [g for g in groups if load(g) == least]
    links = {g: _group_links(g, topology) for g in groups}
    best_bw = max(bw for bw, _ in links.values())
    good = [g for g in groups if links[g][0] * LINK_TOLERANCE >= best_bw]
    best_lat = min(links[g][1] for g in good)
    good = [g for g in good if links[g][1] <= best_lat * LATENCY_TOLERANCE or links[g][1] == best_lat]
    if priority == "high":
        good.sort(key=lambda g: (-links[g][0], links[g][1], g))
        pick = good[0]
    else:
        pick = min(good, key=lambda g: (load(g), g))
    return [by_name[n] for n in pick]


def choose_nodes(
    cfg: Any,
    registered: list[NodeStatus],
    exclude: set[str] | frozenset = frozenset(),
    topology: Any = None,
    loads: dict[str, int] | None = None,
) -> list[NodeAssignment]:
    """The nodes of one attempt, ordered as the rendezvous will rank them; raises NodeUnavailable naming nodes.

    ``topology``: the node probe's :class:`~kuangchao_core.sched.topology.TopologyReport` (dynamic clusters pick
    the best-connected nodes); ``loads``: node shares already running per node."""
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
        if cluster.nproc_per_node and len(live) * cluster.nproc_per_node >= world:
            k = -(-world // cluster.nproc_per_node)
            use_topology = topology if cluster.placement == "topology" else None
            chosen = pick_dynamic(live, k, use_topology, loads, cfg.task.priority)
            picked, covered = [(n, int(cluster.nproc_per_node)) for n in chosen], k * cluster.nproc_per_node
        else:
            for node in sorted(live, key=lambda n: ((loads or {}).get(n.name, 0), n.name)):
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
