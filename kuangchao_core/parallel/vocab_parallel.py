"""Vocabulary-parallel embedding and cross-entropy (SPEC L3.2): the vocabulary rows split over the TP group.

Rank r holds vocabulary entries [r*V/tp, (r+1)*V/tp). The embedding looks up the ids a rank owns and one
all-reduce sums the partial embeddings; the loss never gathers the logits (Megatron's recipe: all-reduce the row
maximum, then one all-reduce of [sum of exp, target logit]). With one TP rank both are the plain torch functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kuangchao_core.comm import primitives as comm
from kuangchao_core.hal.dtypes import at_least_fp32
from kuangchao_core.parallel.sequence import reduce_scatter_to_sequence
from kuangchao_core.parallel.tensor import (
    IGNORE_INDEX,
    divide,
    local_slice_weight,
    reduce_from_tp_region,
    tp_rank_of,
    tp_size_of,
)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split: each rank looks up the ids it owns, zeros the rest, and an
    all-reduce sums the partial embeddings (with ``sequence_parallel`` a reduce-scatter along the sequence: each
    rank keeps the sum for its s/tp positions)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group,
        weight: torch.Tensor | None = None,
        seed: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.tp = tp_size_of(group)
        self.sequence_parallel = sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = divide(num_embeddings, self.tp, "vocab_size")
        self.vocab_start = tp_rank_of(group) * local
        self.vocab_end = self.vocab_start + local
        self.weight = nn.Parameter(
            local_slice_weight((num_embeddings, embedding_dim), 0, self.vocab_start, local, weight, seed, dtype, device)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.group)
        return reduce_from_tp_region(out, self.group)

    def shard_spec(self, name: str = "weight") -> tuple[int, int, int] | None:
        """(split dim, start, length) of this rank's slice of the full tensor, or None if not split."""
        if self.tp == 1:
            return None
        return (0, self.vocab_start, self.vocab_end - self.vocab_start)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-split logits (Megatron's recipe): all-reduce the max, then one
    all-reduce of [sum of exp, target logit]; backward is softmax minus one-hot, with no communication."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start):
        logits = at_least_fp32(logits)
        n_local = logits.shape[-1]
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, group=group, op="max")
        shifted = logits - row_max.unsqueeze(-1)
        in_range = (labels >= vocab_start) & (labels < vocab_start + n_local)
        local_target = (labels - vocab_start).masked_fill(~in_range, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        exp = shifted.exp_()
        stats = torch.stack((exp.sum(dim=-1), target_logit))
        comm.all_reduce(stats, group=group)
        sum_exp, target_logit = stats[0], stats[1]
        loss = sum_exp.log() - target_logit
        ignored = labels == IGNORE_INDEX
        loss = loss.masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # now the local softmax
        ctx.save_for_backward(exp, local_target, in_range & ~ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, hit, ignored = ctx.saved_tensors
        grad = softmax.clone()
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=flat.device)
        flat[rows, local_target.view(-1)] -= hit.view(-1).to(grad.dtype)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group, reduction: str = "mean", ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Cross-entropy of vocabulary-split ``logits`` (..., vocab/tp) against full-vocabulary ``labels`` (...).

    Rank r holds vocabulary entries [r*V/tp, (r+1)*V/tp). Tokens labelled ``ignore_index`` count for nothing;
    ``mean`` divides by the number of counted tokens (the same value as full cross-entropy in fp32), ``sum``
    returns the total, ``none`` the per-token losses.
    """
    if ignore_index != IGNORE_INDEX:
        labels = labels.masked_fill(labels == ignore_index, IGNORE_INDEX)
    if tp_size_of(group) == 1:
        per_token = F.cross_entropy(
            at_least_fp32(logits.reshape(-1, logits.shape[-1])),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        ).view(labels.shape)
    else:
        vocab_start = tp_rank_of(group) * logits.shape[-1]
        per_token = _VocabParallelCE.apply(logits, labels, group, vocab_start)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)
