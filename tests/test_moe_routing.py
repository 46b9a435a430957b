"""A MoE model's routing, seen (issue 40 item 5): the tokens per expert a step counts, the metrics made of them, the
history the plot is drawn from, the Prometheus gauges and ``kc debug routing``; all in one process.

The counts are checked against the router's own choices counted one by one in Python, and a batch split between
two "ranks" (separate step objects on the same model) sums to the one-process count exactly — what the trainer's
all-reduce of ``engine.step_values`` relies on (the real two-process run: tests/test_expert_parallel_training.py).
Every comparison has a negative control.
"""

from __future__ import annotations

import json
from collections import Counter

import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch import nn
from typer.testing import CliRunner

from kuangchao_core.engine.routing_report import (
    MAX_EXPERT_METRICS,
    LoadHistory,
    RoutingReport,
    imbalance,
    routing_metrics,
    routing_path,
    write_routing,
)
from kuangchao_core.engine.step_values import start_step_values
from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM
from kuangchao_core.models.moe import MoeConfig, MoeStep, decoder_layers, moe_blocks, moe_step
from kuangchao_core.obs.prometheus import JobMetrics

E = 4
CFG = LlamaConfig(num_layers=4, moe=MoeConfig(num_experts=E, top_k=2, layers=(1, 3)))


def _model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(CFG)
    model.init_weights(5)
    return model.double()


def _batch(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n, 16), generator=torch.Generator().manual_seed(seed))


def _run(model: nn.Module, micro_batches: list[torch.Tensor]) -> tuple[torch.Tensor, dict[int, Counter]]:
    """The step's loads (MoeStep.step_loads) and, beside them, each layer's router choices counted one by one."""
    step = moe_step(model, CFG.moe, CFG.num_layers)
    chosen: dict[int, Counter] = {1: Counter(), 3: Counter()}
    hooks = [
        block.router.register_forward_hook(
            lambda m, i, out, layer=layer: chosen[layer].update(out.index.flatten().tolist())
        )
        for block, layer in zip(moe_blocks(model), decoder_layers(model), strict=True)
    ]
    with torch.no_grad():
        for ids in micro_batches:
            model(ids)
            step.micro_batch_loss()
    for h in hooks:
        h.remove()
    return step.step_loads(), chosen


def test_step_loads_count_the_routers_choices_and_split_batches_sum_to_the_whole():
    model, batch = _model(), _batch(4)
    whole, chosen = _run(model, [batch[:2], batch[2:]])  # one process: two micro-batches
    assert whole.dtype == torch.float64 and whole.shape == (2, E)
    for row, layer in enumerate((1, 3)):  # rows follow the MoE layers, each the router's choices, one by one
        assert whole[row].tolist() == [float(chosen[layer][e]) for e in range(E)]
        assert whole[row].sum() == 4 * 16 * 2  # tokens × top_k
    rank0, _ = _run(model, [batch[:1], batch[2:3]])  # two data-parallel ranks, each its share of the same batch
    rank1, _ = _run(model, [batch[1:2], batch[3:]])
    assert torch.equal(rank0 + rank1, whole)  # what the trainer's all-reduce sums: one process's count, exactly
    assert not torch.equal(rank0, whole) and not torch.equal(rank0 * 2, whole)  # control: one rank's own is not it
    assert not torch.equal(whole, whole[[1, 0]])  # control: the layers' rows are told apart


def test_a_pipeline_stage_without_a_layer_has_its_row_of_zeros():
    model = _model()
    model.model.layers[2] = nn.Identity()  # a later stage's layers (pruned as parallel_model does)
    model.model.layers[3] = nn.Identity()
    assert decoder_layers(model) == [1]
    step = moe_step(model, CFG.moe, CFG.num_layers)
    assert step.layers == [1, 3] and step.rows == [0]
    with torch.no_grad():  # the stage's block on 16 tokens (a stage's part runs under the pipeline executor)
        moe_blocks(model)[0](torch.randn(16, CFG.hidden_size, dtype=torch.float64))
    step.micro_batch_loss()
    loads = step.step_loads()
    assert loads.shape == (2, E) and loads[0].sum() == 16 * 2 and not loads[1].any()
    alone = MoeStep(model)  # control: without the model's MoE layers the stage's step has another shape
    assert alone.step_loads().shape == (1, E)


def test_step_values_reads_the_loss_norm_and_loads_in_one_and_hands_the_bias_the_summed_loads():
    cfg = LlamaConfig(num_layers=2, moe=MoeConfig(num_experts=E, top_k=1, balance="bias", bias_update_rate=0.5))
    model = LlamaForCausalLM(cfg).double()
    model.init_weights(2)
    step = moe_step(model, cfg.moe, cfg.num_layers)
    with torch.no_grad():
        model(_batch(2))
    step.micro_batch_loss()
    got = start_step_values(torch.tensor(3.5), step, "cpu", None, None).finish(torch.tensor(0.25))
    assert (got.loss_sum, got.grad_norm) == (3.5, 0.25) and torch.equal(got.loads, step.step_loads())
    assert got.expert_load == {0: got.loads[0].long().tolist(), 1: got.loads[1].long().tolist()}
    other = got.loads.clone()
    other[:, 0] += 1000  # a load the other ranks add: expert 0 becomes the busiest
    step.after_step(True, other)
    assert all(b.router.expert_bias[0] == -0.5 for b in step.blocks)  # moved by the summed loads handed in
    assert step.loads == [None, None]
    plain = start_step_values(torch.tensor(1.0), None, "cpu", None, None).finish(torch.tensor(2.0))
    assert plain.loads is None and plain.expert_load is None  # a dense model sends and reads its loss alone


