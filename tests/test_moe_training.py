"""A tiny MoE model trains through the engine's real one-process path (issue 40): the Trainer in one Gloo process,
float64. The first step's gradients equal a hand-built step that adds the MoE auxiliary losses to the loss (the
control without them disagrees), the loss falls, and ``balance: bias`` moves the routing bias once per step."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from kuangchao_core.ckpt.convert import export_hf
from kuangchao_core.ckpt.lineage import new_lineage_id
from kuangchao_core.errors import CheckpointError
from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss, config_from_model_section
from kuangchao_core.models.moe import MoeStep, moe_blocks
from kuangchao_core.parallel.forward_backward import model_inputs
from tests.engine_helpers import only_lineage, run_trainers, tiny_job, trainer_in_process
from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN

MOE = {"num_experts": 4, "top_k": 2, "num_shared_experts": 1, "layers": [1], "aux_loss_coef": 0.05, "z_loss_coef": 0.01}


def _job(tmp_path, name: str, moe: dict, steps: int = 8):
    return tiny_job(
        str(tmp_path / name),
        model={"preset": "tiny", "num_layers": 2, "moe": moe},
        parallel={"micro_batch_size": 2, "gradient_accumulation_steps": 2},
        train={"steps": steps, "warmup_steps": 0, "dtype": "fp64"},
        optimizer={"lr": 3e-3, "weight_decay": 0.0, "max_grad_norm": None},
        tracking={"log_model": False},  # a MoE model has no Hugging Face export yet
    )


def _reference_grads(cfg, micro_batches, with_aux: bool) -> dict[str, torch.Tensor]:
    """The first step by hand: Σ token losses / N over the micro-batches, plus each one's auxiliary losses / n."""
    model = LlamaForCausalLM(config_from_model_section(cfg.model))
    model.init_weights(cfg.task.seed)
    model = model.double()
    step = MoeStep(model)
    batches = [{k: torch.from_numpy(v) for k, v in b.items()} for b in micro_batches]
    count = sum(int((b["labels"] != -100).sum()) for b in batches)
    for b in batches:
        logits = model(b["input_ids"], **model_inputs(b))
        loss = causal_lm_loss(logits, b["labels"], reduction="sum") / count
        aux = step.micro_batch_loss()
        (loss + aux / len(batches) if with_aux else loss).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_moe_trains_in_the_engine_with_its_aux_loss_in_the_gradient(tmp_path):
    cfg = _job(tmp_path, "aux", MOE)
    (run,) = run_distributed(run_trainers, 1, args=([{"cfg": cfg}],), timeout=300)[0]
    losses = run["losses"]
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0]
    got = {n: torch.from_numpy(g) for n, g in run["first_grads"].items()}
    want = _reference_grads(cfg, run["first_step"], with_aux=True)
    assert set(got) == set(want) and "model.layers.1.mlp.router.weight" in got
    for name, grad in want.items():
        assert torch.allclose(got[name], grad, rtol=1e-9, atol=1e-13), name
    control = _reference_grads(cfg, run["first_step"], with_aux=False)  # the auxiliary losses left out
    router = "model.layers.1.mlp.router.weight"
    assert not torch.allclose(got[router], control[router], rtol=1e-3, atol=1e-8)


def _train_bias(rank: int, world_size: int, cfgs: list) -> list[dict]:
    out = []
    for cfg in cfgs:
        trainer = trainer_in_process(cfg, rank, world_size)
        state = trainer.run(resume="never")
        biases = [b.router.expert_bias.tolist() for b in moe_blocks(trainer.model)]
        out.append({"losses": list(state.losses), "biases": biases})
    return out


