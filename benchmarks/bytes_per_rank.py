"""Bytes per rank from the engine's tensors (issue 29, item 5): bf16 parameters ÷ bf16 mixed precision at dp4
ZeRO-1, and ZeRO-3 ÷ ZeRO-2 under pipeline parallelism at dp4 × pp2.

Gloo processes run the engine's Trainer (the tiny preset's widths, 4 layers) for one step of each job and report
``GradSync.tensor_bytes()`` — parameters, gradients and optimizer state (moments, fp32 masters) the rank holds after
the step — and the largest rank's total is compared:

- dp4, ZeRO-1: ``train.dtype: bf16`` with fp32 parameters (autocast) against ``train.param_dtype: bf16`` (bf16
  parameters, fp32 masters); 4 processes.
- dp4 × pp2, 1F1B, fp32: ``zero_stage: 2`` against ``zero_stage: 3`` (each stage's units sharded over its DP
  group); 8 processes.

Bytes are exact counts, the same on every run: one run, no spread. Autocast's per-step weight copies are not
tensors the rank holds after the step (``tests/test_memory_model.py`` measures the peak within a step).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bytes_per_rank.py [--smoke]

``--smoke``: the same two comparisons on two processes each (dp2 ZeRO-1; pp2 without data parallelism, where
ZeRO-3 shards over a group of one). Ends with ``RESULT {json}``: per comparison the layout, its processes, the
ratio and each job's bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _engine_ranks import init_rank, run_ranks  # noqa: E402
from _results import emit  # noqa: E402

#: comparison -> (layout, processes, {job: its config over the base}); the peer's job first
JOBS = {
    "zero1_bf16_params_vs_autocast": (
        "dp4 ZeRO-1",
        4,
        {
            "bf16_autocast": {"parallel": {"zero_stage": 1}, "train": {"dtype": "bf16"}},
            "bf16_params": {"parallel": {"zero_stage": 1}, "train": {"dtype": "bf16", "param_dtype": "bf16"}},
        },
    ),
    "zero3_vs_zero2_under_pp": (
        "dp4 x pp2 (1F1B), fp32",
        8,
        {
            "zero2": {"parallel": {"zero_stage": 2, "pipeline_parallel_size": 2}},
            "zero3": {"parallel": {"zero_stage": 3, "pipeline_parallel_size": 2}},
        },
    ),
}


SMOKE = {"zero1_bf16_params_vs_autocast": ("dp2 ZeRO-1", 2, {"parallel": {"data_parallel_size": 2}}),
         "zero3_vs_zero2_under_pp": ("pp2, fp32", 2, {"parallel": {"data_parallel_size": 1}})}  # fmt: skip
RESULT_KEYS = ("zero1_bf16_params_vs_autocast", "zero3_vs_zero2_under_pp")  # JOBS' comparisons


def _merge(base: dict, extra: dict) -> dict:
    """``extra``'s sections merged over ``base``'s (one level: a section's keys replace base's)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in extra.items():
        out.setdefault(section, {}).update(values)
    return out


def job_config(name: str, extra: dict, root: str, setup: dict | None = None):
    """The benchmark's job ``name``: the tiny preset's widths with 4 layers on the CPU, dp4, 2 micro-batches of 2,
    with ``extra`` and then ``setup`` (another device, model or batch: ``benchmarks/gpu/memory_check.py``) merged
    over it section by section."""
    from kuangchao_core.config import config_from_dict

    base = {
        "task": {"name": name, "seed": 1},
        "model": {"preset": "tiny", "num_layers": 4},
        "data": {"format": "synthetic", "seq_len": 32, "synthetic": {"num_train": 512, "num_eval": 8}},
        "parallel": {"data_parallel_size": 4, "micro_batch_size": 2, "gradient_accumulation_steps": 2},
        "optimizer": {"lr": 1e-3},
        "train": {"steps": 1, "device": "cpu", "log_interval": 100},
        "permission": {"mode": "trusted"},
        "checkpoint": {"dir": f"{root}/ckpt", "interval": 100, "resume": "never"},
        "tracking": {"uri": f"sqlite:///{root}/mlflow.db"},
    }
    return config_from_dict(_merge(_merge(base, extra), setup or {}))


def _worker(rank: int, world: int, port: int, root: str, jobs: dict, setup: dict | None, queue) -> None:
    """Each job's Trainer for one step on this rank: its ``tensor_bytes`` and, on CUDA, ``peak_allocated`` (the
    device memory the job allocated at its peak, above what was allocated before it)."""
    init_rank(rank, world, port)
    import gc

    import torch

    from kuangchao_core.comm import world_group
    from kuangchao_core.config.settings import run_settings
    from kuangchao_core.engine.trainer import Trainer
    from kuangchao_core.parallel.mesh import ParallelMesh

    out = {}
    for name, extra in jobs.items():
        cfg = job_config(name, extra, root, setup)
        device = torch.device("cuda", 0) if cfg.train.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        mesh = ParallelMesh.from_config(cfg.parallel, rank, world)
        trainer = Trainer(run_settings(cfg), rank, world, device, world_group(), mesh)
        trainer.run(resume="never", max_steps=cfg.train.steps)
        out[name] = trainer.sync.tensor_bytes()
        if device.type == "cuda":
            out[name]["peak_allocated"] = torch.cuda.max_memory_allocated(device) - before
        trainer.barrier()
        del trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    queue.put((rank, out))


def measure(world: int, jobs: dict, setup: dict | None = None, timeout_s: float = 900) -> dict[str, dict[str, int]]:
    """Every rank's ``tensor_bytes`` per job, from ``world`` Gloo processes; ``{job: {"max_total": …, "rank0":
    {kind: bytes}}}`` (the total leaves out ``peak_allocated``, which ``rank0`` and ``max_peak`` show on CUDA)."""
    results = run_ranks(world, _worker, (jobs, setup), timeout_s)
    out = {}
    for job in jobs:
        per_rank = [results[r][job] for r in range(world)]
        out[job] = {
            "max_total": max(sum(v for k, v in b.items() if k != "peak_allocated") for b in per_rank),
            "rank0": per_rank[0],
        }
        if "peak_allocated" in per_rank[0]:
            out[job]["max_peak"] = max(b["peak_allocated"] for b in per_rank)
    return out


def main() -> int:
    smoke = "--smoke" in sys.argv[1:]
    if set(sys.argv[1:]) - {"--smoke"}:
        raise SystemExit(f"usage: bytes_per_rank.py [--smoke] (got {' '.join(sys.argv[1:])})")
    result = {}
    for name, (layout, world, jobs) in JOBS.items():
        if smoke:
            layout, world, setup = SMOKE[name]
            jobs = {job: _merge(extra, setup) for job, extra in jobs.items()}
        measured = measure(world, jobs)
        (ours, ours_bytes), (peer, peer_bytes) = reversed(list(measured.items()))  # JOBS: the peer first
        ratio = ours_bytes["max_total"] / peer_bytes["max_total"]
        for job, m in measured.items():
            kinds = ", ".join(f"{k} {v / 2**10:.1f} KiB" for k, v in m["rank0"].items())
            print(f"{layout} {job}: largest rank {m['max_total'] / 2**10:.1f} KiB (rank 0: {kinds})")
        print(f"{layout}: {ours} ÷ {peer} = {ratio:.3f}")
        result[name] = {"layout": layout, "processes": world, "ratio": round(ratio, 4), "jobs": measured}
    emit(result, RESULT_KEYS, smoke=smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
