"""Greedy decoding of the Llama model with a key/value cache (issue 39 item 1).

:class:`KVCacheDecoder` runs the prompt once (``prefill``), keeping every layer's rotated keys and values, and then
one new token per call (``step``): each new token attends to the cached keys and values of every position before
it, so a sample of ``n`` new tokens costs ``n`` one-token forwards instead of ``n`` forwards of the whole growing
sequence. It calls the model's own modules (embedding, norms, projections, MLP, head), so tensor parallelism
(column/row-parallel projections, the vocabulary-parallel embedding and head, ``head`` gathers the logits), LoRA
adapters and compiled layers (run eagerly here) decode through it unchanged. It is not for layouts whose decoder
layers must run whole (:func:`can_cache`): a pipeline (stages on other ranks), ZeRO-3 (each layer's forward gathers
its parameters) and sequence parallelism (activations split along the sequence between blocks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kuangchao_core.models.llama import LlamaForCausalLM, apply_rotary


def can_cache(model: nn.Module, pipelined: bool, zero_stage: int) -> bool:
    """Whether ``model`` can decode with :class:`KVCacheDecoder` in this layout (see the module docstring)."""
    return (
        isinstance(model, LlamaForCausalLM)
        and not pipelined
        and zero_stage != 3
        and not getattr(model, "sequence_parallel", False)
    )


class KVCacheDecoder:
    """Greedy next tokens with a key/value cache: ``prefill(ids) -> next (batch,)`` for the prompts ``ids`` (batch,
    seq), then ``step(tokens) -> next`` for the tokens just chosen. ``head``: full-vocabulary logits from the model's
    (the TP gather; identity by default). Call under ``torch.no_grad`` with the model in eval mode."""

    def __init__(self, model: LlamaForCausalLM, head: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.model = model
        self.head = head or (lambda logits: logits)
        self.cache: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.length = 0

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Start afresh from the prompts ``ids`` (batch, seq); returns their next tokens."""
        self.cache = [None] * len(self.model.layers)
        self.length = 0
        return self._next(ids)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed the chosen ``tokens`` (batch,); returns the tokens after them."""
        return self._next(tokens[:, None])

    def _next(self, ids: torch.Tensor) -> torch.Tensor:
        model, start, s = self.model, self.length, ids.shape[1]
        if start + s > model.config.max_seq_len:
            raise ValueError(
                f"sequence length {start + s} exceeds model.max_seq_len {model.config.max_seq_len}; "
                "shorten data.seq_len or raise model.max_seq_len"
            )
        h = model.embed(ids)
        positions = torch.arange(start, start + s, device=h.device)
        cos, sin = model.model.rotary_emb(positions, h.dtype)
        for i, layer in enumerate(model.layers):
            h = h + self._attention(i, layer, layer.input_layernorm(h), cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.length = start + s
        return self.head(model.head(h[:, -1:, :]))[:, -1, :].argmax(-1)

    def _attention(self, i: int, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        attn = layer.self_attn
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, attn.head_dim).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cached = self.cache[i]
        if cached is not None:
            k, v = torch.cat([cached[0], k], dim=2), torch.cat([cached[1], v], dim=2)
        self.cache[i] = (k, v)
        # the prompt attends causally among itself; a new token (one query) sees every cached position
        causal = cached is None and s > 1
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))
