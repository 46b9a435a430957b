"""`kc plan` and `kc recommend` with sequence and context parallelism (issue 30 item 4): activations per rank,
traffic, the step-time model, and the recommendation of CP for a sequence that does not fit.

- SP: the plan's activation bytes against the heap bytes the engine's forward keeps (``tests/test_plan_accuracy``'s
  measurement, two Gloo processes), whole model and the TP-to-SP reduction; control: the plan without SP.
- CP: a rank's activations at cp are 1/cp of cp1's (each rank holds s/cp tokens); control: a plan that ignores cp.
- Traffic and step time: ``group_traffic`` and ``predict_step`` against their formulas written out here from the
  engine's collectives (the SP communication count of ``tests/test_sequence_parallel.py``, the ring's exchanges
  of ``models/ring_attention.py``); control: the same layout without SP / CP gives another number.
- ``recommend``: chooses the smallest cp that fits when no layout without CP fits; with enough memory it does not
  choose CP (the control).
"""

from __future__ import annotations

import dataclasses

import pytest

from kuangchao_core.engine import memory_model
from kuangchao_core.engine.plan import explain_plan, format_plan, rank_memory
from kuangchao_core.engine.recommend import GpuPool, memory_per_rank, recommend
from kuangchao_core.engine.traffic import group_traffic
from kuangchao_core.hal.heap import heap_in_use_bytes
from kuangchao_core.models.llama import LlamaConfig, config_from_model_section
from kuangchao_core.sched.perf_cluster import all_gather_s, all_reduce_s, p2p_s
from kuangchao_core.sched.perf_model import ClusterModel, Layout, predict_step
from tests.engine_helpers import tiny_job
from tests.test_plan_accuracy import MICRO, SEQ, _job, _measure_rank


def _acts(cfg) -> float:
    return rank_memory(cfg, [0])[0]["memory_bytes"]["activations_estimate"]


def _sp_agrees(plan_tp: float, plan_sp: float, held_tp: float, held_sp: float, h: int, layers: int, t: int) -> bool:
    """The plan's SP activations agree with the engine's (the band of ``tests/test_plan_accuracy``, ±30 %): the
    whole model, and the reduction TP → SP. The plan divides the norms' inputs and outputs (4h per token and layer)
    by t; the engine's RMSNorm also keeps its fp32 normalised input (h per norm: 2h per layer), sharded as well,
    and the final norm its input, normalised input and output (3h per token, not in the plan's head term). So the
    measured reduction lies between the plan's and 1.5 × the plan's + 3h(1 − 1/t) per token, each ±30 %."""
    tokens_bytes = SEQ * MICRO * 4  # fp32
    plan_red, held_red = plan_tp - plan_sp, held_tp - held_sp
    final_norm = 3 * h * (1 - 1 / t) * tokens_bytes
    whole = 0.7 * held_sp <= plan_sp <= 1.3 * held_sp
    reduction = 0.7 * plan_red <= held_red <= 1.3 * (1.5 * plan_red + final_norm)
    return whole and reduction


@pytest.mark.distributed
@pytest.mark.skipif(heap_in_use_bytes() is None, reason="needs glibc's mallinfo2 to measure CPU memory")
def test_sequence_parallel_activations_match_what_the_engine_holds(tmp_path):
    from tests.mp import run_distributed

    layers = 4
    cfgs = [_job(str(tmp_path / f"sp{sp}"), layers, tensor_parallel_size=2, sequence_parallel=sp) for sp in (0, 1)]
    per_rank = run_distributed(_measure_rank, 2, args=([{"cfg": c, "acts": True} for c in cfgs],), timeout=300)
    plan_tp, plan_sp = (_acts(c) for c in cfgs)
    h = config_from_model_section(cfgs[0].model).hidden_size
    for rank, res in enumerate(per_rank):
        held_tp, held_sp = res[0]["held"], res[1]["held"]
        print(f"rank {rank}: held TP {held_tp} SP {held_sp}; plan TP {plan_tp:.0f} SP {plan_sp:.0f}")
        assert _sp_agrees(plan_tp, plan_sp, held_tp, held_sp, h, layers, 2), (rank, held_tp, held_sp, plan_sp)
        # the negative control: the plan as it was before it counted SP (TP's activations for the SP job)
        assert not _sp_agrees(plan_tp, plan_tp, held_tp, held_sp, h, layers, 2), (rank, held_tp, held_sp)


