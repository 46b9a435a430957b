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

from collections.abc import Callable, Iterator, Sequence

import torch

from kuangchao_core.comm import primitives as P
from kuangchao_core.comm.staging import STAGING
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


def _steps(flat: torch.Tensor, intra, inter, cross) -> Iterator:
    """The three steps of one hierarchical sum, each yielded as the handle of its async collective (a compressed
    cross-node step runs when reached); the last resumption leaves the sum in ``flat``."""
    if flat.dim() != 1:
        raise CommError(f"hierarchical_all_reduce takes a flat tensor, got shape {tuple(flat.shape)}")
    k = intra.size
    n = flat.numel()
    per = shard_len(n, k)
    padded = flat
    if per * k != n:  # the shards must tile the buffer: pad a copy (counted in comm.staging)
        padded = flat.new_zeros(per * k)
        padded[:n].copy_(flat)
    STAGING.add("hierarchical_all_reduce", flat.nbytes, 0 if padded is flat else 2 * flat.nbytes, 0)
    shard = padded
    if k > 1:
        shard = flat.new_empty(per)
        yield P.reduce_scatter(shard, padded, group=intra, op="sum", async_op=True)
    if inter.size > 1:
        if cross is not None:
            shard = cross(shard)
        else:
            yield P.all_reduce(shard, group=inter, op="sum", async_op=True)
    if k > 1:
        yield P.all_gather_into(padded, shard, group=intra, async_op=True)
    elif shard is not padded:
        padded.copy_(shard)
    if padded is not flat:
        flat.copy_(padded[:n])


def hierarchical_all_reduce(
    flat: torch.Tensor,
    intra,
    inter,
    cross: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sum the 1-D tensor ``flat`` over every member of ``intra`` × ``inter`` in place; returns ``flat``.

    ``intra``/``inter``: this rank's :class:`~kuangchao_core.comm.group.CommGroup` of each kind. ``cross``, when
    given, replaces the cross-node all-reduce of this rank's shard (it receives the node-summed shard and returns
    the sum over nodes): the hook for compressed exchange. Blocking; :class:`HierarchicalPipeline` overlaps.
    """
    for handle in _steps(flat, intra, inter, cross):
        handle.wait()
    return flat


class _Reduction:
    """One tensor's hierarchical sum in flight: ``advance()`` waits for the step issued last and issues the next."""

    __slots__ = ("_steps", "_handle", "done", "issued_at")

    def __init__(self, flat, intra, inter, cross, now: int) -> None:
        self._steps = _steps(flat, intra, inter, cross)
        self._handle = None
        self.done = False
        self.advance(now)

    def advance(self, now: int = 0) -> None:
        if self.done:
            return
        if self._handle is not None:
            self._handle.wait()
        self._handle = next(self._steps, None)
        self.done = self._handle is None
        self.issued_at = now


class HierarchicalPipeline:
    """Hierarchical all-reduces of several tensors (a backward's gradient buckets) in flight together.

    :meth:`start` issues a tensor's intra-node reduce-scatter and returns at once; it first advances every sum
    already in flight by one step (oldest first): wait for the step it issued last — which had a bucket's worth of
    backward to complete in — and issue its next (the cross-node all-reduce, then the all-gather). The handle's
    ``wait()`` drives the sums up to its own to the end. Which collective is issued when depends only on the order
    of the ``start`` and ``wait`` calls, never on timing, so every rank issues the same sequence on every group.
    With ``overlap=False`` each ``start`` runs its sum to the end before returning (the blocking behaviour, kept
    as the benchmark's control). ``lag``: the launches a step gets before the next ``start`` waits for it (1: the
    next one). On Gloo a wait blocks the host; on NCCL it orders the current stream after the
    op (the host goes on), so backward kernels queued after a launch wait for the step issued one launch before.
    """

    def __init__(self, overlap: bool = True, lag: int = 1) -> None:
        self.overlap = overlap
        self.lag = lag
        self._starts = 0
        self._inflight: list[_Reduction] = []

    def start(self, flat: torch.Tensor, intra, inter, cross=None) -> _PipelineHandle:
        """Begin the sum of ``flat`` (see the class docstring); returns its handle."""
        self._starts += 1
        for r in self._inflight:
            if self._starts - r.issued_at >= self.lag:
                r.advance(self._starts)
        r = _Reduction(flat, intra, inter, cross, self._starts)
        self._inflight = [x for x in self._inflight if not x.done] + ([] if r.done else [r])
        handle = _PipelineHandle(self, r)
        if not self.overlap:
            handle.wait()
        return handle

    def _complete(self, r: _Reduction) -> None:
        while not r.done:
            upto = self._inflight.index(r) + 1
            for x in self._inflight[:upto]:
                x.advance()
            self._inflight = [x for x in self._inflight if not x.done]


class _PipelineHandle:
    __slots__ = ("_pipe", "_r")

    def __init__(self, pipe: HierarchicalPipeline, r: _Reduction) -> None:
        self._pipe, self._r = pipe, r

    def is_completed(self) -> bool:
        """Whether the sum has been driven to its end (never blocks)."""
        return self._r.done

    def wait(self) -> None:
        """Complete this sum (and, first, the steps of older ones that it must not overtake)."""
        self._pipe._complete(self._r)


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
