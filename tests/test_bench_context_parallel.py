"""``benchmarks/context_parallel.py --smoke``: the CP step-time benchmark runs end to end (two Gloo ranks, one block
of one step at seq 64), its cp2 run starts from the one-process loss, and on CPU it reports why torch's own context
parallelism cannot run (torch 2.13's ring dispatches only the CUDA SDPA ops; the CPU op has no sharding strategy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.tolerances import FP32_LOSS_REL

ROOT = Path(__file__).resolve().parent.parent


def test_context_parallel_benchmark_smoke():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "context_parallel.py"), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["ratio_vs_peer"]["cp2_vs_one_process"] > 0
    assert result["first_loss_rel_diff"] <= FP32_LOSS_REL, result
    assert "_scaled_dot_product_flash_attention_for_cpu" in result["torch_cp"], result["torch_cp"]
