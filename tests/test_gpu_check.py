"""``benchmarks/gpu/check.py``: the single-GPU check, its every section run on the CPU with tiny shapes (--smoke).

The smoke run goes through the same code as the GPU run: a real ``kc train`` through the Prefect flow (bf16,
compiled), the fp32 run of the same job, ``kc plan``, the 2-process Gloo job started as torchrun starts it and the
one-process reference. The figures are only checked for sanity here (a CPU has no MFU); the arithmetic the GPU
figures rest on (model FLOPs per token) is checked against the worked example of the performance notes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_smoke import assert_smoke_result
from tests.tolerances import FP32_LOSS_REL

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "benchmarks" / "gpu" / "check.py"
sys.path.insert(0, str(CHECK.parent))

import _sections as sections  # noqa: E402
import engine_check  # noqa: E402

BF16_REL = 0.02  # tests/test_mixed_precision.py's stated bf16 tolerance per step


def test_flops_per_token_is_the_performance_notes_worked_example():
    from kuangchao_core.models.llama import LlamaConfig

    cfg = LlamaConfig(**engine_check.LLAMA_1B)
    # /work/shared/reference/performance.md §2.1: N_total = 1.236 B; F_tok = 6·1.236e9 + 12·16·2048·2048 = 8.22 GFLOP
    assert cfg.num_params() == pytest.approx(1.236e9, rel=1e-3)
    assert engine_check.flops_per_token(cfg, 2048) == pytest.approx(8.22e9, rel=1e-3)
    untied = LlamaConfig(**{**engine_check.LLAMA_1B, "tie_embeddings": False})
    # an untied input embedding is a lookup, not a matmul: the FLOPs stay those of the tied model
    assert engine_check.flops_per_token(untied, 2048) == engine_check.flops_per_token(cfg, 2048)


def test_a_worker_that_fails_is_reported_with_its_error_not_waited_for(tmp_path):
    job = engine_check.multi_rank_job(True, "cpu", 2, tmp_path)
    job["model"]["num_heads"] = 3  # hidden 64 is not divisible by 3 heads: every rank refuses the config
    path = engine_check.write_job(job, tmp_path / "bad.yaml")
    run = engine_check.launch_workers(path, [0, 1], tmp_path, "bad", timeout_s=120)
    assert not run["ok"] and run["losses"] == [] and any(c and c > 0 for c in run["returncodes"]), run
    assert "ConfigError" in run["error"] and "num_heads" in run["error"], run["error"]


def test_a_failing_or_overrunning_section_is_recorded_and_the_next_one_still_runs(tmp_path):
    import time

    result: dict = {}

    def broken():
        raise ValueError("no such kernel")

    def endless():
        time.sleep(30)

    def fine(x):
        return {"x": x}

    for key, fn, args in (("a", broken, ()), ("b", endless, ()), ("c", fine, (3,))):
        sections.run_section(result, key, fn, *args, out=tmp_path, limit_s=1, budget_left=lambda: 100.0)
    sections.run_section(result, "d", fine, 4, out=tmp_path, limit_s=1, budget_left=lambda: 5.0, need_s=30)
    assert result["a"]["error"] == "ValueError: no such kernel" and result["c"] == {"x": 3}
    assert result["b"]["error"].startswith("timed out after 1 s")
    assert {k: v["status"] for k, v in result["sections"].items()} == {
        "a": "failed", "b": "timed_out", "c": "ok", "d": "skipped"
    }  # fmt: skip
    assert json.loads((tmp_path / "gpu_check.json").read_text())["complete"] is False  # written after each


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gpu_check_smoke_runs_every_section_with_sane_figures(tmp_path, prefect_api):
    out = tmp_path / "out"
    # the session's Prefect server: a temporary one per kc train costs 10-30 s here and is the same flow code
    # (tests/test_startup.py and make demo start kc train without one)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFECT_API_URL": prefect_api}
    proc = subprocess.run(
        [sys.executable, str(CHECK), "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert_smoke_result(CHECK, result, proc.stdout)  # the keys every benchmark's smoke run is held to
    assert json.loads((out / "gpu_check.json").read_text()) == result and result["complete"] is True
    statuses = {k: v["status"] for k, v in result["sections"].items()}
    assert statuses == dict.fromkeys(
        ["phase_peak", "communicators_plan", "bf16_vs_fp32", "llama_1b_step", "packed_attention", "bytes_per_rank",
         "engine"], "ok"
    ), statuses  # fmt: skip
    assert result["phase_peak"]["mem_kind"] == "rss" and "skipped" in result["phase_peak"]  # a GPU figure
    plan = result["communicators_plan"]  # kc plan's NCCL estimate for eight GPUs: dp2×tp4 has world, tp, dp
    assert plan["dp2_tp4"]["rank0_nccl_bytes_estimate"] == 3 * plan["per_communicator_bytes_estimate"] > 0

    # (a), (b): the sections that were there before
    assert math.isfinite(result["bf16_vs_fp32"]["max_rel_loss_diff"])
    assert all(result["llama_1b_step"][side]["tokens_per_s"] > 0 for side in ("ours", "peer"))

    # (f) packed-document attention: the short row takes one masked call, the longer one a call per document; the
    # figures are the CPU's (tiny heads), only their sanity is checked
    packed = result["packed_attention"]
    assert (packed["s64"]["path"], packed["s256"]["path"]) == ("short_rows_mask", "sdpa_documents")
    for seq in ("s64", "s256"):
        assert packed[seq]["documents"] >= 2 and min(packed[seq]["peak_bytes"].values()) > 0
        assert 0 < packed[seq]["ratio"]["ratio_vs_peer"] < math.inf

    # (g) bytes per rank from the engine's tensors, two Gloo ranks: at dp2 ZeRO-1 bf16 parameters hold
    # 2 + 4 + 12/2 bytes per parameter, autocast 4 + 4 + 8/2 — the same up to ZeRO's padding; half the parameter bytes
    mem = result["bytes_per_rank"]
    assert mem["ranks"] == 2 and mem["dp2_zero1"]["tensor_ratio"] == pytest.approx(1.0, rel=0.01), mem
    assert "peak_ratio" not in mem["dp2_zero1"]  # a CPU has no allocator peak
    jobs = mem["jobs"]
    assert 2 * jobs["zero1_bf16_params"]["rank0"]["params"] == jobs["zero1_bf16_autocast"]["rank0"]["params"], jobs

    engine = result["engine"]
    # (c) a real kc train of the job file the check wrote, through the flow, compiled, bf16
    run = engine["kc_train"]
    assert run["completed"] and run["returncode"] == 0, run
    assert run["summary"]["trained_steps"] == 3 and len(run["losses"]) == 3
    assert all(math.isfinite(x) and 0 < x < 10 for x in run["losses"])
    assert run["tokens_per_s"] > 0 and run["summary"]["tokens_per_s_mean"] > 0
    assert run["compile_line"].startswith("compiled 2 decoder layers with inductor in ") and run["compile_s"] > 0
    assert run["mfu"] is None and run["peak_flops"] is None  # a CPU has no bf16 peak to hold it against
    assert run["flops_per_token"] > 6 * run["params"] > 0
    assert run["adamw"] == "foreach" and "scaled_dot_product" in run["attention"]
    assert run["mem_kind"] == "rss" and run["peak_mem_bytes"] > 0 and run["plan"]["total"] > 0
    assert run["tensor_bytes"] == pytest.approx(run["plan_state_bytes"], rel=0.05)  # the plan counts the states
    from kuangchao_core.config import load_config

    job = load_config(str(out / "kc_train_job.yaml"))
    assert job.train.compile and job.train.dtype == "bf16" and job.data.is_synthetic and job.train.steps == 3

    # (d) the bf16 losses against the same job in fp32
    vs = engine["vs_fp32"]
    assert vs["steps"] == 3 and all(math.isfinite(x) for x in vs["fp32_losses"])
    assert vs["max_rel_loss_diff"] <= BF16_REL

    # (e) two ranks over Gloo as torchrun starts them (on a CPU both run), equal to one process on the same batch
    multi = engine["multi_rank"]
    assert multi["completed"] and multi["as_launched"]["ok"] and "shared_device" not in multi, multi
    assert len(multi["as_launched"]["losses"]) == 3 and all(math.isfinite(x) for x in multi["as_launched"]["losses"])
    assert multi["max_rel_loss_diff"] <= FP32_LOSS_REL
    assert (out / "multi_rank_job.yaml").is_file()
