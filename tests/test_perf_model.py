"""The α–β + FLOP step model, ``kc plan --scale`` and ``kc recommend`` (issue 11 items 5 and 6).

Every formula is checked against numbers worked out by hand in the test; every comparison has a control where the
effect must vanish or reverse (same node: blind = aware; equal links: hierarchical gains nothing; ratio 1: top-k
sends more than dense; a bf16 job: fp16 compression changes nothing).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.config import config_from_dict, load_config
from kuangchao_core.engine.model_shape import shape_for_params, shape_for_section
from kuangchao_core.engine.plan import explain_plan
from kuangchao_core.engine.recommend import GpuPool, carried_settings, format_recommendation, memory_per_rank, recommend
from kuangchao_core.models.llama import LlamaConfig
from kuangchao_core.parallel.state_memory import cast_bytes, state_bytes
from kuangchao_core.sched.perf_cluster import (
    all_gather_s,
    all_reduce_s,
    hierarchical_all_reduce_s,
    p2p_s,
    reduce_scatter_s,
)
from kuangchao_core.sched.perf_groups import group_span
from kuangchao_core.sched.perf_model import (
    ClusterModel,
    Layout,
    LinkModel,
    flops_per_token,
    params_per_rank,
    predict_step,
)
from kuangchao_core.sched.perf_scaling import scaling_efficiency

ROOT = Path(__file__).resolve().parent.parent
LLAMA8B = str(ROOT / "configs" / "llama3-8b-finetune.yaml")
TINY = str(ROOT / "configs" / "tiny.yaml")
RUN = CliRunner()

# A small model whose sizes are easy to work by hand: head dim 16, every projection 64 wide.
MODEL = LlamaConfig(
    vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=4, max_seq_len=64
)
FAST = LinkModel(alpha_s=1e-6, beta_s_per_byte=1e-11)  # 1 us, 100 GB/s
SLOW = LinkModel(alpha_s=1e-5, beta_s_per_byte=1e-9)  # 10 us, 1 GB/s


def cluster(nodes: int, per_node: int, inter: LinkModel = SLOW, links: int = 1) -> ClusterModel:
    return ClusterModel(nodes, per_node, FAST, inter, flops_per_s=1e12, name="test", inter_links_per_node=links)


# ---- links and collectives ----


def test_link_from_latency_and_bandwidth():
    link = LinkModel.from_latency_bandwidth(10.0, 2.0)
    assert link.alpha_s == pytest.approx(1e-5) and link.beta_s_per_byte == pytest.approx(5e-10)
    assert link.shared(3).beta_s_per_byte == pytest.approx(1.5e-9)
    assert link.shared(0.5).beta_s_per_byte == pytest.approx(5e-10)  # never faster than one flow


def test_ring_collectives_by_hand():
    link = LinkModel(1e-5, 5e-10)
    # 2(n-1)/n S beta + 2(n-1) alpha = 1.5 * 1e6 * 5e-10 + 6e-5
    assert all_reduce_s(1e6, 4, link) == pytest.approx(7.5e-4 + 6e-5)
    # (n-1)/n S beta + (n-1) alpha
    assert reduce_scatter_s(1e6, 4, link) == pytest.approx(3.75e-4 + 3e-5)
    assert all_gather_s(1e6, 4, link) == pytest.approx(3.75e-4 + 3e-5)
    assert p2p_s(1e6, link) == pytest.approx(1e-5 + 5e-4)
    assert all_reduce_s(1e6, 1, link) == 0.0 and reduce_scatter_s(1e6, 1, link) == 0.0


def test_hierarchical_all_reduce_by_hand_and_control():
    # RS inside (k=2): 0.5*8e6*1e-11 + 1e-6; AR across 2 nodes of 4e6: 4e6*1e-9 + 2e-5; AG = RS
    hier = hierarchical_all_reduce_s(8e6, 2, 2, FAST, SLOW)
    assert hier == pytest.approx(2 * 4.1e-5 + 4.02e-3)
    flat = all_reduce_s(8e6, 4, SLOW)  # one ring over 4 ranks bounded by the slow link
    assert flat == pytest.approx(0.012 + 6e-5)
    assert hier < 0.35 * flat
    # control: with equal links and no latency the two move the same 1.5*S bytes per rank
    same = LinkModel(0.0, 1e-9)
    assert hierarchical_all_reduce_s(8e6, 2, 2, same, same) == pytest.approx(all_reduce_s(8e6, 4, same))


def test_cluster_from_topology_report():
    report = {
        "nodes": ["a", "b"],
        "node_of_rank": ["a", "a", "b", "b"],
        "backend": "gloo",
        "node_latency_us": [[20.0, 500.0], [600.0, 25.0]],
        "node_bandwidth_gbps": [[2.0, 0.1], [0.12, 1.5]],
    }
    c = ClusterModel.from_topology(report, flops_per_s=5e10)
    assert (c.nodes, c.ranks_per_node, c.world_size, c.inter_links_per_node) == (2, 2, 4, 1)
    assert c.intra.alpha_s == pytest.approx(25e-6) and c.intra.beta_s_per_byte == pytest.approx(1 / 1.5e9)
    assert c.inter.alpha_s == pytest.approx(600e-6) and c.inter.beta_s_per_byte == pytest.approx(1 / 0.1e9)
    one = ClusterModel.from_topology({"node_latency_us": [[30.0]], "node_bandwidth_gbps": [[1.0]]}, 5e10, 2)
    assert one.inter == one.intra and one.world_size == 2
    measured = ClusterModel.from_topology({**report, "flops_per_s": [4e10, 3e10, 5e10, 4e10]})
    assert measured.flops_per_s == 3e10  # the slowest rank sets the pace
    with pytest.raises(ValueError, match="give flops_per_s"):
        ClusterModel.from_topology(report)
    with pytest.raises(ValueError, match="no node latency"):
        ClusterModel.from_topology({"node_latency_us": [], "node_bandwidth_gbps": []}, 5e10)


def test_described_cluster():
    c = ClusterModel.described(2, 8, inter_gbit_per_s=400)
    assert c.world_size == 16 and c.inter_links_per_node == 8
    assert c.inter.beta_s_per_byte == pytest.approx(1 / 50e9)  # 400 Gb/s = 50 GB/s
    assert c.intra.beta_s_per_byte == pytest.approx(1 / 450e9)
    assert c.flops_per_s == pytest.approx(395.8e12)  # 989.5 TFLOP/s x 40 %
    assert c.with_world_size(512).nodes == 64


# ---- where groups land ----


def test_group_spans_aware_and_blind():
    aware = {k: group_span(k, 4, 2, 2, 8, "aware") for k in ("tp", "pp", "dp")}
    assert (aware["tp"].nodes, aware["pp"].nodes) == (1, 1)
    dp = aware["dp"]  # dp group 0 = ranks 0, 4, 8, 12: nodes 0, 0, 1, 1
    assert (dp.nodes, dp.per_node, dp.ring_flows_per_node, dp.crossing_ranks_per_node) == (2, 2, 4, 8)
    blind = group_span("tp", 4, 2, 2, 8, "blind")
    assert (blind.nodes, blind.per_node) == (2, 1)
    assert group_span("tp", 4, 2, 1, 8, "blind").nodes == 1  # control: 8 ranks on one node cross nothing


# ---- the step ----


def test_flops_and_params_by_hand():
    # per layer: q,k,v,o 4 * 64*64 = 16384 + MLP 3*64*128 = 24576 -> 40960; N = 4*40960 + head 1000*64 = 227840
    assert flops_per_token(MODEL, 32) == 6 * 227840 + 12 * 4 * 64 * 32 == 1_465_344
    assert params_per_rank(MODEL, 1, 1) == MODEL.num_params() == 292_416
    # tp 2, pp 2: 2 layers of (q, k, v, o 4 x 64x32 = 8192; MLP 3 x 64x64 = 12288; norms 128 -> 20608)
    # plus max(embedding 500x64 = 32000, head 32000 + final norm 64)
    assert params_per_rank(MODEL, 2, 2) == 2 * 20608 + 32064 == 73_280


def test_params_per_rank_matches_kc_plan():
    for tp, pp in ((1, 1), (2, 1), (4, 1), (2, 2)):  # tiny: 4 heads, 2 kv heads (replicated at tp 4)
        cfg = config_from_dict(
            {
                "task": {"name": "t"},
                "parallel": {
                    "tensor_parallel_size": tp,
                    "pipeline_parallel_size": pp,
                    "gradient_accumulation_steps": 2,
                },
            }
        )
        plan = explain_plan(cfg)
        mcfg = LlamaConfig(**{k: getattr(cfg.model, k) for k in vars(MODEL)})
        assert params_per_rank(mcfg, tp, pp) == max(r["parameters"] for r in plan["ranks"])


def test_predict_dp_step_by_hand():
    layout = Layout(dp=2, micro_batch_size=2, gradient_accumulation_steps=1, seq_len=32, bytes_per_element=4)
    p = predict_step(MODEL, layout, cluster(2, 1), method="flat")
    compute = 1_465_344 * 2 * 32 / 1e12  # F_tok x tokens / flops
    dp = 2 * 1 / 2 * 292_416 * 4 * 1e-9 + 2 * 1e-5  # ring all-reduce over the slow link
    assert p.compute_s == pytest.approx(compute) and p.compute_s == pytest.approx(9.3782016e-5)
    assert p.dp_comm_s == pytest.approx(dp) and p.dp_comm_s == pytest.approx(1.189664e-3)
    assert (p.tp_comm_s, p.pp_comm_s, p.bubble_s) == (0.0, 0.0, 0.0)
    assert p.step_s == pytest.approx(compute + dp)
    assert p.tokens_per_s == pytest.approx(128 / (compute + dp))
    assert sum(p.breakdown.values()) == pytest.approx(p.step_s)
    hidden = predict_step(MODEL, layout, cluster(2, 1), method="flat", overlap_dp=True)
    assert hidden.dp_exposed_s == pytest.approx(dp - 2 / 3 * compute)


def test_predict_tp_and_placement_control():
    layout = Layout(tp=2, micro_batch_size=2, seq_len=32)
    # 4 layers x 1 micro-batch x 4 all-reduces of b*T*h*4 = 16384 bytes over 2 ranks
    inside = predict_step(MODEL, layout, cluster(1, 2))
    assert inside.tp_comm_s == pytest.approx(16 * (16384 * 1e-11 + 2e-6))
    crossing = predict_step(MODEL, layout, cluster(2, 1))
    assert crossing.tp_comm_s == pytest.approx(16 * (16384 * 1e-9 + 2e-5))
    # dp2 x tp2 on 2 nodes x 2: aware keeps TP on the node, blind lets it cross -> slower
    big = Layout(dp=2, tp=2, micro_batch_size=2, seq_len=32)
    aware = predict_step(MODEL, big, cluster(2, 2), placement="aware")
    blind = predict_step(MODEL, big, cluster(2, 2), placement="blind")
    assert blind.tp_comm_s > 10 * aware.tp_comm_s and blind.step_s > aware.step_s
    # control: a job on one node has nothing to misplace
    one = Layout(dp=2, tp=2, micro_batch_size=2, seq_len=32)
    assert predict_step(MODEL, one, cluster(1, 4), placement="blind").step_s == pytest.approx(
        predict_step(MODEL, one, cluster(1, 4), placement="aware").step_s
    )


def test_predict_pipeline_bubble_by_hand():
    layout = Layout(pp=2, micro_batch_size=2, gradient_accumulation_steps=4, seq_len=32)
    p = predict_step(MODEL, layout, cluster(1, 2))
    compute = 1_465_344 * 2 * 4 * 32 / 2 / 1e12
    pp = 2 * 4 * (1e-6 + 16384 * 1e-11)  # activation forward + gradient back per micro-batch
    bubble = (2 - 1) / (4 + 2 - 1)  # the formula kc plan prints
    assert p.compute_s == pytest.approx(1.87564032e-4) and p.pp_comm_s == pytest.approx(pp)
    assert p.step_s == pytest.approx((compute + pp) / (1 - bubble))
    assert p.bubble_s == pytest.approx((compute + pp) * bubble / (1 - bubble))
    cfg = config_from_dict(
        {
            "task": {"name": "t"},
            "model": {"num_layers": 4},
            "parallel": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 4},
        }
    )
    assert explain_plan(cfg)["bubble_fraction"] == pytest.approx(bubble)


def test_hierarchical_beats_flat_only_when_inter_is_slow():
    layout = Layout(dp=4, micro_batch_size=2, seq_len=32)
    s = 292_416 * 4
    slow = cluster(2, 2)  # one shared 1 GB/s link per host, as on the namespace bench
    flat = predict_step(MODEL, layout, slow, method="flat")
    hier = predict_step(MODEL, layout, slow, method="hierarchical")
    assert flat.dp_comm_s == pytest.approx(1.5 * s * 1e-9 + 6e-5)
    # RS + AG inside: 2 x (0.5 S 1e-11 + 1e-6); across: 2 flows share the link: S/2 * 2e-9 + 2e-5
    assert hier.dp_comm_s == pytest.approx(2 * (0.5 * s * 1e-11 + 1e-6) + s / 2 * 2e-9 + 2e-5)
    assert hier.dp_comm_s < 0.7 * flat.dp_comm_s
    # control: equal links -> the shared host link makes hierarchical the slower one
    even = cluster(2, 2, inter=FAST)
    assert (
        predict_step(MODEL, layout, even, method="hierarchical").dp_comm_s
        > predict_step(MODEL, layout, even, method="flat").dp_comm_s
    )


def test_compression_bytes():
    layout = Layout(dp=4, micro_batch_size=2, seq_len=32, bytes_per_element=4)
    c = cluster(2, 2)
    s = 292_416 * 4
    hier = predict_step(MODEL, layout, c, method="hierarchical")
    assert hier.dp_node_out_bytes == pytest.approx(s)  # 2 ranks x 2(m-1)/m x S/2, m = 2 nodes
    fp16 = predict_step(MODEL, layout, c, method="fp16")
    assert fp16.dp_node_out_bytes == pytest.approx(s / 2)
    topk = predict_step(MODEL, layout, c, method="topk", topk_ratio=0.01)
    # 2 ranks x (m-1) x r x (psi/2) x (4 value + 4 index bytes) = 0.02 S
    assert topk.dp_node_out_bytes == pytest.approx(2 * 0.01 * 292_416 / 2 * 8)
    assert topk.dp_node_out_bytes / hier.dp_node_out_bytes == pytest.approx(0.02)
    assert topk.dp_comm_s < hier.dp_comm_s
    # controls: keeping every value sends more than dense; a bf16 job gains nothing from the fp16 cast
    dense_topk = predict_step(MODEL, layout, c, method="topk", topk_ratio=1.0)
    assert dense_topk.dp_node_out_bytes == pytest.approx(2 * hier.dp_node_out_bytes)
    bf16 = Layout(dp=4, micro_batch_size=2, seq_len=32, bytes_per_element=2)
    assert predict_step(MODEL, bf16, c, method="fp16").dp_comm_s == pytest.approx(
        predict_step(MODEL, bf16, c, method="hierarchical").dp_comm_s
    )


def test_zero_costs_the_same_as_all_reduce():
    plain = Layout(dp=4, micro_batch_size=2, seq_len=32)
    zero = Layout(dp=4, micro_batch_size=2, seq_len=32, zero_stage=1)
    for method in ("flat", "hierarchical"):
        assert predict_step(MODEL, zero, cluster(2, 2), method=method).dp_comm_s == pytest.approx(
            predict_step(MODEL, plain, cluster(2, 2), method=method).dp_comm_s
        )


def test_scaling_efficiency_by_hand():
    layout = Layout(micro_batch_size=2, seq_len=32)
    template = cluster(1, 1)
    compute, dp = 9.3782016e-5, 1.189664e-3  # from test_predict_dp_step_by_hand
    assert scaling_efficiency(MODEL, layout, template, 2, method="flat") == pytest.approx(compute / (compute + dp))
    assert scaling_efficiency(MODEL, layout, template, 1, method="flat") == pytest.approx(1.0)  # control


def test_bad_inputs_refused():
    with pytest.raises(ValueError, match="method"):
        predict_step(MODEL, Layout(), cluster(1, 1), method="ring")
    with pytest.raises(ValueError, match="needs 4 ranks"):
        predict_step(MODEL, Layout(dp=4), cluster(1, 2))
    with pytest.raises(ValueError, match="multiple of tp x pp"):
        scaling_efficiency(MODEL, Layout(tp=4), cluster(1, 8), 6)


# ---- memory and recommend ----


def test_state_bytes_are_what_the_engine_allocates():
    # fp32 params (the master weights under autocast), grads and AdamW moments; fp64 twice (test_memory_model.py)
    for dtype, b in (("fp32", 4), ("bf16", 4), ("fp16", 4), ("fp64", 8)):
        z = [sum(state_bytes(1000, 4, stage, dtype).values()) for stage in (0, 1, 2, 3)]
        assert z == [4 * b * 1000, (2 * b + 2 * b / 4) * 1000, (b + 3 * b / 4) * 1000, 4 * b * 1000 / 4]
    assert cast_bytes(1000, 2, "bf16") == 4000 and cast_bytes(1000, 2, "fp32") == 0  # autocast's copies
    assert state_bytes(10, 4, 1, "bf16", frozen=1000) == {"params": 4040, "grads": 40, "optimizer": 20}  # LoRA
    assert state_bytes(10, 4, 3, frozen=1000)["params"] == 1010  # ZeRO-3 shards a LoRA base too
    z = [sum(state_bytes(1000, 4, stage, "bf16", param_dtype="bf16").values()) for stage in (0, 1, 2, 3)]
    assert z == [2000 + 4000 + 12000, 2000 + 4000 + 3000, 2000 + 1000 + 3000, 500 + 1000 + 3000]  # 2 + 4 + 12/N


def test_memory_per_rank_keeps_the_jobs_lora_and_checkpointing_as_kc_plan_does():
    par = {"data_parallel_size": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 1}
    par.update(gradient_accumulation_steps=4, micro_batch_size=2)
    lora = {"rank": 4, "targets": ["q_proj", "v_proj"]}
    train = {"dtype": "bf16", "activation_checkpointing": "selective"}
    cfg = config_from_dict({"task": {"name": "t"}, "model": {"num_layers": 4, "lora": lora}, "data": {"seq_len": 64},
                            "parallel": par, "train": train})  # fmt: skip
    plan_total = max(r["memory_bytes"]["total"] for r in explain_plan(cfg)["ranks"])
    mcfg = LlamaConfig(**{k: getattr(cfg.model, k) for k in vars(MODEL)})
    mine = memory_per_rank(mcfg, Layout.from_config(cfg), "bf16", carried_settings(cfg))
    assert mine["total"] == plan_total
    assert memory_per_rank(mcfg, Layout.from_config(cfg), "bf16")["total"] != plan_total  # without them: not


def test_recommend_8b():
    m8, note = shape_for_params(8e9)
    assert "llama3-8b" in note and m8.num_params() == 8_030_261_248
    small = recommend(m8, GpuPool(ClusterModel.described(1, 1), 24e9), 128, 2048, "bf16")
    assert small["top"] == [] and small["valid"] == 0
    assert [e["reason"].split(":")[0] for e in small["rejections"]] == ["out of memory"]
    assert small["rejections"][0]["count"] == small["considered"]
    big = recommend(m8, GpuPool(ClusterModel.described(2, 8), 80e9), 128, 2048, "bf16")
    assert big["top"], big["rejections"]
    best = big["top"][0]
    assert best["memory_per_rank_bytes"]["total"] <= 0.9 * 80e9
    assert best["step_s"] == min(r["step_s"] for r in big["top"])
    assert (lay := best["layout"])["dp"] * lay["tp"] * lay["pp"] == 16


def test_recommend_groups_rejections_by_reason():
    odd = LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=256, num_layers=3, num_heads=6, num_kv_heads=2)
    res = recommend(odd, GpuPool(ClusterModel.described(1, 8), 80e9), 64, 64, "fp32")
    reasons = {e["reason"]: e for e in res["rejections"]}
    heads = [r for r in reasons if "num_heads N is not divisible by tensor_parallel_size N" in r]
    layers = [r for r in reasons if "num_layers N is not divisible by pipeline_parallel_size" in r]
    assert heads and layers, list(reasons)
    assert all(r["layout"]["tp"] in (1, 2) and r["layout"]["pp"] == 1 for r in res["top"])  # 6 heads, 3 layers
    text = format_recommendation(res).split("rejected", 1)[1]  # issue 45: each group with its example's numbers
    assert "num_heads 6 is not divisible by tensor_parallel_size" in text and "num_heads N" not in text, text


def test_shape_from_unreadable_checkpoint_uses_params():
    cfg = load_config(LLAMA8B)
    shape, note = shape_for_section(cfg.model)
    assert shape.num_layers == 32 and "model.checkpoint unusable" in note


# ---- the CLI ----


def test_kc_recommend_on_the_8b_example():
    res = RUN.invoke(app, ["recommend", "--config", LLAMA8B, "--nodes", "2", "--gpus-per-node", "8"])
    assert res.exit_code == 0, res.output
    assert "the best 5:" in res.stdout and "mem/rank GiB" in res.stdout
    assert "the config's layout (dp 4 tp 2 pp 2 zero 0 micro 4 accum 8): #" in res.stdout
    as_json = RUN.invoke(app, ["recommend", "--config", LLAMA8B, "--nodes", "2", "--gpus-per-node", "8", "--json"])
    data = json.loads(as_json.stdout)
    assert len(data["top"]) == 5 and data["world_size"] == 16 and data["current"]["row"] is not None


def test_kc_recommend_out_of_memory_and_bad_input():
    res = RUN.invoke(
        app, ["recommend", "--params", "8e9", "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "24"]
    )
    assert res.exit_code == 1 and "no layout fits" in res.stdout and "out of memory" in res.stdout
    for args, option in (
        (["--params", "8e9", "--nodes", "1", "--gpus-per-node", "1", "--method", "ring"], "--method"),
        (["--params", "-1", "--nodes", "1", "--gpus-per-node", "1"], "--params"),
        (["--params", "8e9"], "--nodes/--gpus-per-node"),
        (["--model", "nope", "--nodes", "1", "--gpus-per-node", "1"], "--model"),
        (["--params", "8e9", "--nodes", "0", "--gpus-per-node", "1"], "--nodes"),
    ):
        bad = RUN.invoke(app, ["recommend", *args])
        assert bad.exit_code == 2 and option in bad.output, (args, bad.output)
        assert isinstance(bad.exception, SystemExit)  # no traceback


def test_kc_plan_scale_512_on_the_8b_example():
    res = RUN.invoke(app, ["plan", "--config", LLAMA8B, "--scale", "512"])
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "model.checkpoint unusable here" in out and "layout: dp=4 x tp=2 x pp=2" in out
    assert "weak-scaling efficiency" in out and "topk 1%" in out and "hierarchical" in out
    assert sum(line.strip().startswith("512") for line in out.splitlines()) == 2  # 200 and 400 Gb/s
    data = json.loads(RUN.invoke(app, ["plan", "--config", LLAMA8B, "--scale", "512", "--json"]).stdout)
    rows = data["scale"]["scaling"]
    assert len(rows) == 8 and {r["inter_gbit_per_s"] for r in rows} == {200.0, 400.0}
    m8 = shape_for_section(load_config(LLAMA8B).model)[0]
    layout = Layout.from_config(load_config(LLAMA8B))
    for r in rows:
        direct = scaling_efficiency(
            m8, layout, ClusterModel.described(64, 8, inter_gbit_per_s=r["inter_gbit_per_s"]), 512, r["method"]
        )
        assert r["efficiency"] == pytest.approx(direct)
    by = {(r["inter_gbit_per_s"], r["method"]): r["efficiency"] for r in rows}
    assert by[(400.0, "hierarchical")] > by[(400.0, "flat")] and by[(400.0, "flat")] > by[(200.0, "flat")]


def test_kc_plan_without_scale_is_unchanged():
    res = RUN.invoke(app, ["plan", "--config", TINY])
    assert res.exit_code == 0 and "weak-scaling" not in res.stdout
    from kuangchao_core.engine.plan import format_plan

    assert res.stdout.strip() == format_plan(explain_plan(load_config(TINY))).strip()
    # a checkpoint not on this machine: planned with model.params' shape, and said to be refused by kc train
    sized = RUN.invoke(app, ["plan", "--config", LLAMA8B])
    assert sized.exit_code == 0 and "from model.params" in sized.output, sized.output
    assert "model.checkpoint is not readable here; kc train would refuse it" in sized.output
    unsized = RUN.invoke(app, ["plan", "--config", LLAMA8B, "--set", "model.params=null"])
    assert unsized.exit_code == 2 and "model.checkpoint" in unsized.output  # nothing to size it by
    bad = RUN.invoke(app, ["plan", "--config", LLAMA8B, "--scale", "6"])
    assert bad.exit_code == 2 and "--scale" in bad.output
