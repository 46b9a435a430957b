"""A Mixtral fine-tuned through the engine at expert parallelism (issue 40 item 4), pinned against transformers.

A tiny random ``transformers.MixtralForCausalLM`` (4 experts, top 2) is saved with ``save_pretrained``; a job with
``model.checkpoint`` pointing at it runs at ep2 (world 2: dp2, ep2) in float64 on Gloo. Each rank reads only its
two experts (``engine.checkpointing.load_pretrained`` with the rank's regions); reassembled, they are exactly the
Mixtral's tensors, and the first step's loss — the tokens dispatched to the experts' ranks and back by all-to-all —
equals the loss of transformers' logits on the same micro-batches within ``HF_REL``. Control: each rank reads the
other rank's experts; the loss moves by more than ``NEGATIVE_MIN``. The fine-tuned ep2 checkpoint, exported by ``kc
checkpoint convert --format hf``, is a Mixtral transformers loads with the fine-tuned model's logits. (ep2 × dp2 reads through the same regions:
``tests/test_hf_moe.py`` checks each of its four ranks' slices; the engine at that world size is
``tests/test_expert_parallel_training.py``'s.)
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss, load_hf_llama_config
from tests.engine_helpers import gather_full, only_lineage, run_trainers, tiny_job
from tests.mp import run_distributed
from tests.test_hf_moe import mixtral
from tests.tolerances import HF_REL, NEGATIVE_MIN, assert_logits_match

transformers = pytest.importorskip("transformers")


def _job(root, hf_dir):
    return tiny_job(
        str(root),
        task={"name": "mixtral", "seed": 3},
        model={"preset": None, "num_layers": None, "checkpoint": str(hf_dir), "moe": {"num_experts": 4, "top_k": 2}},
        data={"seq_len": 16},
        parallel={"data_parallel_size": 2, "expert_parallel_size": 2, "micro_batch_size": 2},
        train={"steps": 1, "warmup_steps": 0, "dtype": "fp64"},
        tracking={"log_model": False},
    )


def _run(rank: int, world_size: int, jobs: list[dict]) -> list[dict]:
    from kuangchao_core.ckpt import hf as hf_module
    from kuangchao_core.models.layout import Region

    read = hf_module.load_mixtral_for_regions
    out = []
    for job in jobs:
        if job.pop("swap", False):

            def other(hf_dir, where, regions, dtype=torch.float32):
                moved = {
                    n: Region.split(r.full_shape, 0, (r.offsets[0] + r.shape[0]) % r.full_shape[0], r.shape[0])
                    if ".experts.w_" in n
                    else r
                    for n, r in regions.items()
                }
                return read(hf_dir, where, moved, dtype)

            hf_module.load_mixtral_for_regions = other
        try:
            out += run_trainers(rank, world_size, [job])
        finally:
            hf_module.load_mixtral_for_regions = read
    return out


@pytest.mark.timeout(600)
def test_mixtral_fine_tunes_at_ep2_from_transformers_weights(tmp_path):
    hf = mixtral(seed=4, scale=12.0, vocab_size=256, max_position_embeddings=64)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    jobs = [
        {"cfg": _job(tmp_path / "load", tmp_path / "hf"), "max_steps": 0},
        {"cfg": _job(tmp_path / "ft", tmp_path / "hf")},
        {"cfg": _job(tmp_path / "swapped", tmp_path / "hf"), "swap": True},
    ]
    ranks = run_distributed(_run, 2, args=(jobs,), timeout=500)
    cfg = load_hf_llama_config(tmp_path / "hf")
    from kuangchao_core.ckpt.hf import load_hf_weights_for_layout

    want_params = load_hf_weights_for_layout(tmp_path / "hf", cfg)
    for rank, (loaded, _, _) in enumerate(ranks):
        w_gate = "model.layers.0.mlp.experts.w_gate"
        assert loaded["params"][w_gate].shape[0] == 2 and loaded["regions"][w_gate]["offsets"][0] == 2 * rank
    full = gather_full([r[0] for r in ranks])
    assert set(full) == set(want_params)
    for name, value in full.items():
        np.testing.assert_array_equal(value, want_params[name].double().numpy(), err_msg=name)

    reference = copy.deepcopy(hf).double()
    with torch.no_grad():
        losses = [
            float(
                causal_lm_loss(
                    reference(input_ids=torch.from_numpy(b["input_ids"])).logits, torch.from_numpy(b["labels"])
                )
            )
            for _, ft, _ in ranks
            for b in ft["first_step"]
        ]
    want = sum(losses) / len(losses)
    assert abs(want - np.log(256)) > 0.05  # the imported weights, not a random start, decide the loss
    for _, ft, swapped in ranks:
        assert abs(ft["losses"][0] - want) <= HF_REL * want
        assert abs(swapped["losses"][0] - want) > NEGATIVE_MIN * want

    # the fine-tuned ep2 checkpoint (each rank wrote its experts) exported by the CLI is transformers' Mixtral
    step_dir = only_lineage(tmp_path / "ft" / "ckpt" / "mixtral") / "step_00000001"
    out = tmp_path / "export"
    res = CliRunner().invoke(app, ["checkpoint", "convert", str(step_dir), str(out), "--format", "hf"])
    assert res.exit_code == 0, res.output
    back = transformers.MixtralForCausalLM.from_pretrained(
        out, attn_implementation="eager", experts_implementation="eager", dtype=torch.float64
    ).eval()
    tuned = gather_full([r[1] for r in ranks])
    ours = LlamaForCausalLM(load_hf_llama_config(out)).double().eval()
    ours.load_state_dict({n: torch.from_numpy(v) for n, v in tuned.items()}, strict=True)
    assert not np.array_equal(tuned[w_gate], full[w_gate])  # the step moved the experts
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_logits_match(ours(ids), back(input_ids=ids).logits)
