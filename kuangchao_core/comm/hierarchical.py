"""Hierarchical all-reduce (SPEC L2.5): reduce-scatter inside each node, all-reduce across nodes, all-gather inside.

A group whose members sit on several nodes is split into

- *intra* groups: the members on one node (``<name>.node[<ranks>]``);
- *inter* groups: the members holding the same shard index on every node (``<name>.x[<ranks>]``).

``hierarchical_all_reduce`` then sums a flat tensor in three steps: each node reduce-scatters it (every member
ends with the node's sum of one shard), the members holding the same shard all-reduce it across nodes, and each
node all-gathers the shards back. Across nodes only ``1/k`` of the tensor travels from each member (k members per
node), instead of the ``2(n−1)/n`` of the whole tensor a flat ring sends over the slowest link; this is what makes
it worth it when the links between nodes are much slower than those inside.

Every node must hold the same number of members (the inter groups pair them up); :func:`split_by_node` raises
otherwise. The sum is the same as the flat one up to the order of the additions: exact for values whose sums are
exactly representable (integers in float64), otherwise within the rounding of one reduction tree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kuangchao_core.comm import primitives as P
from kuangchao_core.errors import CommError


def split_by_node(ranks: Sequence[int], node_of_rank: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    """(intra groups, inter groups) of the member list ``ranks``; ``node_of_rank[r]`` is rank r's node.

    Intra groups are in the order nodes first appear in ``ranks``; inter group ``i`` holds the i-th member of every
    node, in node order.
    """
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(int(node_of_rank[r]), []).append(int(r))
    intra = list(by_node.values())
    sizes = {len(g) for g in intra}
    if len(sizes) != 1:
        detail = ", ".join(f"node {n}: {g}" for n, g in by_node.items())
        raise CommError(f"hierarchical all-reduce needs the same number of members on every node; got {detail}")
    k = sizes.pop()
    inter = [[g[i] for g in intra] for i in range(k)]
    return intra, inter


def spans_nodes(ranks: Sequence[int], node_of_rank: Sequence[int]) -> bool:
    """Whether the members of ``ranks`` sit on more than one node."""
    return len({int(node_of_rank[r]) for r in ranks}) > 1


def shard_len(numel: int, k: int) -> int:
    """Elements per member's shard when ``numel`` elements are split over ``k`` members (padded up)."""
    return -(-numel // k)


def hierarchical_all_reduce(
    flat: torch.Tensor,
    intra,
    inter,
    cross: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sum the 1-D tensor ``flat`` over every member of ``intra`` × ``inter`` in place; returns ``flat``.

    ``intra``/``inter``: this rank's :class:`~kuangchao_core.comm.group.CommGroup` of each kind. ``cross``, when
    given, replaces the cross-node all-reduce of this rank's shard (it receives the node-summed shard and returns
    the sum over nodes): the hook for compressed exchange.
    """
    if flat.dim() != 1:
        raise CommError(f"hierarchical_all_reduce takes a flat tensor, got shape {tuple(flat.shape)}")
    k = intra.size
    n = flat.numel()
    per = shard_len(n, k)
    padded = flat if per * k == n else torch.cat([flat, flat.new_zeros(per * k - n)])
    shard = flat.new_empty(per)
    if k > 1:
        P.reduce_scatter(shard, padded, group=intra, op="sum")
    else:
        shard.copy_(padded)
    if inter.size > 1:
        shard = cross(shard) if cross is not None else P.all_reduce(shard, group=inter, op="sum")
    if k > 1:
        parts = [flat.new_empty(per) for _ in range(k)]
        P.all_gather(parts, shard, group=intra)
        gathered = torch.cat(parts)
    else:
        gathered = shard
    flat.copy_(gathered[:n])
    return flat


MODES = ("auto", "on", "off")


def use_hierarchical(mode: str, groups: Sequence[Sequence[int]], node_of_rank: Sequence[int]) -> bool:
    """Whether ``parallel.hierarchical_allreduce`` (``auto|on|off``) applies to these groups: ``on`` always (for
    groups of two or more); ``auto`` when some group spans several nodes with several members on each node (with
    one member per node the hierarchy is the flat all-reduce); ``off`` never."""
    if mode not in MODES:
        raise CommError(f"parallel.hierarchical_allreduce {mode!r}: use one of {', '.join(MODES)}")
    if mode == "off":
        return False
    if mode == "on":
        return any(len(g) > 1 for g in groups)
    for g in groups:
        if spans_nodes(g, node_of_rank):
            intra, _ = split_by_node(g, node_of_rank)
            if len(intra[0]) > 1:
                return True
    return False


def subgroup_lists(groups: Sequence[Sequence[int]], node_of_rank: Sequence[int]) -> list[tuple[str, list[int]]]:
    """Every intra (``n``) and inter (``x``) member list of every group, in construction order:
    ``[("n", ranks), …, ("x", ranks), …]`` group by group."""
    out: list[tuple[str, list[int]]] = []
    for g in groups:
        intra, inter = split_by_node(g, node_of_rank)
        out += [("n", r) for r in intra] + [("x", r) for r in inter]
    return out
