"""Activation checkpointing of decoder layers (``train.activation_checkpointing``).

- ``none``: every activation a layer's backward needs is kept from the forward.
- ``full``: a layer keeps only its input; its forward runs again inside the backward (one layer's activations
  live at a time).
- ``selective``: a layer keeps the outputs of its matrix multiplications and of the attention core (the
  expensive ops) and recomputes the rest — norms, rotary embedding, SiLU, products, reshapes — in the backward
  (op-level selective checkpointing, as torchtitan's ``op`` mode saves matmul and SDPA outputs).

Both use PyTorch's non-reentrant checkpoint with the RNG state preserved, so a recomputed forward draws the same
dropout masks and the gradients equal those without checkpointing. Collectives inside a layer (tensor-parallel
all-reduces) run again in the recomputation, as with Megatron's full recomputation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")


def _saved_ops() -> frozenset:
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


#: the ops whose outputs selective checkpointing keeps from the forward
SAVED_OPS = _saved_ops()


def _keep_matmul_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_keep_matmul_and_attention)


def run_layer(
    layer: torch.nn.Module,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mode: str,
    documents: Any = None,
) -> torch.Tensor:
    """``layer(h, cos, sin, documents)`` under activation checkpointing ``mode`` (one of :data:`MODES`); without
    autograd (evaluation, ``torch.no_grad``) nothing is recomputed, so every mode is a plain call. ``documents``: the
    packed documents (:class:`~kuangchao_core.models.attention.Documents`), or None for plain causal attention."""
    args = (h, cos, sin) if documents is None else (h, cos, sin, documents)
    if mode == "none" or not torch.is_grad_enabled():
        return layer(*args)
    if mode == "full":
        return checkpoint(layer, *args, use_reentrant=False, preserve_rng_state=True)
    if mode == "selective":
        return checkpoint(layer, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_selective_contexts)
    raise ValueError(f"activation checkpointing {mode!r}: expected one of {', '.join(MODES)}")
