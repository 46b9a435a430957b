"""Megatron-style tensor parallelism (SPEC L3.2): the TP region functions and the split linear layers.

The four conjugate region functions carry every communication (through :mod:`kuangchao_core.comm.primitives`, so
they are guarded and timed):

===========================  =========================  ============================
function                     forward                    backward
===========================  =========================  ============================
``copy_to_tp_region``        identity                   all-reduce (sum)
``reduce_from_tp_region``    all-reduce (sum)           identity
``gather_from_tp_region``    all-gather along last dim  keep own slice
``scatter_to_tp_region``     keep own slice             all-gather along last dim
===========================  =========================  ============================

A column-parallel linear splits its output features (``copy`` in, optional ``gather`` out); a row-parallel linear
splits its input features (optional ``scatter`` in, ``reduce`` out). A column layer followed by a row layer costs one
all-reduce forward and one backward. When the TP group has one rank every function is the identity and the layers
behave as plain ``nn.Linear``/``nn.Embedding`` with no communication.

The vocabulary-parallel embedding and cross-entropy are in :mod:`kuangchao_core.parallel.vocab_parallel`.

Weights are always initialised from the FULL tensor (given, or drawn from a seed exactly as a one-process model
would), and each rank keeps its slice, so a TP run computes what one process computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kuangchao_core.comm import primitives as comm
from kuangchao_core.errors import PlanError
from kuangchao_core.parallel.sequence import reduce_scatter_to_sequence, tp_rank_of, tp_size_of

IGNORE_INDEX = -100


def _all_gather_last(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    parts = comm.all_gather(None, x, group=group)
    return torch.cat(parts, dim=-1)


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n = tp_size_of(group)
    if x.shape[-1] % n:
        raise PlanError(
            [("parallel.tensor_parallel_size", f"last dimension {x.shape[-1]} is not divisible by TP size {n}")]
        )
    return x.chunk(n, dim=-1)[tp_rank_of(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may hand the same buffer to others
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (entry of a column-parallel region)."""
    return x if tp_size_of(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (exit of a row-parallel region)."""
    return x if tp_size_of(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the last dimension forward; keep this rank's slice of the gradient backward."""
    return x if tp_size_of(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's slice of the last dimension forward; all-gather the gradient backward."""
    return x if tp_size_of(group) == 1 else _ScatterToTP.apply(x, group)


def divide(n: int, parts: int, what: str) -> int:
    """``n // parts``, or PlanError naming both numbers when ``parts`` does not divide ``n``."""
    if n % parts:
        raise PlanError(
            [
                (
                    "parallel.tensor_parallel_size",
                    f"{what} {n} is not divisible by tensor_parallel_size {parts}; choose a TP size that divides {n}",
                )
            ]
        )
    return n // parts


def local_slice_weight(
    full_shape: tuple[int, ...],
    dim: int,
    start: int,
    length: int,
    weight: torch.Tensor | None,
    seed: int | None,
    dtype: torch.dtype | None,
    device,
) -> torch.Tensor:
    """This rank's slice [start, start+length) along ``dim`` of the full weight: the given ``weight``, or one drawn
    N(0, 0.02) from ``seed``, or (neither) uninitialised, to be filled later from a full state dict."""
    if weight is not None:
        if tuple(weight.shape) != tuple(full_shape):
            raise ValueError(f"full weight has shape {tuple(weight.shape)}, expected {tuple(full_shape)}")
        full = weight.detach()
    elif seed is not None:
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        full = torch.randn(full_shape, generator=gen, dtype=torch.float32).mul_(0.02)
    else:
        shape = list(full_shape)
        shape[dim] = length
        return torch.empty(shape, dtype=dtype or torch.float32, device=device)
    return full.narrow(dim, start, length).to(device=device, dtype=dtype or full.dtype).clone()


class ColumnParallelLinear(nn.Module):
    """``y = x A^T`` with A's output rows split across the TP group: rank r holds rows [r*out/tp, (r+1)*out/tp).

    ``weight`` is the FULL (out, in) weight (or None: drawn N(0, 0.02) from ``seed``, or left uninitialised for a
    later load when ``seed`` is None too); each rank keeps its rows,
    or the rows ``row_slice=(start, length)`` when given (replicated key/value heads). The output stays split
    unless ``gather_output``. ``copy_input=False`` skips the entry copy-to-region when the caller already applied
    it once for several layers sharing one input (q/k/v, gate/up), so backward does one all-reduce, not several.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group,
        gather_output: bool = False,
        weight: torch.Tensor | None = None,
        seed: int | None = None,
        row_slice: tuple[int, int] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        copy_input: bool = True,
    ) -> None:
        super().__init__()
        self.group = group
        self.tp = tp_size_of(group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.copy_input = copy_input
        if row_slice is None:
            local = divide(out_features, self.tp, "output features")
            row_slice = (tp_rank_of(group) * local, local)
        self.row_slice = row_slice
        start, length = row_slice
        self.weight = nn.Parameter(
            local_slice_weight((out_features, in_features), 0, start, length, weight, seed, dtype, device)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp_region(x, self.group)
        y = F.linear(x, self.weight)
        return gather_from_tp_region(y, self.group) if self.gather_output else y

    def shard_spec(self, name: str = "weight") -> tuple[int, int, int] | None:
        """(split dim, start, length) of this rank's slice of the full tensor, or None if not split."""
        if self.tp == 1:
            return None
        return (0, self.row_slice[0], self.row_slice[1])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp}, rows={self.row_slice}"


class RowParallelLinear(nn.Module):
    """``y = x A^T`` with A's input columns split across the TP group, partial results summed by an all-reduce.

    With ``input_is_parallel`` (default) ``x`` is already split along its last dimension (the output of a
    column-parallel layer); otherwise it is full and each rank takes its slice. With ``sequence_parallel`` the
    partial results are reduce-scattered along the sequence instead (each rank keeps s/tp positions of the sum:
    :mod:`kuangchao_core.parallel.sequence`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group,
        input_is_parallel: bool = True,
        weight: torch.Tensor | None = None,
        seed: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.tp = tp_size_of(group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        local = divide(in_features, self.tp, "input features")
        self.col_slice = (tp_rank_of(group) * local, local)
        self.weight = nn.Parameter(
            local_slice_weight((out_features, in_features), 1, self.col_slice[0], local, weight, seed, dtype, device)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(F.linear(x, self.weight), self.group)
        return reduce_from_tp_region(F.linear(x, self.weight), self.group)

    def shard_spec(self, name: str = "weight") -> tuple[int, int, int] | None:
        """(split dim, start, length) of this rank's slice of the full tensor, or None if not split."""
        if self.tp == 1:
            return None
        return (1, self.col_slice[0], self.col_slice[1])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp}, cols={self.col_slice}"


