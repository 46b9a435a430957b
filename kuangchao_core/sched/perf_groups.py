"""Where the TP, PP and DP groups of a layout land on a cluster's nodes, for the step-time model.

Two placements:

- ``aware`` (topology-aware): ranks in mesh order, TP innermost, then PP, DP outermost (as ``kuangchao_core.axes``
  numbers them) and node ``rank // ranks_per_node``;
  so TP stays inside a node when ``tp ≤ ranks_per_node``, then PP neighbours, and DP crosses nodes first;
- ``blind``: the worst case of a placement that ignores the topology — whenever the job spans several nodes, every
  group of more than one rank is assumed to span ``min(size, nodes)`` nodes, its members spread evenly.

For each group kind :func:`group_span` reports the worst group: how many nodes it spans, how many of its members
share a node, and how many flows leave one node at once when all groups of that kind communicate together (a ring
leaves a node once per group; a hierarchical all-reduce's inter-node phase has one flow per rank).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kuangchao_core.axes import MeshAxes

PLACEMENTS = ("aware", "blind")


@dataclass(frozen=True)
class GroupSpan:
    """How the worst group of one kind (``tp``, ``pp`` or ``dp``) of ``size`` ranks lies on the nodes."""

    kind: str
    size: int
    nodes: int
    per_node: int
    ring_flows_per_node: int
    crossing_ranks_per_node: int
    p2p_flows_per_node: int = 0

    @property
    def spans_nodes(self) -> bool:
        """True when the group's ring has at least one inter-node hop."""
        return self.nodes > 1


def group_span(
    kind: str, dp: int, tp: int, pp: int, ranks_per_node: int, placement: str = "aware", cp: int = 1
) -> GroupSpan:
    """The worst ``kind`` group of a dp×cp×tp×pp job on nodes of ``ranks_per_node`` ranks, under ``placement``."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    axes = MeshAxes(dp=dp, cp=cp, pp=pp, tp=tp)
    size, world = axes.sizes[kind], axes.world_size
    nodes_used = -(-world // ranks_per_node)
    local = min(ranks_per_node, world)
    if placement == "blind":
        if size <= 1 or nodes_used <= 1:
            return GroupSpan(kind, size, 1, size, 0, 0, 0)
        span = min(size, nodes_used)
        per_node = -(-size // span)
        return GroupSpan(kind, size, span, per_node, max(1, local // per_node), local, local if kind == "pp" else 0)
    groups = axes.groups(kind)
    ring_flows: Counter[int] = Counter()
    crossing: Counter[int] = Counter()
    p2p: Counter[int] = Counter()
    worst_nodes, worst_per_node = 1, size
    for g in groups:
        where = [r // ranks_per_node for r in g]
        counts = Counter(where)
        if len(counts) > worst_nodes or (len(counts) == worst_nodes and max(counts.values()) < worst_per_node):
            worst_nodes, worst_per_node = len(counts), max(counts.values())
        if len(counts) > 1:
            for node, c in counts.items():
                ring_flows[node] += 1
                crossing[node] += c
        if kind == "pp":
            for a, b in zip(where, where[1:], strict=False):
                if a != b:
                    p2p[a] += 1
    return GroupSpan(
        kind,
        size,
        worst_nodes,
        worst_per_node,
        max(ring_flows.values(), default=0),
        max(crossing.values(), default=0),
        max(p2p.values(), default=0),
    )
