"""``kc plan`` and ``kc recommend`` for a MoE model (issue 40 item 5), in one process: the routed experts' memory
split over ``parallel.expert_parallel_size``, the tokens' all-to-all and the experts' gradient sum in the traffic
estimate, the step-time model's active FLOPs, expert parameters and all-to-all time, and ep among the layouts
``kc recommend`` tries. Every figure is checked against the formula written out here, with a control.

The tiny preset: hidden 64, MLP width 176 (each expert's too), 2 layers, both MoE with 4 experts, top-2.
"""

from __future__ import annotations

import pytest

from kuangchao_core.engine.plan import explain_plan, format_plan
from kuangchao_core.engine.recommend import GpuPool, format_recommendation, recommend
from kuangchao_core.engine.traffic import group_traffic
from kuangchao_core.models.llama import LlamaConfig
from kuangchao_core.models.moe import MoeConfig
from kuangchao_core.sched.perf_model import ClusterModel, Layout, matmul_params, params_per_rank, predict_step
from kuangchao_core.sched.perf_moe import all_to_all_s
from tests.engine_helpers import tiny_job

H, W, E, K, LAYERS = 64, 176, 4, 2, 2
EXPERTS = LAYERS * 3 * H * W * E  # the routed experts' elements: what ep splits


def _job(tmp_path, dp: int, ep: int):
    moe = {"preset": "tiny", "num_layers": LAYERS, "moe": {"num_experts": E, "top_k": K}}
    return tiny_job(str(tmp_path), model=moe, parallel={"data_parallel_size": dp, "expert_parallel_size": ep})


def test_kc_plan_holds_e_over_ep_experts_per_rank(tmp_path):
    one, two, four = (explain_plan(_job(tmp_path, 4, ep)) for ep in (1, 2, 4))
    params = one["ranks"][0]["parameters"]
    assert params == one["model_parameters"]  # ep 1: every expert on every rank
    for plan, ep in ((two, 2), (four, 4)):
        for rank in plan["ranks"]:
            assert rank["parameters"] == params - EXPERTS + EXPERTS // ep
            mem, full = rank["memory_bytes"], one["ranks"][0]["memory_bytes"]
            saved = 4 * EXPERTS * (1 - 1 / ep)  # fp32 at ZeRO 0: weights, gradients, and AdamW's two moments twice
            assert (full["params"] - mem["params"], full["grads"] - mem["grads"]) == (saved, saved)
            assert full["optimizer"] - mem["optimizer"] == 2 * saved
    assert two["ranks"][0]["parameters"] != four["ranks"][0]["parameters"]  # control: the split follows ep
    assert "0.74 / 0.74 / 1.48" in format_plan(two)  # the rows kc plan prints (MiB)


def test_traffic_counts_the_all_to_all_and_the_experts_gradient_sum_by_hand(tmp_path):
    cfg = _job(tmp_path, 4, 2)
    b, s, m = cfg.parallel.micro_batch_size, cfg.data.seq_len, cfg.parallel.gradient_accumulation_steps
    got = group_traffic(cfg)
    rows = 4 * b * s * K * H * 4 + 8 * E  # 4 exchanges of the rows (fp32), the counts once, per layer
    assert got["ep"] == m * LAYERS * rows * (2 - 1) / 2
    assert got["dp_mod_ep"] == 2 * (2 - 1) / 2 * (EXPERTS // 2) * 4  # the experts' half over the 2 replicas
    plan_params = explain_plan(_job(tmp_path, 4, 1))["model_parameters"]
    assert got["dp"] == 2 * 3 / 4 * (plan_params - EXPERTS) * 4  # the rest over all 4
    without = group_traffic(_job(tmp_path, 4, 1))  # control: no ep, the experts ride in the dp all-reduce
    assert "ep" not in without and without["dp"] == 2 * 3 / 4 * plan_params * 4
    assert "ep 0.25 (tokens' all-to-all)" in format_plan(explain_plan(cfg))


MOE = LlamaConfig(
    vocab_size=256,
    hidden_size=H,
    intermediate_size=W,
    num_layers=LAYERS,
    num_heads=4,
    num_kv_heads=2,
    moe=MoeConfig(num_experts=E, top_k=K, num_shared_experts=1),
)


def test_the_step_model_counts_active_flops_every_expert_and_the_all_to_all():
    dense = LlamaConfig(**{**vars(MOE), "moe": None})
    per_layer_active = H * E + 3 * H * W * (K + 1) - 3 * H * W  # router, top-2 and the shared one, not the dense MLP
    assert matmul_params(MOE) == matmul_params(dense) + LAYERS * per_layer_active
    assert params_per_rank(MOE, 1, 1) == MOE.num_params()  # every expert, as the model holds them
    assert params_per_rank(dense, 1, 1) != MOE.num_params()  # control: the dense count is not the MoE model's
    cluster = ClusterModel.described(1, 4)
    layout = Layout(dp=4, micro_batch_size=2, gradient_accumulation_steps=2, seq_len=64, ep=2)
    got = predict_step(MOE, layout, cluster, method="flat")
    rows = 2 * 64 * K * H * 4
    by_hand = 2 * LAYERS * (4 * all_to_all_s(rows, 2, cluster.intra) + all_to_all_s(8 * E, 2, cluster.intra))
    assert got.ep_comm_s == pytest.approx(by_hand) and got.breakdown["ep_comm_s"] == got.ep_comm_s
    assert all_to_all_s(rows, 2, cluster.intra) == pytest.approx(
        cluster.intra.alpha_s + rows / 2 * cluster.intra.beta_s_per_byte
    )
    assert sum(got.breakdown.values()) == pytest.approx(got.step_s)
    flat = predict_step(MOE, Layout(dp=4, micro_batch_size=2, gradient_accumulation_steps=2, seq_len=64), cluster)
    assert flat.ep_comm_s == 0.0 and "ep_comm_s" not in flat.breakdown  # control: ep 1 exchanges nothing
    assert got.dp_bytes_per_rank < flat.dp_bytes_per_rank  # E/ep experts summed over 2 ranks, not E over 4


def test_kc_recommend_tries_ep_for_a_moe_model_at_zero_0():
    res = recommend(MOE, GpuPool(ClusterModel.described(1, 4), 80e9), 16, 64, "fp32", top_k=100)
    eps = {(r["layout"].get("ep", 1), r["layout"]["zero_stage"]) for r in res["top"] if r["layout"]["dp"] == 4}
    assert {(1, 0), (2, 0), (4, 0), (1, 1)} <= eps and not any(ep > 1 and z for ep, z in eps)
    rows = {
        r["layout"].get("ep", 1): r
        for r in res["top"]
        if r["layout"]["dp"] == 4 and r["layout"]["zero_stage"] == 0 and r["layout"]["micro_batch_size"] == 1
    }
    assert rows[2]["memory_per_rank_bytes"]["total"] < rows[1]["memory_per_rank_bytes"]["total"]
    assert rows[2]["breakdown"]["ep_comm_s"] > 0 and "ep_comm_s" not in rows[1]["breakdown"]
    assert "   #   dp  cp  tp  sp  pp  ep  zero" in format_recommendation(res)
    dense = recommend(
        LlamaConfig(**{**vars(MOE), "moe": None}),
        GpuPool(ClusterModel.described(1, 4), 80e9),
        16,
        64,
        "fp32",
        top_k=100,
    )
    assert not any("ep" in r["layout"] for r in dense["top"])  # control: a dense model has no experts to split
