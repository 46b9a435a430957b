"""Ring attention: causal grouped-query attention over a sequence sharded across the context-parallel (CP) ranks.

Each CP rank holds the queries, keys and values of its tokens (``parallel.context``'s load-balanced layout: chunk
``r`` and its mirror ``2·cp-1-r``). The K/V shards travel around the CP ring together with their tokens' global
positions and document ids: at step ``t`` rank ``r`` holds the shard of rank ``r - t``; the exchange that brings
the next shard is issued before the current shard's block is computed, so the transfer overlaps the compute
(``comm.p2p_batch``: one batch per step, every rank sending to its successor and receiving from its predecessor;
``cp - 1`` exchanges in all). A query attends to a key when the key's global position is not after its own and,
with packed documents, when both carry the same document id.

Blocks are merged by the log-sum-exp rule (online softmax): with ``o_i, L_i`` a block's normalised output and the
log of its softmax denominator, ``L = log(e^L1 + e^L2)`` and ``o = o1·e^(L1-L) + o2·e^(L2-L)``. The local block
comes first: every query sees at least itself there, so the running ``L`` is finite from the first step and a
block in which a query sees nothing (``L_i = -inf``) adds exactly zero.

Backward (:class:`RingAttention`) keeps only the local ``q, k, v``, the output and ``L`` (``O(s/cp)`` per rank, no
other rank's K/V) and runs a second ring pass: the K/V shards travel again, each rank adds its queries' share of
``dK``/``dV`` to an accumulator that travels with the shard (the accumulator exchange is posted after a block and
waited after the next block's compute), and after ``cp`` steps every accumulator arrives at its owner. ``dQ``
stays local. Per block: ``P = exp(S - L)``, ``dV = Pᵀ dO``, ``dS = P ⊙ (dO Vᵀ - rowsum(dO ⊙ O))``,
``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``.

Grouped-query attention never repeats K/V: the ``g = heads / kv_heads`` query heads that share a K/V head are
folded into the query rows (``(g·n) × d`` against ``n × d``). With the balanced layout (``balanced=True``) a block
from an earlier rank (``j < r``) is computed for its first chunk only and one from a later rank (``j > r``) for
the local second chunk only (the rest is masked by causality): every off-diagonal block is half a block, the same
on every rank.

Buffers are made with ``new_zeros``/``new_full`` of an input, never ``device=x.device``: in a custom Function's
backward the stand-in device of ``KC_COMM_RULES=nccl`` cannot report ``x.device`` (torch function modes do not
reach the autograd engine), and a buffer made that way would be a host tensor there.

The per-block kernel is plain matmul and ``logsumexp`` (any device, fp64 included); a fused kernel that returns
the log-sum-exp (FlashAttention on GPU) can replace :func:`_block_forward`/:func:`_block_backward` later.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kuangchao_core.comm.group import CommGroup
from kuangchao_core.comm.p2p_batch import batch_send_recv

#: message tags of the forward/backward K/V exchange and of the travelling dK/dV accumulators
TAG_KV, TAG_DKV = 301, 302


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _mask(pos_q, pos_k, seg_q, seg_k) -> torch.Tensor:
    """(batch or 1, 1, 1, nq, nk) boolean: key not after query (global positions), same document if given."""
    keep = pos_k[None, :] <= pos_q[:, None]
    if seg_q is not None:
        keep = keep[None] & (seg_q[:, :, None] == seg_k[:, None, :])
    else:
        keep = keep[None]
    return keep[:, None, None]


def _scores(qg, k, mask, scale) -> torch.Tensor:
    b, hkv, g, nq, d = qg.shape
    s = (qg.reshape(b, hkv, g * nq, d) @ k.transpose(-1, -2)).view(b, hkv, g, nq, -1) * scale
    return s.masked_fill(~mask, float("-inf"))


def _block_forward(qg, k, v, mask, scale):
    """Normalised output (b, hkv, g, nq, d) and log-sum-exp (b, hkv, g, nq) of one block; a query that sees no key
    gets output 0 and ``-inf``."""
    b, hkv, g, nq, d = qg.shape
    s = _scores(qg, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return (p.reshape(b, hkv, g * nq, -1) @ v).view(b, hkv, g, nq, d), lse


def _block_backward(qg, k, v, mask, do, lse, delta, scale):
    """``dQ`` (b, hkv, g, nq, d), ``dK`` and ``dV`` (b, hkv, nk, d) of one block, given the final ``lse``."""
    b, hkv, g, nq, d = qg.shape
    p = torch.exp(_scores(qg, k, mask, scale) - lse[..., None])
    p2 = p.reshape(b, hkv, g * nq, -1)
    do2 = do.reshape(b, hkv, g * nq, d)
    dv = p2.transpose(-1, -2) @ do2
    ds = p * ((do2 @ v.transpose(-1, -2)).view_as(p) - delta[..., None])
    ds2 = ds.reshape(b, hkv, g * nq, -1)
    dq = (ds2 @ k).view(b, hkv, g, nq, d) * scale
    dk = (ds2.transpose(-1, -2) @ qg.reshape(b, hkv, g * nq, d)) * scale
    return dq, dk, dv


def _block_slices(n: int, me: int, owner: int, balanced: bool) -> tuple[slice, slice]:
    """The query rows and key columns of the block (local queries × ``owner``'s keys) that causality can leave
    unmasked under the balanced layout; the whole block otherwise."""
    half = n // 2
    if not balanced or owner == me:
        return slice(0, n), slice(0, n)
    if owner < me:  # both local chunks come after the owner's first chunk and before its second
        return slice(0, n), slice(0, half)
    return slice(half, n), slice(0, n)  # only the local second chunk comes after the owner's two chunks


def _split_meta(meta):
    """Global positions (n,) and document ids (batch, n) or None, from the travelling (1 or 1+batch, n) tensor."""
    return meta[0], (meta[1:] if meta.shape[0] > 1 else None)


class _Ring:
    """The CP ring as seen from one rank: successor, predecessor, and one exchange step."""

    def __init__(self, group: CommGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else group.size
        self.rank = 0 if group is None else group.rank
        if self.size > 1:
            self.next = group.ranks[(self.rank + 1) % self.size]
            self.prev = group.ranks[(self.rank - 1) % self.size]

    def exchange(self, tensors, tag):
        """Send ``tensors`` to the successor and receive the predecessor's into new buffers: (handle, buffers)."""
        bufs = [torch.empty_like(t) for t in tensors]
        sends = [(t, self.next) for t in tensors]
        return batch_send_recv(sends, [(b, self.prev) for b in bufs], self.group, tag=tag), bufs


def _merge(acc_o, acc_lse, rows, o, lse) -> None:
    """Fold a block's (o, lse) for query ``rows`` into the running output and log-sum-exp (in place)."""
    old = acc_lse[..., rows]
    new = torch.logaddexp(old, lse)
    acc_o[..., rows, :] = acc_o[..., rows, :] * torch.exp(old - new)[..., None] + o * torch.exp(lse - new)[..., None]
    acc_lse[..., rows] = new


def _block_mask(qmeta, kmeta, rows, cols) -> torch.Tensor:
    pos_q, seg_q = _split_meta(qmeta)
    pos_k, seg_k = _split_meta(kmeta)
    if seg_q is None:
        return _mask(pos_q[rows], pos_k[cols], None, None)
    return _mask(pos_q[rows], pos_k[cols], seg_q[:, rows], seg_k[:, cols])


def ring_forward(qg, k, v, meta, ring: _Ring, scale: float, balanced: bool):
    """Output (b, hkv, g, n, d) and log-sum-exp (b, hkv, g, n) of the local queries against every rank's K/V, in
    the accumulation dtype (fp32 for half-precision inputs)."""
    b, hkv, g, n, d = qg.shape
    acc = _acc_dtype(qg.dtype)
    out = qg.new_zeros((b, hkv, g, n, d), dtype=acc)  # new_*: on q's device even in backward (see below)
    lse = qg.new_full((b, hkv, g, n), float("-inf"), dtype=acc)
    q_acc = qg.to(acc)
    cur = [torch.stack([k, v]), meta]
    for t in range(ring.size):
        handle = None
        if t < ring.size - 1:  # the next shard travels while this one is computed
            handle, nxt = ring.exchange(cur, TAG_KV)
        owner = (ring.rank - t) % ring.size
        rows, cols = _block_slices(n, ring.rank, owner, balanced)
        kv = cur[0][..., cols, :].to(acc)
        mask = _block_mask(meta, cur[1], rows, cols)
        o, l_blk = _block_forward(q_acc[..., rows, :], kv[0], kv[1], mask, scale)
        _accumulate(out, lse, rows, o, l_blk, owner)
        if handle is not None:
            handle.wait()
            cur = nxt
    return out, lse


def _accumulate(out, lse, rows, o, l_blk, owner) -> None:
    """One block's share of the output (a seam for the tests' sabotage: skipping a ring step)."""
    _merge(out, lse, rows, o, l_blk)


def ring_backward(qg, k, v, meta, out, lse, do, ring: _Ring, scale: float, balanced: bool):
    """``dQ`` (b, hkv, g, n, d) and the local ``dK``, ``dV`` (b, hkv, n, d): the second ring pass."""
    b, hkv, g, n, d = qg.shape
    acc = _acc_dtype(qg.dtype)
    q_acc, do_acc = qg.to(acc), do.to(acc)
    delta = (do_acc * out).sum(-1)
    dq = torch.zeros_like(q_acc)
    cur = [torch.stack([k, v]), meta]
    pending = None  # (handle, buffers, sent) of the accumulator travelling to this rank for the current shard
    for t in range(ring.size):
        handle = None
        if t < ring.size - 1:
            handle, nxt = ring.exchange(cur, TAG_KV)
        owner = (ring.rank - t) % ring.size
        rows, cols = _block_slices(n, ring.rank, owner, balanced)
        kv = cur[0][..., cols, :].to(acc)
        mask = _block_mask(meta, cur[1], rows, cols)
        dq_b, dk_b, dv_b = _block_backward(
            q_acc[..., rows, :], kv[0], kv[1], mask, do_acc[..., rows, :], lse[..., rows], delta[..., rows], scale
        )
        dq[..., rows, :] += dq_b
        dkv = qg.new_zeros((2, b, hkv, n, d), dtype=acc)
        dkv[0][..., cols, :] = dk_b
        dkv[1][..., cols, :] = dv_b
        if pending is not None:
            pending[0].wait()
            dkv += pending[1][0]
        if ring.size > 1:  # to the successor, which holds this shard next (the last step: its owner)
            pending = (*ring.exchange([dkv], TAG_DKV), dkv)  # the sent buffer is kept until the wait
        if handle is not None:
            handle.wait()
            cur = nxt
    if pending is not None:
        pending[0].wait()
        dkv = pending[1][0]
    return dq, dkv[0], dkv[1]


def _token_major(out: torch.Tensor) -> torch.Tensor:
    """``out`` (b, h, n, d) with its values laid out token-major, (b, n, h, d) in memory: the attention layer's
    ``out.transpose(1, 2).reshape(b, n, h·d)`` is then a view, so ``o_proj`` saves the tensor the Function saves
    instead of a copy of it (64 more values per token and layer for the tiny model otherwise). A seam: the tests'
    negative control replaces it with the head-major layout."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


class RingAttention(torch.autograd.Function):
    """Ring attention with a ring-pass backward (see the module docstring); use :func:`ring_attend`."""

    @staticmethod
    def forward(ctx, q, k, v, meta, ring, scale, balanced):
        b, h, n, d = q.shape
        hkv = k.shape[1]
        qg = q.contiguous().view(b, hkv, h // hkv, n, d)
        out, lse = ring_forward(qg, k.contiguous(), v.contiguous(), meta, ring, scale, balanced)
        out = _token_major(out.view(b, h, n, d))
        ctx.save_for_backward(q, k, v, meta, out, lse)
        ctx.ring, ctx.scale, ctx.balanced = ring, scale, balanced
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, meta, out, lse = ctx.saved_tensors
        b, h, n, d = q.shape
        hkv = k.shape[1]
        qg = q.contiguous().view(b, hkv, h // hkv, n, d)
        do = grad_out.contiguous().view(b, hkv, h // hkv, n, d)
        out = out.contiguous().view(b, hkv, h // hkv, n, d)
        dq, dk, dv = ring_backward(
            qg, k.contiguous(), v.contiguous(), meta, out, lse, do, ctx.ring, ctx.scale, ctx.balanced
        )
        return dq.view(b, h, n, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: CommGroup | None,
    positions: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    balanced: bool = True,
) -> torch.Tensor:
    """Causal grouped-query attention of this CP rank's tokens against the whole sequence.

    ``q`` (batch, heads, n, head_dim) and ``k``/``v`` (batch, kv_heads, n, head_dim): this rank's ``n`` tokens;
    ``group``: the CP group (ranks in CP order; None or a group of one: no communication); ``positions`` (n,): the
    tokens' global positions (``parallel.context.local_positions``), which decide causality; ``segment_ids``
    (batch, n): packed documents' ids of the local tokens (attention stays within a document), or None.
    ``balanced``: the shards follow ``parallel.context``'s layout, so blocks masked by causality are skipped (give
    False for any other layout: every block is then computed whole and masked). Collective over ``group`` in
    forward and backward. Returns (batch, heads, n, head_dim) in ``q``'s dtype.
    """
    b, h, n, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (n, d) or h % k.shape[1]:
        raise ValueError(f"ring_attend: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if positions.shape != (n,):
        raise ValueError(f"ring_attend: positions must be ({n},), got {tuple(positions.shape)}")
    if balanced and n % 2:
        raise ValueError(f"ring_attend: the balanced layout holds two equal chunks per rank, got {n} tokens")
    meta = positions.to(torch.long)[None]
    if segment_ids is not None:
        if segment_ids.shape != (b, n):
            raise ValueError(f"ring_attend: segment_ids must be ({b}, {n}), got {tuple(segment_ids.shape)}")
        meta = torch.cat([meta, segment_ids.to(dtype=torch.long)])
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    # q, k, v as given (the Function saves them; a contiguous copy would only replace them in memory)
    return RingAttention.apply(q, k, v, meta.contiguous(), _Ring(group), scale, balanced)


def cp_attention(group: CommGroup | None, positions: torch.Tensor | None = None, balanced: bool = True):
    """A function with :func:`~kuangchao_core.models.attention.attend`'s signature, ``(q, k, v, documents=None)``,
    that runs :func:`ring_attend` for this CP rank's tokens: ``positions`` their global positions
    (``parallel.context.local_positions``, on the job's device) — None: those of the load-balanced layout for the
    length of each call's shard (``cp`` times its local length), what the trainer uses —, the documents'
    ``segment_ids`` the local ones (the batch sharded by ``parallel.context.shard_inputs``). What a model's
    attention calls under context parallelism (:func:`use_attention`)."""
    from kuangchao_core.parallel.context import local_positions

    cp = 1 if group is None else group.size
    rank = 0 if group is None else group.rank

    layouts: dict = {}  # (length, device) -> positions: one tensor shared by every layer's saved state

    def attend_cp(q, k, v, documents=None):
        segment_ids = None if documents is None else documents.segment_ids
        here = positions
        if here is None:
            key = (q.shape[-2], q.device)
            if key not in layouts:
                layouts[key] = local_positions(q.shape[-2] * cp, cp, rank).to(device=q.device, dtype=torch.long)
            here = layouts[key]
        return ring_attend(q, k, v, group, here, segment_ids, balanced=balanced)

    return attend_cp


def use_attention(model: torch.nn.Module, fn: Callable | None) -> None:
    """Every attention layer of ``model`` (those with an ``attend_fn``: ``LlamaAttention``, the TP model's too)
    calls ``fn`` (``attend``'s signature; None: ``attend`` itself). Under context parallelism ``fn`` is
    :func:`cp_attention` over the CP group and the batch is sharded by ``parallel.context.shard_inputs`` (its rotary
    ``position_ids`` the tokens' global positions)."""
    for module in model.modules():
        if hasattr(module, "attend_fn"):
            module.attend_fn = fn
