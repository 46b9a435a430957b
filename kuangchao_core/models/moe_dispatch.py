"""Expert parallelism for the MoE block (issue 40 item 2): each rank of an ``ep`` group holds ``E / ep`` of the
experts, and tokens travel to them and back with all-to-all.

The ``ep`` ranks hold different tokens (ep is carved out of the data-parallel ranks) and the same router. Each rank:

1. routes its own tokens (every expert is a candidate), sorts the assignments by expert (a stable argsort: token
   order inside each expert) and applies the **capacity at the source**: expert e takes at most
   ``capacity(local tokens)`` of this rank's assignments, the first in token order — exactly what one process does
   to each micro-batch, so a one-process run whose micro-batches are the ranks' micro-batches drops the same ones;
2. sends each expert's token rows to the rank that holds it (:func:`owner`; experts ``[i·E/ep, (i+1)·E/ep)`` on
   ep rank i), after an all-to-all of the per-expert counts (the row counts vary, so the receivers learn theirs
   first);
3. runs its experts on what it received (grouped per local expert, three batched matmuls as in one process) and
   sends the outputs back the same way (the reverse all-to-all); the gradient takes the same two routes backward;
4. weighs each returned row by its gate weight and sums it into its token, as one process does.

The expert weights' gradients are reduced over the ranks holding the same experts (``dp_mod_ep``), divided by the
whole DP size: ``PlacementRecord.apart`` and GradSync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kuangchao_core.comm import primitives as P


@dataclass(frozen=True)
class ExpertShard:
    """This rank's share of the experts: ``group`` (the ep group), ``num_experts`` in all."""

    group: Any
    num_experts: int

    @property
    def local(self) -> int:
        """Experts each rank holds."""
        return self.num_experts // self.group.size

    @property
    def first(self) -> int:
        """This rank's first expert."""
        return self.group.rank * self.local


def owner(expert: torch.Tensor, local: int, ranks: int) -> torch.Tensor:
    """The ep rank (group position) holding each expert index of ``expert`` (``local`` experts per rank, ``ranks``
    ranks: contiguous blocks, so ``ranks`` is not needed here; a test's wrong mapping uses it)."""
    del ranks
    return torch.div(expert, local, rounding_mode="floor")


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` sent by ``send`` counts, ``recv`` counts received; the gradient goes back the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group: Any) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        return P.all_to_all(out, x.contiguous(), recv, send, group=group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        return P.all_to_all(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group), None, None, None


def _exchange_counts(counts: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """This rank's per-expert counts (E) -> what each member sends this rank's experts (ep × local, source-major)."""
    n, local = shard.group.size, shard.local
    out = torch.empty(n * local, dtype=counts.dtype, device=counts.device)
    return P.all_to_all(out, counts.contiguous(), [local] * n, [local] * n, group=shard.group).view(n, local)


def dispatch_experts(experts: Any, x: torch.Tensor, routing: Any, capacity: int | None, shard: ExpertShard):
    """The routed experts' output for the tokens ``x`` (tokens × hidden) of this rank, computed by the ep ranks
    that hold them (the module docstring); ``experts``: the local :class:`~kuangchao_core.models.moe.GroupedExperts`."""
    tokens, k = routing.index.shape
    n, local = shard.group.size, shard.local
    expert_of = routing.index.reshape(-1)  # assignment a = t·k + j, in token order
    key = owner(expert_of, local, n) * local + expert_of % local  # destination rank, then its local expert
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=shard.num_experts)
    if capacity is not None:  # at the source: the first `capacity` of this rank's assignments to each expert
        slot = torch.arange(order.numel(), device=x.device) - (counts.cumsum(0) - counts)[key[order]]
        order = order[slot < capacity]
        counts = counts.clamp(max=capacity)
    token = torch.div(order, k, rounding_mode="floor")
    received = _exchange_counts(counts, shard)  # [source, local expert]
    send = counts.view(n, local).sum(1).tolist()
    recv = received.sum(1).tolist()
    rows = _AllToAll.apply(x[token], recv, send, shard.group)
    # each received row's local expert (source-major, expert-major inside a source); group them per expert
    local_of = torch.arange(local, device=x.device).repeat(n).repeat_interleave(received.reshape(-1))
    by_expert = torch.argsort(local_of, stable=True)
    per_expert = received.sum(0)
    le = local_of[by_expert]
    slot = torch.arange(by_expert.numel(), device=x.device) - (per_expert.cumsum(0) - per_expert)[le]
    slots = int(per_expert.max()) if by_expert.numel() else 0
    buffer = rows.new_zeros(local, slots, x.shape[-1]).index_put((le, slot), rows[by_expert])
    hidden = F.silu(torch.bmm(buffer, experts.w_gate)) * torch.bmm(buffer, experts.w_up)
    out_rows = torch.bmm(hidden, experts.w_down)[le, slot]
    back = out_rows.new_zeros(rows.shape).index_copy(0, by_expert, out_rows)  # in received order again
    returned = _AllToAll.apply(back, send, recv, shard.group)
    gate = routing.weights.reshape(-1)[order].to(x.dtype)
    return x.new_zeros(tokens, x.shape[-1]).index_add(0, token, returned * gate[:, None])


def shard_experts(experts: Any, shard: ExpertShard) -> None:
    """Keep only ``shard``'s experts of ``experts`` (every rank built and initialised all of them, as one process
    does), and route its forward through :func:`dispatch_experts`."""
    keep = slice(shard.first, shard.first + shard.local)
    for name in ("w_gate", "w_up", "w_down"):
        full = getattr(experts, name)
        setattr(experts, name, torch.nn.Parameter(full.detach()[keep].clone(), requires_grad=full.requires_grad))
    experts.shard = shard