def test_bias_balancing_moves_the_bias_once_per_step_in_the_engine(tmp_path, trusted):
    rate = 0.125  # a power of two: every bias is a whole number of steps of it, exactly
    bias = {**MOE, "balance": "bias", "bias_update_rate": rate, "aux_loss_coef": 0.0, "layers": [0, 1]}
    cfgs = [_job(tmp_path, "bias", bias, steps=5), _job(tmp_path, "aux", {**MOE, "layers": [0, 1]}, steps=5)]
    run, control = run_distributed(_train_bias, 1, args=(cfgs,), timeout=300)[0]
    assert run["losses"][-1] < run["losses"][0]
    for layer in run["biases"]:
        steps = [b / rate for b in layer]
        # five updates of ±rate (a load never met the mean exactly here): an odd number of rates, at most five; two
        # updates a step (or none) would give an even number
        assert all(s == round(s) and abs(s) <= 5 and s % 2 == 1 for s in steps), layer
    assert all(b == 0.0 for layer in control["biases"] for b in layer)  # balance aux_loss never touches the bias
    step_dir = sorted(only_lineage(tmp_path / "bias" / "ckpt" / "t").glob("step_*"))[-1]
    # a shared expert and a routing bias are nothing a Mixtral computes: refused, nothing written
    with pytest.raises(CheckpointError, match="not exportable as a Mixtral"):
        export_hf(step_dir, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def _train_layouts(rank: int, world_size: int, jobs: list[dict]) -> list[dict]:
    """Each job's losses, parameters and routing biases; ``resume``, ``max_steps`` and ``lineage`` as
    ``Trainer.run`` takes them. ``unsummed_loads``: the negative control of DP, each replica moving its biases from its
    own loads only (the DP sum of the loads left out); ``forget_biases``: that of a resume."""
    out = []
    for job in jobs:
        trainer = trainer_in_process(job["cfg"], rank, world_size)
        if job.get("unsummed_loads"):  # the bias update handed no summed loads: it reads this process's own
            trainer.parts.after_step = lambda applied, loads, after=trainer.parts.after_step: after(applied, None)
        if job.get("forget_biases"):  # the negative control of a resume: the routing biases not restored
            trainer.parts.load_extra_state = lambda state: None
        state = trainer.run(
            resume=job.get("resume", "never"), max_steps=job.get("max_steps"), lineage=job.get("lineage")
        )
        # numpy arrays travel back by value (tensors would be shared through fds that die with the process)
        params = {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}
        biases = [b.router.expert_bias.numpy().copy() for b in moe_blocks(trainer.model)]
        out.append({"losses": list(state.losses), "params": params, "biases": biases})
    return out


def _layout_job(tmp_path, name: str, dp: int, zero: int = 0, steps: int = 5):
    moe = {**MOE, "layers": [0, 1], "balance": "bias", "bias_update_rate": 0.01, "capacity_factor": 1.0}
    return tiny_job(
        str(tmp_path / name),
        model={"preset": "tiny", "num_layers": 2, "moe": moe},
        data={"seq_len": 16},
        parallel={
            "data_parallel_size": dp,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 4 // dp,
            "zero_stage": zero,
        },
        train={"steps": steps, "warmup_steps": 0, "dtype": "fp64"},
        tracking={"log_model": False},
        checkpoint={"interval": 3},
    )


def _worst(a: dict, b: dict) -> float:
    worst = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"], strict=True))
    for name, p in b["params"].items():
        worst = max(worst, float(np.abs(a["params"][name] - p).max() / np.abs(p).max()))
    return worst


def test_dp2_with_replicated_experts_equals_one_process_in_fp64(tmp_path):
    (one,) = run_distributed(_train_layouts, 1, args=([{"cfg": _layout_job(tmp_path, "one", 1)}],), timeout=300)[0]
    jobs = [
        {"cfg": _layout_job(tmp_path, "dp2", 2)},
        {"cfg": _layout_job(tmp_path, "dp2_zero1", 2, zero=1)},
        {"cfg": _layout_job(tmp_path, "dp2_unsummed", 2), "unsummed_loads": True},
    ]
    ranks = run_distributed(_train_layouts, 2, args=(jobs,), timeout=300)
    dp2, zero1, control = ranks[0]
    assert one["losses"][-1] < one["losses"][0] and any(np.abs(b).sum() > 0 for b in one["biases"])
    for run in (dp2, zero1):
        assert _worst(run, one) < FP64_REL
        for got, want in zip(run["biases"], one["biases"], strict=True):
            assert np.allclose(got, want, rtol=0, atol=1e-12)
    assert all(np.array_equal(a, b) for a, b in zip(ranks[0][0]["biases"], ranks[1][0]["biases"], strict=True))
    # negative control: each replica's own loads move its biases away from one process's
    assert _worst(control, one) > NEGATIVE_MIN


def test_a_resumed_run_restores_the_routing_biases_and_equals_the_straight_run(tmp_path, trusted):
    lineage, control = new_lineage_id(), new_lineage_id(time.time() + 1)
    straight = _layout_job(tmp_path, "straight", 1, steps=6)
    resumed = _layout_job(tmp_path, "resumed", 1, steps=6)
    jobs = [
        {"cfg": straight},
        {"cfg": resumed, "max_steps": 3, "lineage": lineage},
        {"cfg": resumed, "resume": "auto", "lineage": lineage},
        {"cfg": resumed, "max_steps": 3, "lineage": control},
        {"cfg": resumed, "resume": "auto", "lineage": control, "forget_biases": True},
    ]
    ref, first, second, _, forgot = run_distributed(_train_layouts, 1, args=(jobs,), timeout=300)[0]
    saved = json.loads((only_lineage_step(tmp_path / "resumed", lineage, 3) / "state.json").read_text())
    assert [np.float32(v) for v in saved["moe_expert_bias"][0]] == list(first["biases"][0])
    assert any(np.abs(b).sum() > 0 for b in first["biases"])
    assert second["losses"][-3:] == ref["losses"][-3:]
    for got, want in zip(second["biases"], ref["biases"], strict=True):
        assert np.array_equal(got, want)
    for name, value in ref["params"].items():
        assert np.array_equal(second["params"][name], value), name
    assert _worst(forgot, ref) > NEGATIVE_MIN  # biases restarted at zero route other tokens from step 4 on


def only_lineage_step(root, lineage: str, step: int):
    return root / "ckpt" / "t" / lineage / f"step_{step:08d}"
