"""The all-gather-K/V variant of context-parallel attention, and the bytes each variant moves (issue 30).

torchtitan offers two ways to run causal attention over a sequence sharded across CP ranks: a ring that passes
K/V shards around (ours: ``models/ring_attention.py``) and an all-gather of every rank's K/V before one local
attention (``rotate_method="allgather"``), whose backward reduce-scatters ``dK``/``dV`` back to their owners. This
module is the second, written for ``benchmarks/context_parallel.py``'s side-by-side run: :func:`allgather_attention`
has ``attend``'s signature, gathers ``stack(K, V)`` with one ``all_gather`` and attends with SDPA under the causal
mask of the tokens' global positions (``parallel.context``'s load-balanced layout).

The bytes are exact functions of the shapes. Per attention call and rank, with ``S`` the bytes of the local K (or
V) shard, ``n`` local tokens and ``cp`` ranks, as the comm layer counts them (``COMM_STATS.bytes_by_op``: a
batched exchange counts its sends under ``send`` and its receives under ``recv``, an ``all_gather`` its output, a
``reduce_scatter`` its input):

- ring: forward ``cp - 1`` exchanges of ``stack(K, V)`` and the int64 positions (``2S + 8n`` each way), backward
  the same again plus ``cp`` exchanges of the ``dK``/``dV`` accumulator (``2S'`` each way, ``S'`` in the
  accumulation dtype) — half of it under ``send``, half under ``recv``;
- all-gather: ``all_gather`` ``cp · 2S`` forward, ``reduce_scatter`` ``cp · 2S`` backward.

A rank sends the ring's ``send`` count and ``(cp - 1) / cp`` of each collective's
(ring algorithms: every rank forwards ``cp - 1`` of the ``cp`` chunks): :func:`sent_bytes`.
"""

from __future__ import annotations

import torch

COUNTED = ("send", "recv", "all_gather", "reduce_scatter")


class _GatherKV(torch.autograd.Function):
    """``all_gather`` of the local ``stack(K, V)`` into (cp, …) forward; ``reduce_scatter`` of its gradient back."""

    @staticmethod
    def forward(ctx, kv, group):
        from kuangchao_core.comm import primitives as P

        ctx.group = group
        out = kv.new_empty((group.size, *kv.shape))
        P.all_gather_into(out, kv.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx, grad):
        from kuangchao_core.comm import primitives as P

        local = grad.new_empty(grad.shape[1:])
        P.reduce_scatter(local, grad.contiguous(), ctx.group)
        return local, None


def allgather_attention(group):
    """``attend(q, k, v, documents=None)`` for this CP rank's tokens (the load-balanced layout): K/V gathered from
    every rank, causal by global position, grouped-query heads by SDPA's ``enable_gqa``."""
    import torch.nn.functional as F

    from kuangchao_core.parallel.context import local_positions

    cp, rank = group.size, group.rank

    def attend(q, k, v, documents=None):
        if documents is not None:
            raise ValueError("allgather_attention: packed documents are not part of this benchmark variant")
        n = q.shape[-2]
        full = _GatherKV.apply(torch.stack([k, v]), group)  # (cp, 2, b, hkv, n, d)
        kv = full.permute(1, 2, 3, 0, 4, 5).reshape(2, *k.shape[:2], cp * n, k.shape[-1])
        pos_q = local_positions(n * cp, cp, rank).to(q.device)
        pos_k = torch.cat([local_positions(n * cp, cp, r) for r in range(cp)]).to(q.device)
        mask = pos_k[None, :] <= pos_q[:, None]
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, enable_gqa=True)

    return attend


def payload_formula(variant: str, k_bytes: int, tokens: int, cp: int, acc_k_bytes: int | None = None) -> dict:
    """Bytes per attention call (forward + backward) and rank, by comm op, as ``COMM_STATS`` counts them (see the
    module docstring): ``k_bytes`` the local K shard's bytes, ``tokens`` the local tokens, ``acc_k_bytes`` the
    K shard's bytes in the ring's accumulation dtype (default ``k_bytes``)."""
    acc = k_bytes if acc_k_bytes is None else acc_k_bytes
    if variant == "ring":
        exchange = 2 * (2 * k_bytes + 8 * tokens)  # stack(K, V) and the positions, sent and received
        both_ways = 2 * (cp - 1) * exchange + cp * 2 * (2 * acc)
        return {"send": both_ways // 2, "recv": both_ways // 2}
    if variant == "allgather":
        return {"all_gather": cp * 2 * k_bytes, "reduce_scatter": cp * 2 * k_bytes}
    raise ValueError(f"payload_formula: unknown variant {variant!r}")


def counted(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The bytes counted per op between two ``COMM_STATS.bytes_by_op()`` readings (ops that moved none left out)."""
    out = {op: after.get(op, 0) - before.get(op, 0) for op in COUNTED}
    return {op: b for op, b in out.items() if b}


def sent_bytes(payload: dict[str, int], cp: int) -> int:
    """Bytes a rank sends for ``payload`` (ops as counted): its ``send`` bytes, ``(cp-1)/cp`` of a collective's."""
    p2p = payload.get("send", 0)
    coll = sum(payload.get(op, 0) for op in ("all_gather", "reduce_scatter")) * (cp - 1) // cp
    return p2p + coll