def _cfg(tmp, layers: int = 2, seq: int = 128, **parallel):
    return tiny_job(tmp, model={"preset": "tiny", "num_layers": layers}, data={"seq_len": seq}, parallel=parallel)


@pytest.mark.parametrize("mode", ["none", "full"])
def test_context_parallel_activations_per_rank_are_one_over_cp(tmp_path, mode, monkeypatch):
    """Every term of a rank's activations counts its s/cp tokens (the ring keeps only its own shard's q, k, v,
    output and log-sum-exp): exactly 1/cp of cp1's, up to the rounding to whole bytes (1 byte)."""

    def acts(cp: int) -> float:
        cfg = _cfg(str(tmp_path), context_parallel_size=cp, tensor_parallel_size=2, sequence_parallel=True)
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"activation_checkpointing": mode})})
        return _acts(cfg)

    one = acts(1)
    for cp in (2, 4):
        assert acts(cp) == pytest.approx(one / cp, abs=1.0), (cp, acts(cp), one)
    # the negative control: the per-layer and head bytes that ignore cp (the plan before CP) are not 1/cp
    plain_layer, plain_head = memory_model.activation_bytes_per_layer, memory_model.head_activation_bytes

    def whole_sequence(seq, b, mcfg, tp, dtype, mode="none", sp=False, cp=1):
        return plain_layer(seq, b, mcfg, tp, dtype, mode, sp)

    monkeypatch.setattr(memory_model, "activation_bytes_per_layer", whole_sequence)
    assert acts(2) != pytest.approx(one / 2, rel=0.2)  # the layers alone: far from 1/cp
    monkeypatch.setattr(
        memory_model, "head_activation_bytes", lambda seq, b, vocab, tp, cp=1: plain_head(seq, b, vocab, tp)
    )
    assert acts(2) == pytest.approx(one, abs=1.0)


def test_sequence_parallel_traffic_is_the_engines_collectives(tmp_path):
    """Per micro-batch (``test_sequence_parallel_communication_is_megatrons``): forward 2L+1 all-gathers and 2L+1
    reduce-scatters, backward 4L+1 all-gathers and 2L+1 reduce-scatters, each sending (t−1)/t of b·s·h·e, and
    2L+1 norm-weight all-reduces of h·e, each sending 2(t−1)/t of it (ring algorithms)."""
    L, t, b, s, h, e, m = 2, 2, 4, 128, 64, 4.0, 3
    cfg = _cfg(str(tmp_path), L, s, tensor_parallel_size=t, sequence_parallel=True, gradient_accumulation_steps=m)
    gathers = (2 * L + 1) + (4 * L + 1)
    scatters = (2 * L + 1) + (2 * L + 1)
    want = m * ((gathers + scatters) * b * s * h * e * (t - 1) / t + (2 * L + 1) * h * e * 2 * (t - 1) / t)
    assert group_traffic(cfg)["tp"] == pytest.approx(want, rel=1e-12)
    # the control: without SP the estimate is TP's 4 all-reduces per layer, not the SP count
    no_sp = _cfg(str(tmp_path), L, s, tensor_parallel_size=t, gradient_accumulation_steps=m)
    assert group_traffic(no_sp)["tp"] == pytest.approx(4 * L * m * b * s * h * e * 2 * (t - 1) / t, rel=1e-12)
    assert group_traffic(no_sp)["tp"] != pytest.approx(want, rel=0.05)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_traffic_is_the_rings_exchanges(tmp_path, cp):
    """Per layer and micro-batch a CP rank sends its (K, V) on cp−1 times forward and cp−1 times in the backward,
    and (dK, dV) cp times (``ring_backward``: the last hop returns them to their owner): 2(cp−1) + 2(cp−1) + 2cp
    blocks of b·(s/cp)·kv·e, kv = key/value heads per TP rank × head_dim. The TP all-reduces carry s/cp tokens."""
    L, b, s, t = 2, 4, 128, 2
    cfg = _cfg(str(tmp_path), L, s, context_parallel_size=cp, tensor_parallel_size=t)
    mcfg = config_from_model_section(cfg.model)
    kv = mcfg.num_kv_heads // t * mcfg.head_dim
    blocks = 2 * (cp - 1) + 2 * (cp - 1) + 2 * cp
    got = group_traffic(cfg)
    assert got["cp"] == pytest.approx(L * blocks * b * (s / cp) * kv * 4, rel=1e-12)
    assert got["tp"] == pytest.approx(4 * L * b * (s / cp) * mcfg.hidden_size * 4 * 2 * (t - 1) / t, rel=1e-12)
    assert "cp" not in group_traffic(_cfg(str(tmp_path), L, s, tensor_parallel_size=t))  # the control
    text = format_plan(explain_plan(cfg))
    assert f"context parallel: s/{cp} = {s // cp} tokens per rank" in text and "ring attention K/V" in text