class _ReplicatedColumnLinear(torch.autograd.Function):
    """``y = x W^T`` for a weight slice that several TP ranks hold identically (key/value heads when there are
    fewer than the TP size). The input gradient uses only this rank's output gradient (the surrounding
    copy-to-region all-reduce sums the ranks); the weight gradient is summed over the ranks sharing the slice by
    one all-reduce over the TP group of a buffer in which each rank fills its head's slot."""

    @staticmethod
    def forward(ctx, x, weight, group, slot, num_slots):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.slot, ctx.num_slots = group, slot, num_slots
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w_local = g2.t().matmul(x.reshape(-1, x.shape[-1]))
        rows = weight.shape[0]
        buf = grad_w_local.new_zeros((ctx.num_slots * rows, weight.shape[1]))
        buf[ctx.slot * rows : (ctx.slot + 1) * rows] = grad_w_local
        comm.all_reduce(buf, group=ctx.group)
        return grad_x, buf[ctx.slot * rows : (ctx.slot + 1) * rows].clone(), None, None, None


class ReplicatedHeadsLinear(ColumnParallelLinear):
    """Column-parallel projection for key/value heads replicated across TP ranks: rank r keeps head
    ``slot`` (the one its query heads use); ranks sharing a head hold and update identical weights."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group,
        head_dim: int,
        slot: int,
        weight: torch.Tensor | None = None,
        seed: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        copy_input: bool = True,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            group,
            weight=weight,
            seed=seed,
            row_slice=(slot * head_dim, head_dim),
            dtype=dtype,
            device=device,
            copy_input=copy_input,
        )
        self.slot = slot
        self.num_slots = out_features // head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp_region(x, self.group)
        return _ReplicatedColumnLinear.apply(x, self.weight, self.group, self.slot, self.num_slots)

    def shard_spec(self, name: str = "weight") -> tuple[int, int, int] | None:
        """(split dim, start, length) of this rank's slice (shared with the other ranks using the same head)."""
        return (0, self.row_slice[0], self.row_slice[1])
