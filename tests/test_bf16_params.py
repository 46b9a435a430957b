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

import json

import numpy as np
import pytest
import torch

from kuangchao_core.config.settings import run_settings
from kuangchao_core.errors import ConfigError
from tests.engine_helpers import tiny_job
from tests.mp import run_distributed


def _run(rank: int, world_size: int, jobs: list[dict]) -> list[dict]:
    """Each job's Trainer in this process: ``in_place`` rounds the masters to bf16 after every step (the bf16
    parameters updated in place, the negative control); ``round_loaded`` resumes from the checkpoint's weights
    rounded to bf16 (a checkpoint without the masters). Returns losses, the model's parameters and dtypes."""
    from kuangchao_core.comm import init_distributed, world_group
    from kuangchao_core.comm import primitives as P
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
        reduced: set[str] = set()
        real = {"all_reduce": P.all_reduce, "reduce_scatter": P.reduce_scatter}
        if job.get("record_reduce"):  # the dtypes gradients are summed in over the DP group (buckets, chunks)

            def all_reduce(tensor, group=None, *a, _mesh=mesh, _seen=reduced, _real=real, **k):
                if group is not None and group is _mesh.dp_group and tensor.numel() > 1:
                    _seen.add(str(tensor.dtype))
                return _real["all_reduce"](tensor, group, *a, **k)

            def reduce_scatter(output, input, *a, _seen=reduced, _real=real, **k):
                _seen.add(str(input.dtype))
                return _real["reduce_scatter"](output, input, *a, **k)

            P.all_reduce, P.reduce_scatter = all_reduce, reduce_scatter
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
        try:
            state = trainer.run(resume=job.get("resume", "never"), max_steps=job.get("max_steps"))
        finally:
            P.all_reduce, P.reduce_scatter = real["all_reduce"], real["reduce_scatter"]
        with trainer.sync.full_parameters():
            masters = {n: p.detach().float().numpy().copy() for n, p in trainer.model.named_parameters()}
            saved = sorted({str(p.dtype) for p in trainer.model.parameters() if p.requires_grad})
        out.append(
            {
                "losses": list(state.losses),
                "params": {n: p.detach().float().numpy().copy() for n, p in trainer.model.named_parameters()},
                "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
                "master_dtypes": sorted({str(p.dtype) for g in trainer.sync.param_groups for p in g["params"]}),
                "masters": masters,
                "saved_dtypes": saved,  # what checkpoints save of the trainable parameters
                "initial": initial,
                "gathered_bytes": gathered[0],
                "reduced_dtypes": sorted(reduced),
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
    num = sum(
        np.sum(((run["masters"][k] - run["initial"][k]) - (ref["masters"][k] - ref["initial"][k])) ** 2)
        for k in ref["masters"]
    )
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
    assert bf16p["saved_dtypes"] == ["torch.float32"]
    assert bf16p["losses"] != fp32["losses"]  # it did compute in bf16
    assert _max_rel(bf16p["losses"], fp32["losses"]) <= BF16_REL
    assert bf16p["losses"][-1] < 0.75 * bf16p["losses"][0]  # and it trains
    assert _update_error(bf16p, fp32) <= BF16_REL
    assert _update_error(in_place, fp32) > BF16_REL  # the bound bites: without masters the updates are rounded away
    # the parameters the forward reads are the masters rounded to bf16
    for name, master in bf16p["masters"].items():
        rounded = torch.from_numpy(master).to(torch.bfloat16).float().numpy()
        assert np.array_equal(bf16p["params"][name], rounded), name


LORA = {"rank": 4, "targets": ["q_proj", "v_proj", "o_proj", "down_proj"]}
LAYOUTS = {
    "dp2": {"data_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
    "dp2_zero1": {"data_parallel_size": 2, "zero_stage": 1},
    "dp2_zero2": {"data_parallel_size": 2, "zero_stage": 2},
    "dp2_zero3": {"data_parallel_size": 2, "zero_stage": 3},
}


def test_every_layout_trains_with_bf16_params_and_zero3_gathers_half_the_bytes(tmp_path):
    """Every layout of bf16 parameters tracks the fp32 run (dp2, which equals one process) within the bound; LoRA
    (ZeRO-1, and ZeRO-3 with the base sharded) tracks fp32 LoRA; gradients are reduced in fp32 unless
    ``grad_reduce_dtype: bf16``; ZeRO-3's gathers during the steps, counted by the comm layer, are half of an fp32
    ZeRO-3 run's."""
    steps = 4
    lora_model = {"model": {"preset": "tiny", "num_layers": 2, "lora": LORA}}
    jobs = {
        "fp32": {"cfg": _job(tmp_path, "fp32", steps, "fp32", "fp32", parallel=LAYOUTS["dp2"])},
        "fp32_zero3": {"cfg": _job(tmp_path, "fp32z3", steps, "fp32", "fp32", parallel=LAYOUTS["dp2_zero3"])},
        "fp32_lora": {"cfg": _job(tmp_path, "fp32l", steps, "fp32", "fp32", parallel=LAYOUTS["dp2"], **lora_model)},
        **{name: {"cfg": _job(tmp_path, name, steps, parallel=par)} for name, par in LAYOUTS.items()},
        "dp2_zero1_lora": {"cfg": _job(tmp_path, "lora", steps, parallel=LAYOUTS["dp2_zero1"], **lora_model)},
        "dp2_zero3_lora": {"cfg": _job(tmp_path, "lora3", steps, parallel=LAYOUTS["dp2_zero3"], **lora_model)},
        **{
            f"{name}_reduce_bf16": {
                "cfg": _job(tmp_path, f"{name}-r16", steps, parallel={**LAYOUTS[name], "grad_reduce_dtype": "bf16"})
            }
            for name in ("dp2", "dp2_zero1", "dp2_zero2", "dp2_zero3")
        },
    }
    jobs["fp32_zero3"]["count_gathers"] = jobs["dp2_zero3"]["count_gathers"] = True
    for job in jobs.values():
        job["record_reduce"] = True
    per_rank = run_distributed(_run, 2, args=(list(jobs.values()),), timeout=400)
    res = dict(zip(jobs, per_rank[0], strict=True))
    for name in [*LAYOUTS, *(f"{n}_reduce_bf16" for n in ("dp2", "dp2_zero1", "dp2_zero2", "dp2_zero3"))]:
        got = res[name]
        assert got["losses"] != res["fp32"]["losses"], name
        assert _max_rel(got["losses"], res["fp32"]["losses"]) <= BF16_REL, name
        assert got["param_dtypes"] == ["torch.bfloat16"] and got["master_dtypes"] == ["torch.float32"], name
    for lora in (res["dp2_zero1_lora"], res["dp2_zero3_lora"]):  # ZeRO-3: the base sharded in bf16 (zero3_lora)
        assert _max_rel(lora["losses"], res["fp32_lora"]["losses"]) <= BF16_REL
        assert lora["param_dtypes"] == ["torch.bfloat16"] and lora["master_dtypes"] == ["torch.float32"]
    for name in ("dp2", "dp2_zero1", "dp2_zero2", "dp2_zero3"):
        assert res[name]["reduced_dtypes"] == ["torch.float32"], name
        assert res[f"{name}_reduce_bf16"]["reduced_dtypes"] == ["torch.bfloat16"], name  # the hook sees bf16
    fp32_bytes, bf16_bytes = res["fp32_zero3"]["gathered_bytes"], res["dp2_zero3"]["gathered_bytes"]
    assert fp32_bytes > 0 and bf16_bytes * 2 == fp32_bytes, (bf16_bytes, fp32_bytes)


def _same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(np.array_equal(a["masters"][k], b["masters"][k]) for k in a["masters"])


def test_checkpoints_hold_the_fp32_masters_resume_bitwise_and_export_the_asked_dtype(tmp_path):
    from safetensors.torch import load_file

    from kuangchao_core.ckpt.convert import export_hf
    from kuangchao_core.ckpt.index import CheckpointIndex
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    names, jobs = [], []
    resumable = {"dp2": {}, "dp2_zero1": {}, "dp2_zero3": {}, "dp2_zero3_lora": {"model": {"lora": LORA}}}
    for layout, more in resumable.items():
        par = LAYOUTS[layout.removesuffix("_lora")]
        full, stop = (_job(tmp_path, f"{layout}-{n}", 6, interval=3, parallel=par, **more) for n in ("a", "b"))
        names += [f"{layout}-full", f"{layout}-stop", f"{layout}-resumed"]
        jobs += [{"cfg": full}, {"cfg": stop, "max_steps": 3}, {"cfg": stop, "resume": "auto"}]
    broken = _job(tmp_path, "broken", 6, interval=3, parallel=LAYOUTS["dp2_zero1"])
    names += ["control-stop", "control-resumed"]  # resumed from the checkpoint's weights rounded to bf16
    jobs += [{"cfg": broken, "max_steps": 3}, {"cfg": broken, "resume": "auto", "round_loaded": True}]
    res = dict(zip(names, run_distributed(_run, 2, args=(jobs,), timeout=400)[0], strict=True))
    for layout in resumable:  # LoRA at ZeRO-3: the adapters' masters and the bf16 base shards
        full, resumed = res[f"{layout}-full"], res[f"{layout}-resumed"]
        assert resumed["losses"][:3] == full["losses"][:3]  # the first attempt's steps, from the checkpoint
        assert _same(resumed, full), layout
        assert all(np.array_equal(resumed["params"][k], v) for k, v in full["params"].items()), layout
    assert res["control-resumed"]["losses"][:3] == res["dp2_zero1-full"]["losses"][:3]
    assert res["control-resumed"]["losses"][3:] != res["dp2_zero1-full"]["losses"][3:]  # the masters matter
    # the checkpoint of step 3 holds the fp32 masters, not their bf16 rounding
    (step_dir,) = (tmp_path / "dp2_zero1-b" / "ckpt").glob("**/step_*3")
    stop = res["dp2_zero1-stop"]["masters"]
    previous = install_guard(AllowAll())  # offline reads, as `kc checkpoint convert` does them
    try:
        index = CheckpointIndex.open(step_dir)
        saved = {k.removeprefix("param."): index.read(k) for k in index.keys() if k.startswith("param.")}
        index.close()
        exports = {
            d: load_file(str(export_hf(step_dir, tmp_path / f"hf-{d}", d) / "model.safetensors"))
            for d in ("fp32", "bf16")
        }
    finally:
        install_guard(previous)
    assert set(saved) == set(stop)
    assert {str(t.dtype) for t in saved.values()} == {"torch.float32"}
    assert all(np.array_equal(saved[k].numpy(), v) for k, v in stop.items())
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in saved.values())  # not bf16 values
    for dtype, torch_dtype, name in (("fp32", torch.float32, "float32"), ("bf16", torch.bfloat16, "bfloat16")):
        weights = exports[dtype]
        assert {t.dtype for t in weights.values()} == {torch_dtype}
        assert json.loads((tmp_path / f"hf-{dtype}" / "config.json").read_text())["torch_dtype"] == name
        head = saved["lm_head.weight"] if "lm_head.weight" in saved else saved["model.embed_tokens.weight"]
        key = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
        assert torch.equal(weights[key], head.to(torch_dtype))  # rounded once, from the master


@pytest.mark.parametrize(
    "sections, says",
    [
        ({"train": {"param_dtype": "bf16", "dtype": "fp32"}}, "need train.dtype bf16"),
        ({"train": {"param_dtype": "bf16", "dtype": "fp16"}}, "need train.dtype bf16"),
        ({"train": {"param_dtype": "bf16", "dtype": "bf16"}, "parallel": {"grad_compression": "topk"}}, "topk"),
    ],
)
def test_unsupported_combinations_are_config_errors_naming_the_field(sections, says, tmp_path):
    with pytest.raises(ConfigError) as exc:
        tiny_job(str(tmp_path), **sections)
    assert [p for p, m in exc.value.errors if says in m] == ["train.param_dtype"], exc.value.errors


def test_the_memory_model_has_bf16_parameters_and_refuses_what_the_engine_does_not_run():
    from kuangchao_core.parallel.state_memory import precision_bytes, state_bytes

    b = precision_bytes("bf16", "bf16")
    assert (b.param, b.grad, b.master, b.moments, b.cast, b.master_grad) == (2, 0, 4, 8, 0, 4)
    # dp4 ZeRO-1: bf16 params, the full fp32 gradient buffer (no bf16 gradient kept), master and moments over 4
    # ranks: Megatron-Core's 2 + 4 + 12/4; ZeRO-2 shards the fp32 gradient
    assert state_bytes(1000, 4, 1, "bf16", param_dtype="bf16") == {"params": 2000, "grads": 4000, "optimizer": 3000}
    assert state_bytes(1000, 4, 2, "bf16", param_dtype="bf16") == {"params": 2000, "grads": 1000, "optimizer": 3000}
    assert state_bytes(1000, 4, 0, "bf16", param_dtype="bf16")["grads"] == 4000
    with pytest.raises(ValueError, match="no memory model for train.dtype 'fp16' with parameters in 'bf16'"):
        state_bytes(1000, 4, 1, "fp16", param_dtype="bf16")


def test_grad_reduce_dtype_is_used_by_zero_only_with_bf16_params(tmp_path):
    from kuangchao_core.config.unused import unused_settings

    par = {"data_parallel_size": 2, "zero_stage": 1, "grad_reduce_dtype": "bf16"}
    bf16p = tiny_job(str(tmp_path), parallel=par, train={"dtype": "bf16", "param_dtype": "bf16"})
    mixed = tiny_job(str(tmp_path), parallel=par, train={"dtype": "bf16"})  # the control: ZeRO sums fp32 there
    assert [p for p, _ in unused_settings(bf16p)] == []
    assert [p for p, _ in unused_settings(mixed)] == ["parallel.grad_reduce_dtype"]