MODEL = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


def test_step_time_counts_cp_compute_and_ring():
    """At cp the rank computes T/cp tokens; the ring's 6cp − 4 blocks per layer and micro-batch are counted in full
    (an upper bound: the engine overlaps them); the control is the same layout at cp 1."""
    cluster = ClusterModel.described(1, 8)
    base = Layout(dp=1, tp=2, micro_batch_size=2, gradient_accumulation_steps=3, seq_len=4096)
    one, two = (predict_step(MODEL, dataclasses.replace(base, cp=c), cluster) for c in (1, 2))
    assert two.compute_s == pytest.approx(one.compute_s / 2, rel=1e-12)
    kv = MODEL.num_kv_heads // 2 * (MODEL.hidden_size // MODEL.num_heads)
    ring = MODEL.num_layers * 3 * (6 * 2 - 4) * p2p_s(2 * 4096 / 2 * kv * 4, cluster.intra)
    assert two.cp_comm_s == pytest.approx(ring, rel=1e-12) and one.cp_comm_s == 0.0
    assert sum(two.breakdown.values()) == pytest.approx(two.step_s) and "cp_comm_s" in two.breakdown
    # SP: the same all-reduce-equivalent traffic plus 2L re-gathers and 2L + 1 norm-weight all-reduces per
    # micro-batch (the control: without SP the TP time is the 4 all-reduces per layer alone)
    sp = predict_step(MODEL, dataclasses.replace(base, sequence_parallel=True), cluster)
    link, act = cluster.intra, 2 * 4096 * MODEL.hidden_size * 4
    extra = 3 * (2 * 2 * all_gather_s(act, 2, link) + 5 * all_reduce_s(MODEL.hidden_size * 4, 2, link))
    assert sp.tp_comm_s - one.tp_comm_s == pytest.approx(extra, rel=1e-9) and extra > 0


SEQ_LONG = 16384
LONG = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    max_seq_len=SEQ_LONG,
)


def test_recommend_chooses_the_smallest_cp_when_no_layout_without_it_fits():
    """4 GPUs, 4 sequences of 16384 tokens per step. The least a layout without CP needs (tp2 with SP, ZeRO-2) is
    ~52 MiB per rank, the least with cp2 ~27 MiB: with 40 MiB usable only CP fits, and cp2 is recommended;
    with 1 GiB the control: layouts without CP fit, and the best is not a CP one."""
    usable = 40 * 2**20
    pool = GpuPool(ClusterModel.described(1, 4), usable / 0.9)
    res = recommend(LONG, pool, 4, SEQ_LONG, "fp32")
    assert res["context_parallel"] is not None and res["context_parallel"]["cp"] == 2, res["context_parallel"]
    assert res["top"] and all(r["layout"]["cp"] == 2 for r in res["top"])
    assert all(r["memory_per_rank_bytes"]["total"] <= usable for r in res["top"])
    assert "no layout without context parallelism fits 16384-token sequences" in res["context_parallel"]["why"]
    assert "into 4 chunks, 8192 tokens per rank" in res["context_parallel"]["why"]
    # checked independently: the best layout without CP (tp2 with SP, ZeRO-2 over dp2) needs more than is usable
    least = Layout(dp=2, tp=2, zero_stage=2, micro_batch_size=1, gradient_accumulation_steps=2, seq_len=SEQ_LONG,
                   sequence_parallel=True)  # fmt: skip
    assert memory_per_rank(LONG, least, "fp32")["total"] > usable
    assert memory_per_rank(LONG, dataclasses.replace(least, dp=1, cp=2, zero_stage=0, gradient_accumulation_steps=4),
                           "fp32")["total"] <= usable  # fmt: skip
    ample = recommend(LONG, GpuPool(ClusterModel.described(1, 4), 2**30), 4, SEQ_LONG, "fp32")
    assert ample["context_parallel"] is None and "cp" not in ample["top"][0]["layout"], ample["top"][0]
