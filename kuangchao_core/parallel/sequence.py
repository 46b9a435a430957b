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

A replicated weight used on a sequence shard (the RMSNorm scales) gets only its shard's share of the gradient;
``sum_weight_grad_over_tp`` sums it over the TP group inside the backward, once for each backward pass, before any
gradient hook (data-parallel buckets, ZeRO's reduce-scatter) sees it, so every gradient path and accumulation over
micro-batches (a sum of sums) keep working unchanged.
"""

from __future__ import annotations

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
