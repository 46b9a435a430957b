"""``benchmarks/context_parallel.py``'s two cp2 sides, checked where they can fail (issue 30): our ring attention
and the all-gather-K/V variant (``benchmarks/_allgather_kv.py``) each give the one-process attention's output and
gradients in float64 on two Gloo ranks, and the bytes the comm layer counts for each equal the formula from the
shapes exactly; the other variant's formula does not fit (the control: the count tells the two apart). The
benchmark's own smoke run (keys, and its exit status 1 when bytes and formula differ) is in
``tests/test_bench_smoke.py``; its times are reported there, never asserted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.mp import run_distributed

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
B, H, HKV, S, D = 2, 4, 2, 16, 8
FP64_TOL = 1e-12  # the same sums in another order: float64 rounding, ~1e-16 relative per operation


def _variants():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("kc_bench_allgather_kv", BENCH / "_allgather_kv.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _full():
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(B, h, S, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV, H))
    return q, k, v, dout


def _body(rank, world):
    from kuangchao_core.comm import COMM_STATS
    from kuangchao_core.comm.group import CommGroup
    from kuangchao_core.models.ring_attention import cp_attention
    from kuangchao_core.parallel.context import local_positions
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    install_guard(AllowAll())
    ag = _variants()
    group = CommGroup(list(range(world)), backend="gloo", name="cp")
    q, k, v, dout = _full()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True).backward(dout)
    pos = local_positions(S, world, rank)
    out = {}
    for name, attend in (("ring", cp_attention(group)), ("allgather", ag.allgather_attention(group))):
        local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        before = COMM_STATS.bytes_by_op()
        o = attend(*local)
        o.backward(dout[:, :, pos])
        # the grads of K/V are the local tokens' share summed over every rank's queries
        ref_out = F.scaled_dot_product_attention(*[t.detach() for t in ref], is_causal=True, enable_gqa=True)
        errs = [(o - ref_out[:, :, pos]).abs().max()]
        errs += [(t.grad - r.grad[:, :, pos]).abs().max() for t, r in zip(local, ref, strict=True)]
        out[name] = {"max_err": float(max(errs)), "counted": ag.counted(before, COMM_STATS.bytes_by_op())}
    k_bytes = B * HKV * (S // world) * D * 8
    out["formula"] = {n: ag.payload_formula(n, k_bytes, S // world, world) for n in ("ring", "allgather")}
    return out


def test_ring_and_allgather_kv_give_the_one_process_attention_and_move_the_bytes_of_their_formulas():
    for rank, got in enumerate(run_distributed(_body, 2)):
        for name in ("ring", "allgather"):
            assert got[name]["max_err"] <= FP64_TOL, (rank, name, got[name])
            assert got[name]["counted"] == got["formula"][name], (rank, name, got)
        # control: each count fits its own formula only
        assert got["ring"]["counted"] != got["formula"]["allgather"]
        assert got["allgather"]["counted"] != got["formula"]["ring"]
    ring, allgather = got["formula"]["ring"], got["formula"]["allgather"]
    ag, n = _variants(), S // 2
    k_shard = B * HKV * n * D * 8  # float64
    # at cp2 a rank sends its K/V and positions twice (forward, backward) and a dK/dV accumulator twice; with the
    # all-gather, its K/V once (forward) and the peer's share of dK/dV once (backward)
    assert ag.sent_bytes(ring, 2) == 2 * (2 * k_shard + 8 * n) + 2 * (2 * k_shard)
    assert ag.sent_bytes(allgather, 2) == 2 * k_shard + 2 * k_shard