def test_metrics_name_each_layer_and_expert_and_the_imbalance_is_max_over_mean():
    load = {1: [6, 2, 0, 0], 3: [2, 2, 2, 2]}
    got = routing_metrics(load)
    assert got["moe_imbalance.l1"] == 3.0 and got["moe_imbalance.l3"] == 1.0  # 6 / (8/4); balanced: 1
    assert got["moe_imbalance"] == 3.0  # the worst layer
    assert [got[f"moe_tokens.l1.e{i}"] for i in range(4)] == [6.0, 2.0, 0.0, 0.0]
    assert routing_metrics({1: [2, 6, 0, 0]})["moe_tokens.l1.e0"] == 2.0  # control: experts not mixed up
    assert imbalance([0, 0]) is None and "moe_imbalance" not in routing_metrics({0: [0, 0]})
    wide = {layer: [1] * 64 for layer in range(MAX_EXPERT_METRICS // 64 + 1)}  # more counts than logged per step
    report = RoutingReport(None)
    logged = report.metrics(wide)
    assert not any(k.startswith("moe_tokens") for k in logged) and logged["moe_imbalance"] == 1.0
    assert any(k.startswith("moe_tokens") for k in report.metrics({0: [1] * 64}))  # control: under the cap


def test_the_history_stays_bounded_and_spread_over_the_run():
    history = LoadHistory(points=10)
    for step in range(1, 101):
        history.add(step, {0: [step, 0]})
    assert len(history.steps) <= 10 and history.steps[0] == 1 and history.steps[-1] >= 80
    gaps = {b - a for a, b in zip(history.steps, history.steps[1:], strict=False)}
    assert gaps == {history.stride}  # evenly spread
    assert [d[0][0] for d in history.loads] == history.steps  # each step's own counts


def test_prometheus_gauges_per_layer_and_expert():
    metrics = JobMetrics("t", "r")
    step = {"event": "steps", "step": 3, "loss": 1.0, **routing_metrics({1: [6, 2, 0, 0], 3: [2, 2, 2, 2]})}
    metrics.observe(step)
    samples = {
        (s.name, s.labels.get("layer"), s.labels.get("expert")): s.value
        for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in fam.samples
    }
    assert samples[("kuangchao_train_moe_load_imbalance", None, None)] == 3.0
    assert samples[("kuangchao_train_moe_layer_load_imbalance", "3", None)] == 1.0
    assert samples[("kuangchao_train_moe_expert_tokens", "1", "0")] == 6.0
    assert samples[("kuangchao_train_moe_expert_tokens", "1", "1")] == 2.0  # control: each expert its own value
    assert ("kuangchao_train_moe_expert_tokens", "1", "4") not in samples


def test_kc_debug_routing_shows_the_last_logged_step(tmp_path):
    from kuangchao.cli.main import app

    report = RoutingReport(tmp_path)
    report.note(5, {1: [6, 2, 0, 0]}, log_line=True)
    report.note(6, {1: [0, 0, 0, 8]}, log_line=False)  # not a log line: the file keeps step 5
    assert json.loads(routing_path(tmp_path).read_text())["step"] == 5
    res = CliRunner().invoke(app, ["debug", "routing", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "step 5" in res.output and "imbalance 3.000" in res.output
    assert "expert    0            6   75.0%" in res.output and "expert    3            0    0.0%" in res.output
    write_routing(tmp_path, 9, {1: [1, 1, 1, 1]})
    as_json = json.loads(CliRunner().invoke(app, ["debug", "routing", str(tmp_path), "--json"]).output)
    assert as_json["step"] == 9 and as_json["layers"]["1"]["imbalance"] == 1.0
    missing = CliRunner().invoke(app, ["debug", "routing", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "no MoE routing record" in missing.output


def test_the_expert_load_plot_shows_at_most_a_few_layers_spread_over_the_model():
    from kuangchao_core.obs.expert_load_plot import MAX_LAYER_PANELS, load_shares, shown_layers

    assert shown_layers([1, 3]) == [1, 3]
    shown = shown_layers(list(range(0, 40, 2)))
    assert len(shown) == MAX_LAYER_PANELS and shown[0] == 0 and shown[-1] == 38
    shares = load_shares([{1: [6, 2, 0, 0]}, {1: [0, 0, 0, 0]}], 1)
    assert shares.tolist() == [[0.75, 0.0], [0.25, 0.0], [0.0, 0.0], [0.0, 0.0]]  # experts × steps; none routed: 0
