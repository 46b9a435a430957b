"""Checkpoints written by the engine in one layout resume in another and continue the same training (issue 3 §6).

The reference trains dp2×tp2 for 4 steps without interruption, checkpointing every 2 steps. Copies of its checkpoint
directory (the step-4 checkpoint removed, so ``resume: auto`` picks step 2) are resumed at tp1 (one process) and at
pp2 (two processes); a ZeRO-1 dp2 run is resumed without ZeRO (optimizer state regathered from flat ranges), and a
ZeRO-3 dp4 run at ZeRO-3 dp2 and at dp2 without ZeRO. Jobs
train in float64: the losses after step 2 must continue as the uninterrupted reference within ``FP64_REL`` = 1e-10
relative (not bitwise: the reduction order differs between layouts), and the final parameters within 1e-10 relative
norm per tensor (tolerances derived in tests/tolerances.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.ckpt.lineage import new_lineage_id
from kuangchao_core.models.llama import LlamaForCausalLM, load_hf_llama_config
from tests.engine_helpers import gather_full, only_lineage, run_trainers, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP64_REL, rel_norm

STEPS = 4
INTERVAL = 2
MICRO = 2
GLOBAL_MICRO_BATCHES = 4


def _job(root: Path, parallel: dict):
    dp = parallel.get("data_parallel_size", 1)
    return tiny_job(
        str(root),
        task={"name": "reshard", "seed": 11},
        model={"preset": "tiny", "num_layers": 4},
        data={"seq_len": 16},
        parallel={"micro_batch_size": MICRO, "gradient_accumulation_steps": GLOBAL_MICRO_BATCHES // dp, **parallel},
        train={"steps": STEPS, "dtype": "fp64"},
        checkpoint={"interval": INTERVAL, "keep_last": 3},
    )


def _copy_at_step(src_root: Path, dst_root: Path) -> Path:
    """Copy ``src_root/ckpt`` to ``dst_root/ckpt`` keeping only the checkpoints up to step INTERVAL."""
    shutil.copytree(src_root / "ckpt", dst_root / "ckpt")
    task = only_lineage(dst_root / "ckpt" / "reshard")
    later = [p for p in task.iterdir() if p.name.startswith("step_") and int(p.name[5:]) > INTERVAL]
    assert later, f"the reference wrote no checkpoint after step {INTERVAL}: {sorted(task.iterdir())}"
    for p in later:
        shutil.rmtree(p)
    return task / f"step_{INTERVAL:08d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    ref_root, zero_root = tmp / "ref_dp2tp2", tmp / "ref_zero1"
    zero_tp_root = tmp / "ref_zero1_dp2tp2"
    zero_tp_cfg = _job(zero_tp_root, {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1})
    zero3_root = tmp / "ref_zero3_dp4"
    zero3_lineage = new_lineage_id()
    zero3_step = zero3_root / "ckpt" / "reshard" / zero3_lineage / f"step_{INTERVAL:08d}"
    zero3_cfg = _job(zero3_root, {"data_parallel_size": 4, "zero_stage": 3})
    four = run_distributed(
        run_trainers,
        4,
        args=(
            [
                {"cfg": _job(ref_root, {"data_parallel_size": 2, "tensor_parallel_size": 2})},
                {"cfg": zero_tp_cfg},
                {"cfg": zero3_cfg, "lineage": zero3_lineage},
            ],
        ),
    )
    ref = [r[0] for r in four]
    zero_tp_step = only_lineage(zero_tp_root / "ckpt" / "reshard") / f"step_{INTERVAL:08d}"
    _copy_at_step(ref_root, tmp / "tp1")
    _copy_at_step(ref_root, tmp / "pp2")
    zero_cfg = _job(zero_root, {"data_parallel_size": 2, "zero_stage": 1})
    # two-process jobs, in order: the ZeRO-1 reference, its resume without ZeRO (explicit path), and pp2 from dp2×tp2
    zero_lineage = new_lineage_id()  # pinned, so the next job of the same batch can name its checkpoint
    zero_step = zero_root / "ckpt" / "reshard" / zero_lineage / f"step_{INTERVAL:08d}"
    two = run_distributed(
        run_trainers,
        2,
        args=(
            [
                {"cfg": zero_cfg, "lineage": zero_lineage},
                {"cfg": _job(tmp / "zero0", {"data_parallel_size": 2}), "resume": str(zero_step)},
                {"cfg": _job(tmp / "pp2", {"pipeline_parallel_size": 2}), "resume": "auto"},
                {"cfg": _job(tmp / "zero_tp_to_tp2", {"tensor_parallel_size": 2}), "resume": str(zero_tp_step)},
                {"cfg": _job(tmp / "z3_dp2", {"data_parallel_size": 2, "zero_stage": 3}), "resume": str(zero3_step)},
                {"cfg": _job(tmp / "z3_zero0", {"data_parallel_size": 2}), "resume": str(zero3_step)},
            ],
        ),
    )
    one = run_distributed(run_trainers, 1, args=([{"cfg": _job(tmp / "tp1", {}), "resume": "auto"}],))
    return {
        "ref": ref,
        "ref_root": ref_root,
        "tmp": tmp,
        "zero1": [r[0] for r in two],
        "zero0": [r[1] for r in two],
        "pp2": [r[2] for r in two],
        "zero_tp": [r[1] for r in four],
        "zero_tp_to_tp2": [r[3] for r in two],
        "zero3_dp4": [r[2] for r in four],
        "zero3_to_zero3_dp2": [r[4] for r in two],
        "zero3_to_zero0_dp2": [r[5] for r in two],
        "tp1": [one[0][0]],
    }


def _assert_continues(resumed: list[dict], reference: list[dict], label: str) -> None:
    want = np.array(reference[0]["losses"])
    assert len(want) == STEPS
    for r in resumed:
        got = np.array(r["losses"])
        assert len(got) == STEPS, f"{label}: {len(got)} losses"
        np.testing.assert_array_equal(got[:INTERVAL], want[:INTERVAL])  # restored from the checkpoint
        np.testing.assert_allclose(got[INTERVAL:], want[INTERVAL:], rtol=FP64_REL, atol=0, err_msg=label)
    ref_full, got_full = gather_full(reference), gather_full(resumed)
    assert set(ref_full) == set(got_full)
    for name, want_p in ref_full.items():
        diff = rel_norm(got_full[name], want_p)
        assert diff <= FP64_REL, f"{label}: {name} relative norm difference {diff:.2e}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("target", ["tp1", "pp2"])
def test_dp2tp2_checkpoint_resumes_in_another_layout(runs, target):
    # the resumed run really started from the checkpoint: it trained only the remaining steps
    assert all(r["steps_run"] == STEPS - INTERVAL for r in runs[target])
    _assert_continues(runs[target], runs["ref"], f"dp2×tp2 -> {target}")


def test_zero1_checkpoint_resumes_without_zero(runs):
    assert all(r["steps_run"] == STEPS - INTERVAL for r in runs["zero0"])
    _assert_continues(runs["zero0"], runs["zero1"], "zero1 dp2 -> dp2")


def test_zero1_with_tensor_parallel_checkpoint_resumes_at_tp2_without_zero(runs):
    # ZeRO over DP of TP slices: the optimizer state is gathered over DP and saved per TP slice
    assert all(r["steps_run"] == STEPS - INTERVAL for r in runs["zero_tp_to_tp2"])
    _assert_continues(runs["zero_tp_to_tp2"], runs["zero_tp"], "zero1 dp2×tp2 -> tp2")


@pytest.mark.parametrize("target", ["zero3_to_zero3_dp2", "zero3_to_zero0_dp2"])
def test_zero3_dp4_checkpoint_resumes_at_dp2_with_and_without_zero(runs, target):
    # parameters saved whole (gathered from the shards) and AdamW state in flat ranges of four ranks
    assert all(r["steps_run"] == STEPS - INTERVAL for r in runs[target])
    _assert_continues(runs[target], runs["zero3_dp4"], f"ZeRO-3 dp4 -> {target}")


def test_convert_to_hf_gives_identical_logits(runs):
    src = only_lineage(runs["ref_root"] / "ckpt" / "reshard") / f"step_{STEPS:08d}"
    dst = runs["tmp"] / "hf_out"
    res = CliRunner().invoke(
        app, ["checkpoint", "convert", str(src), str(dst), "--parallel", "tp=1,pp=1", "--format", "hf"]
    )
    assert res.exit_code == 0, res.output
    assert (dst / "config.json").is_file() and (dst / "model.safetensors").is_file()

    from safetensors.torch import load_file

    cfg = load_hf_llama_config(dst)
    exported = LlamaForCausalLM(cfg)
    missing, unexpected = exported.load_state_dict(load_file(str(dst / "model.safetensors")), strict=False)
    assert not missing and not unexpected, (missing, unexpected)

    trained = LlamaForCausalLM(cfg)
    full = gather_full(runs["ref"])  # the dp2×tp2 model after step 6, reassembled from its ranks
    trained.load_state_dict({n: torch.from_numpy(v) for n, v in full.items()}, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = exported(ids), trained(ids)
    assert torch.equal(a, b), f"max |diff| {float((a - b).abs().max()):.3e}"
    # and the export is the trained model, not the initial one
    fresh = LlamaForCausalLM(cfg)
    fresh.init_weights(11)
    with torch.no_grad():
        assert not torch.allclose(fresh(ids), a, atol=1e-4)
