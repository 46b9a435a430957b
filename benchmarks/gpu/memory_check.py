"""Section (g) of the GPU check: bytes per rank on the device (issue 29 item 5), bf16 parameters with fp32 master
weights (``train.param_dtype: bf16``) against bf16 autocast (fp32 parameters).

Four Gloo processes share the one device (``parallel.backend: gloo``, CUDA tensors staged through host memory by
``comm.host_staging``, as in section (e)) and run
``benchmarks/bytes_per_rank.py``'s worker: per job one optimizer step of two micro-batches through the engine's
Trainer, then per rank the engine's tensors (``GradSync.tensor_bytes``: parameters, gradients, moments and fp32
masters held after the step) and ``torch.cuda.max_memory_allocated`` over the job (its peak: activations,
autocast's weight copies, communication buffers included). Jobs: dp4 ZeRO-1 (the issue's layout: 2 + 4 + 12/4 = 9
bytes per parameter against autocast's 4 + 4 + 8/4 = 10 plus its bf16 weight copies) and ZeRO-2, each in bf16
autocast and with bf16 parameters; the ratio bf16 parameters ÷ autocast of the largest rank's tensor bytes and of
its peak.

Model on the GPU: 8 layers of hidden 1024 (MLP 2816, 16/8 heads), vocabulary 32000 — 0.17 B parameters, whose
states (≈ 1.5 GiB per rank) outweigh the activations of 4 × 256 tokens; under a minute on an H200, most of it the
processes' start. ``python benchmarks/gpu/memory_check.py [--smoke]`` runs this section alone. ``--smoke``: the tiny preset's shapes on the CPU, two ranks (dp2, where 2 + 4 + 12/2 equals
autocast's 4 + 4 + 8/2: ratio 1), the ZeRO-1 pair only, no peak (a CPU has no allocator counter).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bytes_per_rank import measure  # noqa: E402

GPU_MODEL = {
    "preset": None,
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_layers": 8,
    "num_heads": 16,
    "num_kv_heads": 8,
    "max_seq_len": 256,
}
PAIR = {"bf16_autocast": {"dtype": "bf16"}, "bf16_params": {"dtype": "bf16", "param_dtype": "bf16"}}


def _jobs(stages: tuple[int, ...]) -> dict[str, dict]:
    return {
        f"zero{z}_{name}": {"parallel": {"zero_stage": z}, "train": train}
        for z in stages
        for name, train in PAIR.items()
    }


def memory_check(device: Any, smoke: bool) -> dict[str, Any]:
    """Section (g): per ZeRO stage (``dp<N>_zero<z>``), the ratios bf16 parameters ÷ autocast of the largest rank's
    tensor bytes and (on CUDA) peak allocated, beside every job's figures (``jobs``); prints one line per stage."""
    stages = (1,) if smoke else (1, 2)
    ranks = 2 if smoke else 4
    setup: dict[str, Any] = {
        # Gloo device groups: NCCL refuses several ranks on one GPU (``auto`` would pick it on CUDA); the CUDA
        # tensors go through host memory (``comm.host_staging``)
        "parallel": {
            "data_parallel_size": ranks,
            "micro_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "backend": "gloo",
        },
        "train": {"device": device.type},
    }
    if not smoke:
        setup["model"] = GPU_MODEL
        setup["data"] = {"format": "synthetic", "seq_len": 256, "synthetic": {"num_train": 512, "num_eval": 8}}
    t0 = time.perf_counter()
    try:
        measured = measure(ranks, _jobs(stages), setup, timeout_s=120 if smoke else 240)
    except SystemExit as exc:  # run_ranks' way of saying a rank failed: a finding, not the check's end
        raise RuntimeError(str(exc)) from None
    out: dict[str, Any] = {"ranks": ranks, "jobs": measured, "wall_s": round(time.perf_counter() - t0, 1)}
    for z in stages:
        mixed, ours = measured[f"zero{z}_bf16_autocast"], measured[f"zero{z}_bf16_params"]
        row = {"tensor_ratio": round(ours["max_total"] / mixed["max_total"], 4)}
        if "max_peak" in ours:
            row["peak_ratio"] = round(ours["max_peak"] / mixed["max_peak"], 4)
        out[f"dp{ranks}_zero{z}"] = row
        peak = (
            f"; peak allocated {ours['max_peak'] / 2**30:.2f} ÷ {mixed['max_peak'] / 2**30:.2f} GiB = "
            f"{row['peak_ratio']:.3f}"
            if "peak_ratio" in row
            else ""
        )
        print(
            f"bytes per rank dp{ranks} ZeRO-{z}, bf16 params ÷ bf16 autocast: tensors {ours['max_total'] / 2**20:.1f} ÷ "
            f"{mixed['max_total'] / 2**20:.1f} MiB = {row['tensor_ratio']:.3f}{peak}"
        )
    return out


if __name__ == "__main__":  # section (g) alone: python benchmarks/gpu/memory_check.py [--smoke]
    import torch

    smoke = "--smoke" in sys.argv
    result = memory_check(torch.device("cpu") if smoke else torch.device("cuda", 0), smoke)
    print("RESULT " + json.dumps(result))
