"""Mixed precision (``train.dtype: bf16|fp16``): bf16 compute with fp32 master weights and fp32 gradient reduction,
fp16 with dynamic loss scaling whose skipped steps leave the weights alone and whose state resumes bitwise.

bf16 keeps 8 significant bits (unit roundoff u = 2^-8 ≈ 0.0039): every matmul's inputs are rounded to that, so a
bf16 run's losses drift from the fp32 run's by a few u per step in relative terms and compound over the run; the
stated tolerance is 2% relative at every one of 50 steps (≈ 5u). The negative control (the same bf16 run with the
learning rate doubled) must leave it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kuangchao_core.config.settings import run_settings
from kuangchao_core.parallel.mixed_precision import LossScaling, MixedPrecision
from tests.engine_helpers import tiny_job
from tests.mp import run_distributed

BF16_REL = 0.02


# ------------------------------------------------------------------------------------------------ the scaler alone


def test_an_overflow_skips_halves_the_scale_and_clean_steps_grow_it():
    mp = MixedPrecision("fp16", "cpu", LossScaling(initial_scale=1024.0, growth_interval=2))
    assert float(mp.scale(torch.tensor(2.0))) == 2048.0
    grads = [torch.full((3,), 1024.0), torch.full((2,), 2048.0)]
    mp.unscale(grads)
    assert grads[0].tolist() == [1.0] * 3 and grads[1].tolist() == [2.0] * 2  # divided by the scale
    mp.update(False)
    assert mp.loss_scale == 1024.0
    mp.update(False)  # second clean step in a row: growth
    assert mp.loss_scale == 2048.0 and mp.growth_tracker == 0
    mp.update(True)  # an overflowing step (the trainer saw a non-finite gradient norm)
    assert mp.loss_scale == 1024.0 and mp.skipped_steps == 1 and not mp.at_min_scale
    assert mp.metrics() == {"loss_scale": 1024.0, "skipped_steps": 1.0}


def test_hysteresis_backs_off_only_after_that_many_overflows():
    mp = MixedPrecision("fp16", "cpu", LossScaling(initial_scale=64.0, hysteresis=2))
    mp.update(True)
    assert mp.loss_scale == 64.0 and mp.skipped_steps == 1
    mp.update(True)
    assert mp.loss_scale == 32.0 and mp.skipped_steps == 2


def test_fp32_and_bf16_never_scale_nor_sync():
    for dtype in ("fp32", "bf16"):
        mp = MixedPrecision(dtype, "cpu")
        loss = torch.tensor(3.0)
        grads = [torch.tensor([math.inf, 2.0])]
        mp.unscale(grads)
        assert mp.scale(loss) is loss and grads[0].tolist() == [math.inf, 2.0] and mp.at_min_scale
        assert mp.metrics() == {"skipped_steps": 0.0}
        mp.update(True)  # a non-finite step is counted in every dtype, with no scale to move
        assert mp.skipped_steps == 1 and mp.loss_scale == 1.0
    assert MixedPrecision("fp32", "cpu").enabled is False and MixedPrecision("bf16", "cpu").enabled


# --------------------------------------------------------------------------------------------- through the engine


def _run_jobs(rank: int, world_size: int, jobs: list[dict]) -> list[dict]:
    """Each job's Trainer in this process: ``inf_at`` puts an inf into this rank's first gradient at that step;
    returns losses, parameters, the scaler state, the optimizer's dtypes and the dtypes summed over the DP group."""
    from kuangchao_core.comm import init_distributed, world_group
    from kuangchao_core.comm import primitives as P
    from kuangchao_core.engine.trainer import Trainer
    from kuangchao_core.parallel.mesh import ParallelMesh
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    init_distributed(backend="gloo", timeout_ms=120_000)
    out = []
    real_all_reduce = P.all_reduce
    for job in jobs:
        cfg = job["cfg"]
        mesh = ParallelMesh.from_config(cfg.parallel, rank, world_size)
        trainer = Trainer(run_settings(cfg), rank, world_size, torch.device("cpu"), world_group(), mesh)
        reduced: set[str] = set()

        def recording(tensor, group=None, *a, _mesh=mesh, _seen=reduced, **k):
            if group is not None and _mesh.dp_group is not None and group is _mesh.dp_group and tensor.numel() > 1:
                _seen.add(str(tensor.dtype))
            return real_all_reduce(tensor, group, *a, **k)

        P.all_reduce = recording
        grads_of = trainer.sync.local_grads
        params_before: dict[int, dict] = {}

        def injecting(_t=trainer, _g=grads_of, _at=job.get("inf_at"), _seen=params_before):
            grads = _g()
            step = _t.state.step + 1
            _seen[step] = {n: p.detach().clone() for n, p in _t.model.named_parameters()}
            if step == _at:
                grads[0].view(-1)[0] = math.inf
            return grads

        trainer.sync.local_grads = injecting
        if job.get("forget_scaler"):
            trainer.precision.load_state_dict = lambda state: None
        try:
            state = trainer.run(resume=job.get("resume", "never"), max_steps=job.get("max_steps"))
        finally:
            P.all_reduce = real_all_reduce
        at = job.get("inf_at")
        skipped_unchanged = None
        if at is not None and at + 1 in params_before:
            skipped_unchanged = all(
                torch.equal(params_before[at][n], params_before[at + 1][n]) for n in params_before[at]
            )
        opt_params = [p for g in trainer.sync.param_groups for p in g["params"]]
        out.append(
            {
                "losses": list(state.losses),
                "params": {n: p.detach().float().numpy().copy() for n, p in trainer.model.named_parameters()},
                "precision": trainer.precision.state_dict(),
                "param_dtypes": sorted({str(p.dtype) for p in opt_params}),
                "state_dtypes": sorted({str(t.dtype) for t in trainer.sync.state_tensors()}),
                "reduced_dtypes": sorted(reduced),
                "skipped_step_left_params_unchanged": skipped_unchanged,
            }
        )
        trainer.barrier()
    return out


