"""The language-model loss: next-token cross-entropy over the labelled positions (``-100`` ignored)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kuangchao_core.hal.dtypes import at_least_fp32

IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` (batch, seq, vocab) against ``labels`` (batch, seq) already aligned to them
    (label t is the token after input t), ignoring ``-100``; ``mean`` over the counted tokens, or ``sum``."""
    flat = at_least_fp32(logits.reshape(-1, logits.shape[-1]))
    loss = F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    if reduction == "sum":
        return loss
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    count = (labels != IGNORE_INDEX).sum()
    return loss / count.clamp(min=1)


def expected_initial_loss(vocab_size: int) -> float:
    """Loss of a uniform prediction over the vocabulary, ln(vocab_size)."""
    return math.log(vocab_size)
