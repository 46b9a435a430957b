"""Node-level placement (SPEC L4.1): which global rank of the mesh runs in which slot of which node.

torchrun numbers its processes by node — node ``n`` of ``N`` (in rendezvous order) runs torch ranks
``[n * nproc, (n + 1) * nproc)``. The mesh's own rank formula (``kuangchao_core.axes``) puts TP innermost
(consecutive ranks), then PP, then CP, then DP. A :class:`RankPlacement` maps each torch rank (a *slot*) to the
mesh rank it plays; the worker renames itself before anything reads ``RANK`` (:func:`apply_rank_map`).

Topology-aware placement (``cluster.placement: topology``):

1. take the bytes each kind of group moves per optimizer step (``kuangchao_core.engine.traffic.group_traffic``,
   from the model and the layout: TP all-reduces activations four times per layer and micro-batch, PP sends
   activations and their gradients across every stage boundary, DP all-reduces the gradients once per step);
2. order the mesh positions with the heaviest kind innermost, so the groups that move the most bytes land on
   consecutive slots (context parallelism always inside data parallelism);
3. order the nodes as a chain that keeps consecutive nodes on the best measured links (highest bandwidth, then
   lowest latency), starting at the rendezvous node, and inside a node order the devices so that consecutive ones
   share the fastest device link (NVLink pairs, when the probe saw any);
4. fill the slots in that order.

Topology-blind placement (``cluster.placement: blind``, for comparison) deals ranks out to the nodes in turn —
mesh rank ``r`` on node ``r mod N`` — as a scheduler that spreads processes over machines would, whatever the
groups are.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from kuangchao_core import axes as table
from kuangchao_core.axes import MeshAxes

ENV_RANK_MAP = "KC_RANK_MAP"
ENV_NODE_OF_RANK = "KC_NODE_OF_RANK"
ENV_TORCH_RANK = "KC_TORCH_RANK"
PLACEMENTS = ("topology", "blind")


def mesh_order(axes: MeshAxes, traffic: dict[str, float]) -> list[int]:
    """Mesh ranks in slot order: the kind moving the most bytes innermost (ties keep the mesh's own order: TP,
    then PP, then CP, then DP), except that the other data axes (CP) always stay inside DP (a context-parallel ring
    exchanges K/V every layer, latency-bound, where DP reduces once per step). The ranks are ``axes``'s."""
    names = table.AXES
    priority = {axis: i for i, axis in enumerate(reversed(names))}  # innermost first
    inner_first = sorted(names, key=lambda k: (-traffic.get(k, 0.0), priority[k]))
    for a in (a.name for a in table.TABLE if a.data and a.name != "dp"):
        if inner_first.index(a) > inner_first.index("dp"):
            inner_first.remove(a)
            inner_first.insert(inner_first.index("dp"), a)
    return axes.ranks_in_order(list(reversed(inner_first)))


def mesh_axes_of(sizes: tuple[int, ...] | list[int]) -> MeshAxes:
    """The :class:`~kuangchao_core.axes.MeshAxes` of placement ``sizes``: ``(dp, tp, pp)`` or ``(dp, tp, pp, cp)``."""
    dp, tp, pp, *rest = (int(s) for s in sizes)
    if len(rest) > 1:
        raise ValueError(f"placement sizes are (dp, tp, pp[, cp]), got {tuple(sizes)}")
    return MeshAxes(dp=dp, cp=rest[0] if rest else 1, pp=pp, tp=tp)


def placement_sizes(parallel: Any) -> tuple[int, ...]:
    """``(dp, tp, pp)`` of a config's ``parallel`` section, ``(dp, tp, pp, cp)`` when it has context parallelism
    (the sizes the placement records and :func:`place_ranks` takes)."""
    a = MeshAxes.from_parallel(parallel)
    return (a.dp, a.tp, a.pp) + ((a.cp,) if a.cp > 1 else ())


