"""Activation memory per rank under context parallelism (issue 30): cp2 holds ≤ 0.55× of cp1 for the same sequence.

Two Gloo processes, fp32, the tiny model's widths with a 128-wide MLP (the narrower MLP makes attention's share of a
layer's activations larger, so the ring's own saved state weighs more), 2 decoder layers, 2 rows of 512 tokens.
Measured as the precision benchmark measures activation memory (``benchmarks/precision_memory.py``): the C heap
bytes the decoder layers' forward leaves held for the backward (``hal.heap``), at cp1 (the whole sequence,
``attend``) and at cp2 (each rank its load-balanced shard, ``ring_attend``), on every rank.

Why 0.55: every tensor a layer saves holds a fixed number of values per local token, and a cp2 rank holds half the
tokens, so the ring's ratio is 0.5 when it saves per token what ``attend`` saves (q, k, v, the output and the
log-sum-exp: what torch's CPU SDPA saves too); the issue's 0.55 leaves 10% of the half for the per-layer state that
is not per token (positions shared by every layer, weights' transposes are views). Measured 0.51.

Negative controls, each on the same sequence: (1) autograd through the ring forward without the ring-pass backward
(every received K/V shard and every block's scores kept) holds more than 0.55× (measured 2.03×); (2) the ring's
previous saving scheme — its output head-major, so the attention layer's ``transpose(1, 2).reshape`` copies it and
``o_proj`` saves the copy beside the Function's own (``ring_attention._token_major`` reverted to the identity) —
holds at least 0.9× that copy's bytes more (measured 0.538× of cp1: this measurement of the decoder layers alone
passed the bound before too, by less).
"""

from __future__ import annotations

from tests.mp import run_distributed

BATCH, SEQ, LAYERS, MLP = 2, 512, 2, 128
BOUND = 0.55


def _held(model, h, position_ids=None, backward=True) -> int:
    import gc

    from kuangchao_core.hal.heap import heap_in_use_bytes

    gc.collect()
    before = heap_in_use_bytes()
    y = model.run_layers(h, position_ids=position_ids)
    gc.collect()
    held = heap_in_use_bytes() - before
    if backward:  # collective at cp2: every rank runs it
        y.sum().backward()
    return held


def _autograd_ring(q, k, v, meta, ring, scale, balanced):
    """The control's ring: ``ring_forward`` under plain autograd (no ring-pass backward)."""
    from kuangchao_core.models.ring_attention import ring_forward

    b, h, n, d = q.shape
    hkv = k.shape[1]
    qg = q.contiguous().view(b, hkv, h // hkv, n, d)
    out, _ = ring_forward(qg, k.contiguous(), v.contiguous(), meta, ring, scale, balanced)
    return out.view(b, h, n, d)


def _body(rank, world_size):
    import torch

    from kuangchao_core.comm.group import CommGroup
    from kuangchao_core.models import ring_attention as ra
    from kuangchao_core.models.llama import LlamaForCausalLM
    from kuangchao_core.parallel.context import shard_sequence
    from kuangchao_core.perm.guard_api import AllowAll, install_guard
    from tests.fixtures import tiny_llama

    install_guard(AllowAll())
    torch.set_num_threads(1)
    group = CommGroup(list(range(world_size)), backend="gloo", name="cp")
    cfg = tiny_llama(intermediate_size=MLP, max_seq_len=SEQ, num_layers=LAYERS)
    model = LlamaForCausalLM(cfg)
    model.init_weights(7)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    full = model.embed(ids).detach().requires_grad_()
    local = shard_sequence(full.detach(), world_size, rank, dim=1).requires_grad_()
    positions = shard_sequence(torch.arange(SEQ).expand(BATCH, -1), world_size, rank, dim=1)

    def cp_run(backward=True) -> int:
        ra.use_attention(model, ra.cp_attention(group))
        try:
            return _held(model, local, positions, backward)
        finally:
            ra.use_attention(model, None)

    out = {}
    for _ in range(2):  # the first pass warms allocator caches and Gloo's buffers; the second is measured
        out["cp1"] = _held(model, full)
        out["cp2"] = cp_run()
    real_layout, real_apply = ra._token_major, ra.RingAttention.apply
    ra._token_major = lambda o: o  # control 1: the previous, head-major output
    try:
        out["cp2_head_major"] = cp_run()
    finally:
        ra._token_major = real_layout
    ra.RingAttention.apply = _autograd_ring  # control 2: no ring-pass backward
    try:
        out["cp2_autograd"] = cp_run(backward=False)  # its in-place merges leave it no valid backward
    finally:
        ra.RingAttention.apply = real_apply
    return out


def test_cp2_holds_at_most_055_of_cp1_activation_bytes():
    # the copy the head-major output costs: o_proj's input, hidden fp32 values per local token and layer
    copy_bytes = 64 * 4 * BATCH * (SEQ // 2) * LAYERS
    for rank, r in enumerate(run_distributed(_body, 2, timeout=180)):
        ratio = {k: r[k] / r["cp1"] for k in ("cp2", "cp2_head_major", "cp2_autograd")}
        print(f"rank {rank}: cp1 {r['cp1']} B, cp2/cp1 {ratio}")
        assert ratio["cp2"] <= BOUND, (rank, ratio)
        assert ratio["cp2_autograd"] > BOUND, (rank, ratio)  # control: the check catches a ring that keeps its shards
        # control: the token-major output is what removes o_proj's copy (heap block rounding moves a measurement by
        # far less than a tenth of those bytes)
        assert r["cp2_head_major"] - r["cp2"] >= 0.9 * copy_bytes, (rank, r, copy_bytes)