def _job(tmp_path, name: str, dtype: str, steps: int, interval: int = 100, **sections) -> object:
    train = {"steps": steps, "warmup_steps": 2, "dtype": dtype, **sections.pop("train", {})}
    return tiny_job(
        str(tmp_path / name),
        task={"name": name, "seed": 7},
        train=train,
        checkpoint={"dir": str(tmp_path / name / "ckpt"), "interval": interval, "resume": "auto"},
        **sections,
    )


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_bf16_tracks_fp32_for_50_steps_with_fp32_master_weights(tmp_path):
    jobs = [
        {"cfg": _job(tmp_path, "fp32", "fp32", 50)},
        {"cfg": _job(tmp_path, "bf16", "bf16", 50)},
        {"cfg": _job(tmp_path, "bf16-lr2x", "bf16", 50, optimizer={"lr": 6e-3})},  # the negative control
    ]
    fp32, bf16, control = run_distributed(_run_jobs, 1, args=(jobs,), timeout=300)[0]
    assert len(bf16["losses"]) == 50 and bf16["losses"] != fp32["losses"]  # it did compute in bf16
    assert _max_rel(bf16["losses"], fp32["losses"]) <= BF16_REL
    assert _max_rel(control["losses"], fp32["losses"]) > BF16_REL  # the comparison bites
    assert bf16["param_dtypes"] == ["torch.float32"] and bf16["state_dtypes"] == ["torch.float32"]
    assert bf16["losses"][-1] < 0.75 * bf16["losses"][0]  # and it trains


LAYOUTS = {
    "dp2": {"data_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
    "dp2_zero1": {"data_parallel_size": 2, "zero_stage": 1},
    "dp2_zero3": {"data_parallel_size": 2, "zero_stage": 3},
}


def test_bf16_at_dp_tp_pp_zero_tracks_fp32_and_reduces_fp32_gradients_unless_told(tmp_path):
    names, jobs = [], []
    for layout, parallel in LAYOUTS.items():
        for dtype in ("fp32", "bf16"):
            names.append((layout, dtype))
            jobs.append({"cfg": _job(tmp_path, f"{layout}-{dtype}", dtype, 6, parallel=parallel)})
    names.append(("dp2", "bf16-reduce"))
    jobs.append(
        {"cfg": _job(tmp_path, "dp2-bf16r", "bf16", 6, parallel={"data_parallel_size": 2, "grad_reduce_dtype": "bf16"})}
    )
    per_rank = run_distributed(_run_jobs, 2, args=(jobs,), timeout=400)
    res = {n: per_rank[0][i] for i, n in enumerate(names)}
    for layout in LAYOUTS:
        bf16, fp32 = res[(layout, "bf16")]["losses"], res[(layout, "fp32")]["losses"]
        assert bf16 != fp32, f"{layout}: the bf16 job computed in fp32"
        assert _max_rel(bf16, fp32) <= BF16_REL, layout
        assert res[(layout, "bf16")]["param_dtypes"] == ["torch.float32"], layout
    assert res[("dp2", "bf16")]["reduced_dtypes"] == ["torch.float32"]
    assert res[("dp2", "bf16-reduce")]["reduced_dtypes"] == ["torch.bfloat16"]  # the control: the hook sees it
    assert _max_rel(res[("dp2", "bf16-reduce")]["losses"], res[("dp2", "fp32")]["losses"]) <= BF16_REL


def test_fp16_skips_an_overflowing_step_and_resumes_bitwise_with_the_scaler(tmp_path):
    scaling = {"loss_scaling": {"initial_scale": 1024, "growth_interval": 2}}
    full, stop, broken = (_job(tmp_path, n, "fp16", 6, interval=3, train=scaling) for n in ("full", "stop", "broken"))
    jobs = [
        {"cfg": full, "inf_at": 2},
        {"cfg": stop, "inf_at": 2, "max_steps": 3},
        {"cfg": stop, "resume": "auto"},
        {"cfg": broken, "inf_at": 2, "max_steps": 3},
        {"cfg": broken, "resume": "auto", "forget_scaler": True},
    ]
    ref, first, resumed, _, forgot = run_distributed(_run_jobs, 1, args=(jobs,), timeout=300)[0]
    assert ref["skipped_step_left_params_unchanged"] is True
    # steps 1 clean, 2 skipped (scale 1024 -> 512), 3 and 4 clean (-> 1024), 5 and 6 clean (-> 2048)
    assert ref["precision"] == {"loss_scale": 2048.0, "growth_tracker": 0, "hysteresis_left": 1, "skipped_steps": 1}
    assert first["precision"]["loss_scale"] == 512.0 and first["precision"]["growth_tracker"] == 1
    assert resumed["losses"] == ref["losses"] and resumed["precision"] == ref["precision"]
    for name, value in ref["params"].items():
        assert np.array_equal(resumed["params"][name], value), name
    # the negative control resumes without the scaler's state: the scale and the skipped count come out wrong
    assert forgot["precision"] != ref["precision"]


@pytest.mark.parametrize("bad", [{"train": {"dtype": "bf16", "loss_scaling": {"initial_scale": 8}}}])
def test_loss_scaling_outside_fp16_is_reported_unused(bad, tmp_path):
    from kuangchao_core.config.unused import unused_settings

    cfg = tiny_job(str(tmp_path), **bad)
    assert [p for p, _ in unused_settings(cfg)] == ["train.loss_scaling"]