def _link_key(bandwidth: float | None, latency: float | None) -> tuple[float, float]:
    return (-(bandwidth or 0.0), latency if latency is not None else float("inf"))


def chain_order(
    n: int, bandwidth: list[list[float | None]] | None, latency: list[list[float | None]] | None, start: int = 0
) -> list[int]:
    """A path over ``n`` points that always steps to the best-linked point not yet visited (greedy)."""
    if n <= 1 or not bandwidth:
        return list(range(n))
    order, left = [start], set(range(n)) - {start}
    while left:
        here = order[-1]
        nxt = min(left, key=lambda j: (*_link_key(bandwidth[here][j], (latency or [[None] * n] * n)[here][j]), j))
        order.append(nxt)
        left.remove(nxt)
    return order


@dataclass
class RankPlacement:
    """Which mesh rank each slot plays. Slots are torch ranks: node ``i`` (rendezvous order) holds slots
    ``[i * nproc, (i + 1) * nproc)``."""

    nodes: list[str]
    nproc: int
    rank_of_slot: list[int]
    mode: str = "topology"
    traffic: dict[str, float] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """Ranks placed."""
        return len(self.rank_of_slot)

    def slot_of_rank(self) -> list[int]:
        """Inverse map: mesh rank → slot."""
        inv = [0] * self.world_size
        for slot, rank in enumerate(self.rank_of_slot):
            inv[rank] = slot
        return inv

    def node_of_rank(self) -> list[int]:
        """Node index (rendezvous order) of each mesh rank."""
        return [slot // self.nproc for slot in self.slot_of_rank()]

    def local_of_rank(self) -> list[int]:
        """Local slot (``LOCAL_RANK``, the device index) of each mesh rank."""
        return [slot % self.nproc for slot in self.slot_of_rank()]

    def ranks_of_node(self, i: int) -> list[int]:
        """Mesh ranks hosted by node ``i``, in local-slot order."""
        return self.rank_of_slot[i * self.nproc : (i + 1) * self.nproc]

    def is_identity(self) -> bool:
        """Whether every slot plays its own torch rank."""
        return self.rank_of_slot == list(range(self.world_size))

    def env(self) -> dict[str, str]:
        """Environment for the workers (``KC_RANK_MAP`` only when the map is not the identity)."""
        out = {ENV_NODE_OF_RANK: json.dumps(self.node_of_rank())}
        if not self.is_identity():
            out[ENV_RANK_MAP] = json.dumps(self.rank_of_slot)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankPlacement:
        """Inverse of :meth:`to_dict`."""
        return cls(
            list(d["nodes"]),
            int(d["nproc"]),
            [int(r) for r in d["rank_of_slot"]],
            d.get("mode", "topology"),
            dict(d.get("traffic_bytes_per_step") or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (recorded with the run)."""
        return {
            "mode": self.mode,
            "nodes": list(self.nodes),
            "nproc": self.nproc,
            "rank_of_slot": list(self.rank_of_slot),
            "node_of_rank": self.node_of_rank(),
            "traffic_bytes_per_step": dict(self.traffic),
        }


def place_ranks(
    sizes: tuple[int, ...],
    nodes: list[str],
    nproc: int,
    *,
    traffic: dict[str, float] | None = None,
    mode: str = "topology",
    node_bandwidth: list[list[float | None]] | None = None,
    node_latency: list[list[float | None]] | None = None,
    device_chain: list[int] | None = None,
) -> RankPlacement:
    """The placement of a dp×tp×pp (×cp) mesh (``sizes``: :func:`mesh_axes_of`) on ``nodes`` (rendezvous order)
    × ``nproc`` slots.

    ``traffic``: bytes per step each group kind sends (``engine.traffic.group_traffic``); ``node_bandwidth``/``node_latency``: the probe's node matrices, indexed like ``nodes``; ``device_chain``: the
    local slot order that keeps consecutive devices on the fastest links (default: slot order).
    """
    axes = mesh_axes_of(sizes)
    world = axes.world_size
    if world != len(nodes) * nproc:
        raise ValueError(f"{len(nodes)} nodes × {nproc} slots = {len(nodes) * nproc}, but the mesh has {world} ranks")
    if mode not in PLACEMENTS:
        raise ValueError(f"cluster.placement {mode!r}: use one of {', '.join(PLACEMENTS)}")
    if mode == "blind":
        n = len(nodes)
        rank_of_slot = [0] * world
        for rank in range(world):
            rank_of_slot[(rank % n) * nproc + rank // n] = rank
        return RankPlacement(list(nodes), nproc, rank_of_slot, mode, {})
    traffic = dict(traffic or {})
    order = mesh_order(axes, traffic)
    node_seq = chain_order(len(nodes), node_bandwidth, node_latency)
    local_seq = list(device_chain) if device_chain else list(range(nproc))
    rank_of_slot = [0] * world
    k = 0
    for node in node_seq:
        for local in local_seq:
            rank_of_slot[node * nproc + local] = order[k]
            k += 1
    return RankPlacement(list(nodes), nproc, rank_of_slot, mode, traffic)


def place_from_report(
    sizes: tuple[int, ...],
    nodes: list[str],
    nproc: int,
    *,
    traffic: dict[str, float] | None = None,
    mode: str = "topology",
    topology: Any = None,
) -> RankPlacement:
    """:func:`place_ranks` from a probe's ``topology`` (a ``TopologyReport``, or None): its node matrices restricted
    to ``nodes`` (rendezvous order) and the first node's device links, when it measured every one of ``nodes``.
    The one placement of every path: node agents (``multinode.place_cluster_attempt``) and Slurm jobs
    (``slurm.placement``)."""
    from kuangchao_core.sched.device_topology import device_chain

    bw = lat = chain = None
    if topology is not None and all(n in topology.nodes for n in nodes):
        bw, lat = topology.submatrix(nodes, "bandwidth"), topology.submatrix(nodes, "latency")
        links = (topology.device_links.get(nodes[0]) or {}).get("links")
        chain = device_chain(links, nproc) if links else None
    return place_ranks(
        sizes, nodes, nproc, traffic=traffic, mode=mode, node_bandwidth=bw, node_latency=lat, device_chain=chain
    )


def apply_rank_map(environ: dict[str, str] | None = None) -> int:
    """Rename this worker to the mesh rank its slot plays (``KC_RANK_MAP``); returns the rank. Call before anything
    reads ``RANK``. The torch rank stays in ``KC_TORCH_RANK``."""
    env = os.environ if environ is None else environ
    torch_rank = int(env.get("RANK", "0"))
    raw = env.get(ENV_RANK_MAP)
    if not raw or ENV_TORCH_RANK in env:
        return int(env.get("RANK", "0"))
    rank_of_slot = [int(r) for r in json.loads(raw)]
    if sorted(rank_of_slot) != list(range(len(rank_of_slot))) or torch_rank >= len(rank_of_slot):
        raise ValueError(f"{ENV_RANK_MAP} is not a permutation covering torch rank {torch_rank}: {raw}")
    env[ENV_TORCH_RANK] = str(torch_rank)
    env["RANK"] = str(rank_of_slot[torch_rank])
    return rank_of_slot[torch_rank]


def node_of_rank_from_env(world_size: int, environ: dict[str, str] | None = None) -> list[int]:
    """Node index of every mesh rank from ``KC_NODE_OF_RANK`` (default: one node)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_NODE_OF_RANK)
    if not raw:
        return [0] * world_size
    nodes = [int(n) for n in json.loads(raw)]
    if len(nodes) != world_size:
        raise ValueError(f"{ENV_NODE_OF_RANK} names {len(nodes)} ranks, the world has {world_size}")
    return nodes
