"""Sequence parallelism with tensor parallelism (issue 30 part 3, Megatron's scheme): the sequence region functions.

Between the tensor-parallel blocks (residual stream, RMSNorms) each TP rank holds ``s / tp`` consecutive positions
of every sequence (rank r: positions ``[r*s/tp, (r+1)*s/tp)``); activations are ``(batch, seq, hidden)``, so the
sequence is dimension 1. The conjugate pairs, each through :mod:`kuangchao_core.comm.primitives`:

================================  ===================================  ===================================
function                          forward                              backward
================================  ===================================  ===================================
``gather_from_sequence_region``   all-gather along the sequence        reduce-scatter along the sequence
``reduce_scatter_to_sequence``    reduce-scatter along the sequence    all-gather along the sequence
``scatter_to_sequence_region``    keep this rank's positions           all-gather along the sequence
``sum_weight_grad_over_tp``       identity                             all-reduce (sum) of the gradient
================================  ===================================  ===================================

The gather replaces the copy-to-region before the column-parallel projections (q/k/v, gate/up, the head); the
reduce-scatter replaces the all-reduce after the row-parallel ones (o_proj, down) and the vocabulary-parallel
embedding. The bytes moved are those of the all-reduce they replace (an all-reduce is a reduce-scatter then an
all-gather), but norms, residual adds and their saved activations shrink to ``s / tp`` per rank.

:class:`RegatherInBackward` keeps a gathered activation that projections save for their backward as its shard and
gathers it again there (Megatron's SP linears do the same), so those saved inputs shrink to s/tp as well.

A replicated weight used on a sequence shard (the RMSNorm scales) gets only its shard's share of the gradient;
``sum_weight_grad_over_tp`` sums it over the TP group inside the backward, once for each backward pass, before any
gradient hook (data-parallel buckets, ZeRO's reduce-scatter) sees it, so every gradient path and accumulation over
micro-batches (a sum of sums) keep working unchanged.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from kuangchao_core.comm import primitives as comm
from kuangchao_core.errors import PlanError

SEQ_DIM = 1
_KEY = "parallel.sequence_parallel"


def tp_size_of(group) -> int:
    """Ranks in the TP group (1 for None: no tensor parallelism)."""
    return 1 if group is None else group.size


def tp_rank_of(group) -> int:
    """This process's rank inside the TP group (0 for None)."""
    return 0 if group is None else group.rank


def _check_divisible(length: int, n: int) -> None:
    if length % n:
        raise PlanError([(_KEY, f"sequence length {length} is not divisible by tensor_parallel_size {n}")])


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    parts = comm.all_gather(None, x.contiguous(), group=group)
    return torch.cat(parts, dim=SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    n = tp_size_of(group)
    _check_divisible(x.shape[SEQ_DIM], n)
    chunks = [c.contiguous() for c in x.chunk(n, dim=SEQ_DIM)]
    out = torch.empty_like(chunks[0])
    comm.reduce_scatter(out, chunks, group=group)
    return out


def _split_seq(x: torch.Tensor, group) -> torch.Tensor:
    n = tp_size_of(group)
    _check_divisible(x.shape[SEQ_DIM], n)
    return x.chunk(n, dim=SEQ_DIM)[tp_rank_of(group)].contiguous()


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _SumGradOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


def gather_from_sequence_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``x`` (batch, s/tp, ...) along the sequence to (batch, s, ...); backward reduce-scatters."""
    return x if tp_size_of(group) == 1 else _GatherSeq.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial ``x`` (batch, s, ...) over the TP group, keeping this rank's s/tp positions; backward
    all-gathers."""
    return x if tp_size_of(group) == 1 else _ReduceScatterSeq.apply(x, group)


def scatter_to_sequence_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's s/tp positions of a full (batch, s, ...) tensor; backward all-gathers."""
    return x if tp_size_of(group) == 1 else _ScatterSeq.apply(x, group)


def sum_weight_grad_over_tp(weight: torch.Tensor, group) -> torch.Tensor:
    """``weight`` unchanged; its gradient from this backward is summed over the TP group (a replicated weight applied
    to a sequence shard)."""
    return weight if tp_size_of(group) == 1 else _SumGradOverTP.apply(weight, group)


class _Gathered:
    """One gathered activation the backward needs again: its shard, and the whole tensor while some use holds it."""

    __slots__ = ("cache", "full", "group", "shard", "uses")

    def __init__(self, shard: torch.Tensor, full: torch.Tensor, group) -> None:
        self.shard, self.group, self.uses, self.cache = shard, group, 0, None
        self.full = weakref.ref(full)

    def take(self) -> torch.Tensor:
        if self.cache is None:
            self.cache = _gather_seq(self.shard, self.group)
        self.uses -= 1
        full = self.cache
        if self.uses == 0:
            self.cache = None
        return full


class RegatherInBackward:
    """Saved-tensor hooks that keep a sequence-gathered activation as its shard and all-gather it again when the
    backward needs it (Megatron's sequence-parallel linears do the same): the projections after a norm save the
    whole sequence otherwise, h elements per token where the shard is h/tp. One gather serves every projection that
    saved the same activation (q/k/v, gate/up, their LoRA adapters).

    ``register(shard, full)`` marks ``full`` (the gather of ``shard``); inside :meth:`hooks` any saved view of it is
    replaced. ``enabled = False`` keeps every input whole (used under ``train.compile``). A tensor saved under inner hooks (activation checkpointing, ZeRO-3's units) is theirs and is kept
    whole: correct, only without the saving."""

    def __init__(self, group) -> None:
        self.group = group
        self.enabled = True
        self.active = False
        self.live: dict[int, _Gathered] = {}

    def register(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """Remember that ``full`` is the all-gather of ``shard`` (inside :meth:`hooks` only)."""
        if self.active and torch.is_grad_enabled():
            self.live[full.untyped_storage().data_ptr()] = _Gathered(shard.detach(), full, self.group)

    def _pack(self, t: torch.Tensor):
        entry = self.live.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        full = entry.full() if entry is not None else None
        if full is None or full.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            return t
        entry.uses += 1
        return entry, t.size(), t.stride(), t.storage_offset()

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        entry, size, stride, offset = packed
        return entry.take().as_strided(size, stride, offset)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """The context under which the layers run; on leaving it the entries are dropped (what was saved holds
        its own reference until the backward)."""
        if not self.enabled:
            yield
            return
        self.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self.active = False
            self.live = {}


def pad_to_multiple(
    input_ids: torch.Tensor, extras: dict[str, torch.Tensor], multiple: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Right-pad ``input_ids`` (batch, s) and its per-token ``extras`` (``position_ids``, ``segment_ids``) so the
    sequence divides by ``multiple``; returns them and the original length. Causal attention means no real
    position sees a padded one, so the real positions' outputs are unchanged (used where the length is not the
    training length: greedy decoding). Padding repeats each row's last entry."""
    s = input_ids.shape[-1]
    pad = (-s) % multiple
    if pad == 0:
        return input_ids, extras, s
    padded = {k: _extend(v, pad) for k, v in extras.items()}
    if "position_ids" in extras:
        pos = extras["position_ids"]
        padded["position_ids"] = torch.cat(
            (pos, pos[..., -1:] + torch.arange(1, pad + 1, dtype=pos.dtype, device=pos.device)), dim=-1
        )
    return _extend(input_ids, pad), padded, s


def _extend(t: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.cat((t, t[..., -1:].expand(*t.shape[:-1], pad)), dim=-1)
