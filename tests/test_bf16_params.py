"""bf16 parameters with fp32 master weights (``train.param_dtype: bf16``, issue 29 item 1).

Bounds (u = 2^-8 ≈ 0.0039, bf16's relative spacing). The forward of a bf16-parameter job reads the same bf16
weights a bf16 autocast job casts its fp32 weights to (the rounding of the master), so its losses stay within the
mixed-precision tests' bound of the fp32 run: 2 % relative at every step (≈ 5u, tests/test_mixed_precision.py).
The master weights hold every update in fp32, so what the run learns — the update Δw = w_T − w_0 of the
weights — differs from the fp32 run's only through the bf16 gradients: ‖Δw − Δw_fp32‖ ≤ 5u·‖Δw_fp32‖ (2 %).
Without the master (the bf16 parameters updated in place, the negative control) every step rounds the stored weight
by up to u/2·|w| — a weight's whole update when it is smaller than that — and these roundings add up over the
steps instead of being absorbed: at lr 1e-3 (Adam's steps ≈ lr, against |w| ≈ 0.02 and norm scales of 1.0, whose
bf16 spacing is 2^-7 ≈ 0.008 > lr) the update leaves the bound.
"""

from __future__ import annotations

import numpy as np
import torch

from kuangchao_core.config.settings import run_settings
from tests.engine_helpers import tiny_job
from tests.mp import run_distributed


def _run(rank: int, world_size: int, jobs: list[dict]) -> list[dict]:
    """Each job's Trainer in this process: ``in_place`` rounds the masters to bf16 after every step (the bf16
    parameters updated in place, the negative control); ``round_loaded`` resumes from the checkpoint's weights
    rounded to bf16 (a checkpoint without the masters). Returns losses, the model's parameters and dtypes."""
    from kuangchao_core.comm import init_distributed, world_group
    from kuangchao_core.engine.trainer import Trainer
    from kuangchao_core.parallel.mesh import ParallelMesh
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    init_distributed(backend="gloo", timeout_ms=120_000)
    out = []
    for job in jobs:
        cfg = job["cfg"]
        mesh = ParallelMesh.from_config(cfg.parallel, rank, world_size)
        trainer = Trainer(run_settings(cfg), rank, world_size, torch.device("cpu"), world_group(), mesh)
        if job.get("in_place"):
            step, masters = trainer.sync.step, trainer.sync.masters

            def rounded_step(_step=step, _masters=masters):
                _step()
                for m in _masters.values():
                    m.data.copy_(m.data.to(torch.bfloat16))

            trainer.sync.step = rounded_step
        if job.get("round_loaded"):
            copy = trainer.checkpoints._copy_into_params

            def rounding_copy(full, source, names, _copy=copy):
                _copy({k: v.to(torch.bfloat16).float() for k, v in full.items()}, source, names)

            trainer.checkpoints._copy_into_params = rounding_copy
        with trainer.sync.full_parameters():
            initial = {n: p.detach().float().numpy().copy() for n, p in trainer.model.named_parameters()}
        gathered = [0]
        if job.get("count_gathers"):
            from kuangchao_core.comm.timing import COMM_STATS

            one_step = trainer.train_step

            def counted(batches, _step=one_step, _n=gathered):
                before = sum(v for k, v in COMM_STATS.bytes_by_op().items() if "all_gather" in k)
                result = _step(batches)
                _n[0] += sum(v for k, v in COMM_STATS.bytes_by_op().items() if "all_gather" in k) - before
                return result

            trainer.train_step = counted
        state = trainer.run(resume=job.get("resume", "never"), max_steps=job.get("max_steps"))
        with trainer.sync.full_parameters():
            masters = {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}
        out.append(
            {
                "losses": list(state.losses),
                "params": {n: p.detach().float().numpy().copy() for n, p in trainer.model.named_parameters()},
                "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
                "master_dtypes": sorted({str(p.dtype) for g in trainer.sync.param_groups for p in g["params"]}),
                "masters": masters,
                "initial": initial,
                "gathered_bytes": gathered[0],
                "state_dtypes": sorted({str(t.dtype) for t in trainer.sync.state_tensors()}),
            }
        )
        trainer.barrier()
    return out


def _job(tmp_path, name: str, steps: int, param_dtype: str = "bf16", dtype: str = "bf16", interval=100, **sections):
    train = {"steps": steps, "warmup_steps": 2, "dtype": dtype, "param_dtype": param_dtype, **sections.pop("train", {})}
    return tiny_job(
        str(tmp_path / name),
        task={"name": name, "seed": 7},
        train=train,
        checkpoint={"dir": str(tmp_path / name / "ckpt"), "interval": interval, "resume": "auto"},
        **sections,
    )


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


BF16_REL = 0.02  # 5u


def _update_error(run: dict, ref: dict) -> float:
    """‖Δw_run − Δw_ref‖ / ‖Δw_ref‖ over every parameter, Δw = final master − initial."""
    num = sum(np.sum(((run["masters"][k] - run["initial"][k]) - (ref["masters"][k] - ref["initial"][k])) ** 2) for k in ref["masters"])
    den = sum(np.sum((ref["masters"][k] - ref["initial"][k]) ** 2) for k in ref["masters"])
    return float(np.sqrt(num / den))


def test_bf16_params_track_fp32_and_the_masters_keep_what_in_place_bf16_loses(tmp_path):
    opt = {"optimizer": {"lr": 1e-3}}
    jobs = [
        {"cfg": _job(tmp_path, "fp32", 60, "fp32", "fp32", **opt)},
        {"cfg": _job(tmp_path, "bf16p", 60, **opt)},
        {"cfg": _job(tmp_path, "in-place", 60, **opt), "in_place": True},  # the negative control
    ]
    fp32, bf16p, in_place = run_distributed(_run, 1, args=(jobs,), timeout=300)[0]
    assert bf16p["param_dtypes"] == ["torch.bfloat16"] and bf16p["master_dtypes"] == ["torch.float32"]
    assert bf16p["state_dtypes"] == ["torch.float32"]
    assert all(v.dtype == np.float32 for v in bf16p["masters"].values())
    assert bf16p["losses"] != fp32["losses"]  # it did compute in bf16
    assert _max_rel(bf16p["losses"], fp32["losses"]) <= BF16_REL
    assert bf16p["losses"][-1] < 0.75 * bf16p["losses"][0]  # and it trains
    assert _update_error(bf16p, fp32) <= BF16_REL
    assert _update_error(in_place, fp32) > BF16_REL  # the bound bites: without masters the updates are rounded away
    # the parameters the forward reads are the masters rounded to bf16
    for name, master in bf16p["masters"].items():
        rounded = torch.from_numpy(master).to(torch.bfloat16).float().numpy()
        assert np.array_equal(bf16p["params"][name], rounded), name
