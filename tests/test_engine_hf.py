"""Fine-tuning from a Hugging Face Llama directory through the engine (issue 3 §7), pinned against transformers.

A tiny random ``transformers.LlamaForCausalLM`` (eager attention, fp32, 4 layers, grouped-query attention) is saved
with ``save_pretrained``; jobs with ``model.checkpoint`` pointing at it (no preset: the shape comes from its
``config.json``) run at tp1 and tp2×pp2:

- each rank's loaded slices, reassembled through the trainer's regions, are exactly the HF tensors, and our
  one-process model built from them gives transformers' logits within 1e-5 (so every rank read the right slices);
- the first training step's loss, computed by the engine (at tp2×pp2 through the pipeline executor: stage chunks,
  send/recv, vocabulary-parallel cross-entropy), equals the loss of transformers' logits on the same batch;
- the fine-tuned tp2×pp2 checkpoint exported with ``kc checkpoint convert --format hf`` loads back into
  ``transformers.LlamaForCausalLM`` with no missing or unexpected keys and the engine model's logits.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss, load_hf_llama_config
from tests.engine_helpers import gather_full, only_lineage, run_trainers, save_random_hf_llama, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP32_LOSS_REL, assert_logits_match

transformers = pytest.importorskip("transformers")

LAYERS = 4
TP2_PP2 = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}


def _save_hf_model(path: Path):
    return save_random_hf_llama(path, LAYERS)


def _job(root: Path, hf_dir: Path, parallel: dict, steps: int):
    return tiny_job(
        str(root),
        task={"name": "finetune", "seed": 3},
        model={"preset": None, "num_layers": None, "checkpoint": str(hf_dir)},
        data={"seq_len": 16},
        parallel={"micro_batch_size": 2, "gradient_accumulation_steps": 2, **parallel},
        train={"steps": steps, "warmup_steps": 0},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine_hf")
    hf_dir = tmp / "hf"
    hf = _save_hf_model(hf_dir)
    out = {"hf": hf, "hf_dir": hf_dir, "tmp": tmp}
    for label, world, parallel in (("tp1", 1, {}), ("tp2pp2", 4, TP2_PP2)):
        # job 1 only loads (0 steps); job 2 fine-tunes one step and writes its final checkpoint
        jobs = [
            {"cfg": _job(tmp / f"{label}_load", hf_dir, parallel, 1), "max_steps": 0},
            {"cfg": _job(tmp / f"{label}_ft", hf_dir, parallel, 1)},
        ]
        per_rank = run_distributed(run_trainers, world, args=(jobs,), timeout=300)
        out[f"{label}_load"] = [r[0] for r in per_rank]
        out[f"{label}_ft"] = [r[1] for r in per_rank]
    return out


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits computed in float64 (on a copy), so comparisons measure the weights, not fp32 kernels."""
    with torch.no_grad():
        return copy.deepcopy(hf).double()(input_ids=ids).logits


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["tp1", "tp2pp2"])
def test_hf_weights_load_through_engine_with_transformers_logits(runs, layout):
    loaded = runs[f"{layout}_load"]
    if layout == "tp2pp2":  # each rank holds only part of the model: half of a TP split, half of the layers
        q = "model.layers.0.self_attn.q_proj.weight"
        assert loaded[0]["params"][q].shape == (32, 64)
        assert "model.layers.3.mlp.up_proj.weight" not in loaded[0]["params"]
        assert "lm_head.weight" not in loaded[0]["params"] and "model.embed_tokens.weight" not in loaded[2]["params"]
    full = gather_full(loaded)
    hf_state = {n: t.detach() for n, t in runs["hf"].state_dict().items()}
    assert set(full) == {n for n in hf_state if "rotary" not in n}
    for name, value in full.items():
        np.testing.assert_array_equal(value, hf_state[name].numpy(), err_msg=f"{layout}: {name}")

    cfg = load_hf_llama_config(runs["hf_dir"])
    ours = LlamaForCausalLM(cfg).eval()
    ours.load_state_dict({n: torch.from_numpy(v) for n, v in full.items()}, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours.double()(ids)
    want = _hf_logits(runs["hf"], ids)
    assert want.std() > 0.1  # logits that are not near-uniform, so the comparison can see a mix-up
    assert_logits_match(got, want)


@pytest.mark.parametrize("layout", ["tp1", "tp2pp2"])
def test_finetune_first_step_loss_is_transformers_loss(runs, layout):
    ft = runs[f"{layout}_ft"]
    batches = ft[0]["first_step"]  # dp = 1: rank 0 sees every micro-batch of the step
    assert len(batches) == 2
    hf = runs["hf"]
    want = sum(
        float(causal_lm_loss(_hf_logits(hf, torch.from_numpy(b["input_ids"])), torch.from_numpy(b["labels"])))
        for b in batches
    ) / len(batches)
    for r in ft:
        assert r["losses"][0] == pytest.approx(want, rel=FP32_LOSS_REL)  # the engine trains in fp32
    # the fine-tune started from these weights, not from a random init (whose loss is near ln(256) = 5.55)
    assert abs(want - np.log(256)) > 0.05


def test_finetuned_tp2pp2_exports_back_to_transformers(runs):
    step_dir = only_lineage(runs["tmp"] / "tp2pp2_ft" / "ckpt" / "finetune") / "step_00000001"
    out = runs["tmp"] / "export"
    res = CliRunner().invoke(
        app, ["checkpoint", "convert", str(step_dir), str(out), "--parallel", "tp=1,pp=1", "--format", "hf"]
    )
    assert res.exit_code == 0, res.output
    hf, info = transformers.LlamaForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    full = gather_full(runs["tp2pp2_ft"])
    cfg = load_hf_llama_config(out)
    ours = LlamaForCausalLM(cfg).eval()
    ours.load_state_dict({n: torch.from_numpy(v) for n, v in full.items()}, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = ours.double()(ids)
    assert_logits_match(got, _hf_logits(hf.eval(), ids))
    # one step of fine-tuning moved the weights away from the pretrained ones
    before = runs["hf"].state_dict()["model.layers.0.mlp.up_proj.weight"].numpy()
    assert not np.array_equal(full["model.layers.0.mlp.up_proj.weight"], before)
