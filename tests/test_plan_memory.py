"""``raise_for_plan`` against the devices' memory (issue 16, "Config"): a layout whose largest rank's estimated
memory exceeds what a rank of this machine may use is refused with the numbers (estimate, available, device) and
what to change, before anything is launched; ``kc plan`` still explains it, after a warning."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.config import load_config
from kuangchao_core.engine import plan_memory
from kuangchao_core.engine.plan import (
    explain_plan,
    format_plan,
    memory_problems,
    raise_for_plan,
    rank_memory,
    rank_ranges,
)
from kuangchao_core.engine.plan_memory import (
    GIB,
    DeviceMemory,
    cgroup_remaining_bytes,
    device_memory,
    meminfo_available_bytes,
)
from kuangchao_core.errors import PlanError

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")
RUN = CliRunner()


@pytest.fixture
def driver(monkeypatch):
    """This process as the driver before launch: no HAL device context, no torchrun environment."""
    monkeypatch.setattr("kuangchao_core.hal.context.current_context", lambda: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def _largest(cfg) -> float:
    return max(r["memory_bytes"]["total"] for r in rank_memory(cfg))


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, (pattern, text)
    return float(m.group(1))


def _hf_job(tmp_path: Path, **sizes) -> Path:
    """A job on a local Hugging Face directory whose config.json has ``sizes``, trained on the CPU."""
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    shape = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        **sizes,
    }
    (hf / "config.json").write_text(json.dumps(shape))
    job = tmp_path / "job.yaml"
    job.write_text(f"task: {{name: big}}\nmodel: {{checkpoint: {hf}}}\ntrain: {{device: cpu}}\n")
    return job


HUGE = {"vocab_size": 4_000_000, "hidden_size": 16384, "intermediate_size": 53248, "num_attention_heads": 128}


def test_a_plan_larger_than_the_given_memory_is_refused_with_its_numbers():
    cfg = load_config(TINY)  # dp 2, micro batch 8, ZeRO 0
    need = _largest(cfg)
    with pytest.raises(PlanError) as err:
        raise_for_plan(cfg, device_memory=DeviceMemory(need / 2, "cpu", "test figure"))
    [(path, msg)] = err.value.errors
    assert path == "parallel"
    assert _number(r"needs an estimated ([\d.]+) GiB per rank", msg) == pytest.approx(need / GIB, rel=1e-3)
    assert _number(r"cpu has ([\d.]+) GiB per rank \(test figure\)", msg) == pytest.approx(need / 2 / GIB, rel=1e-3)
    for hint in ("tensor_parallel_size (now 1)", "pipeline_parallel_size (now 1)", "zero_stage 2 (now 0)"):
        assert hint in msg
    assert "micro_batch_size (now 8)" in msg
    raise_for_plan(cfg, device_memory=need)  # the controls: exactly enough, and more, are accepted
    raise_for_plan(cfg, device_memory=2 * need)


def test_the_hint_follows_the_layout_and_the_largest_rank_is_named():
    cfg = load_config(
        TINY,
        [
            "parallel.data_parallel_size=1",
            "parallel.pipeline_parallel_size=2",
            "parallel.gradient_accumulation_steps=2",
            "parallel.zero_stage=2",
            "cluster.nproc_per_node=2",
        ],
    )
    ranks = rank_memory(cfg)
    worst = max(ranks, key=lambda r: r["memory_bytes"]["total"])
    [(_, msg)] = memory_problems(cfg, memory=1.0)
    assert f"(rank {worst['rank']}:" in msg and "zero_stage 2 (now" not in msg  # already ZeRO-2: not suggested
    [(_, msg)] = memory_problems(
        load_config(TINY, ["parallel.data_parallel_size=1", "cluster.nproc_per_node=1"]), memory=1.0
    )
    assert "(now 1, so raise it too)" in msg  # ZeRO needs data parallel ranks to shard over


def test_ranks_with_the_same_memory_share_one_row_naming_them():
    cfg = load_config(
        TINY,
        [
            "parallel.data_parallel_size=4",
            "parallel.pipeline_parallel_size=2",
            "cluster.nproc_per_node=8",
            "parallel.gradient_accumulation_steps=2",
        ],
    )
    text = format_plan(explain_plan(cfg))
    rows = [line for line in text.splitlines() if line.startswith("  rank")]
    assert [r.split(":")[0] for r in rows] == ["  ranks 0, 2, 4, 6 (tp 0, pp 0)", "  ranks 1, 3, 5, 7 (tp 0, pp 1)"], (
        rows
    )
    per_rank = {r["rank"]: r["memory_bytes"]["total"] for r in rank_memory(cfg)}
    assert per_rank[0] == per_rank[6] != per_rank[1] == per_rank[7]  # the grouping is the figures', not the layout's
    assert rank_ranges([5, 0, 1, 2, 4, 9]) == "0-2, 4-5, 9"


def test_rank_memory_is_the_memory_kc_plan_explains():
    cfg = load_config(TINY)
    assert rank_memory(cfg) == explain_plan(cfg)["ranks"]
    assert rank_memory(cfg, [1]) == explain_plan(cfg)["ranks"][1:]


def test_the_driver_measures_this_machine_and_shares_it_among_the_local_ranks(driver, monkeypatch):
    monkeypatch.setattr(plan_memory, "cpu_available_bytes", lambda: 8 * GIB)
    cfg = load_config(TINY)  # two CPU ranks on this machine
    mem = device_memory(cfg)
    assert (mem.bytes_per_rank, mem.device) == (4 * GIB, "cpu") and "shared by 2 rank(s)" in mem.source
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # a worker started by torchrun knows its node's ranks
    assert device_memory(cfg).bytes_per_rank == 2 * GIB
    static = load_config(TINY, ["cluster.mode=static", 'cluster.nodes=[{"host": "h1", "gpus": 2}]'])
    assert device_memory(static) is None  # the workers run elsewhere: they check there
    assert device_memory(load_config(TINY, ["train.device=cuda"])) is None  # CUDA: each worker on its device


def test_a_worker_checks_its_own_cuda_device(monkeypatch):
    ctx = SimpleNamespace(device=torch.device("cuda", 3), name="NVIDIA H100", total_memory=80 * 2**30)
    monkeypatch.setattr("kuangchao_core.hal.context.current_context", lambda: ctx)
    mem = device_memory(load_config(TINY, ["train.device=cuda"]))
    assert (mem.bytes_per_rank, mem.device) == (80 * GIB, "cuda:3 (NVIDIA H100)")
    cfg = load_config(TINY)
    ctx.total_memory = int(_largest(cfg) / 3)
    with pytest.raises(PlanError, match=r"but cuda:3 \(NVIDIA H100\) has [\d.]+ GiB per rank"):
        raise_for_plan(cfg, world_size=2)  # as the worker calls it, measuring
    ctx.total_memory = 80 * 2**30
    raise_for_plan(cfg, world_size=2)  # the control


def test_available_cpu_memory_sources(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 4096 kB\nMemAvailable: 1024 kB\n")
    assert meminfo_available_bytes(meminfo) == 1024 * 1024
    cg = tmp_path / "cg"
    cg.mkdir()
    assert cgroup_remaining_bytes(cg) is None  # no cgroup files: no limit known
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text(f"{512 << 20}\n")
    assert cgroup_remaining_bytes(cg) is None  # v2 without a limit
    (cg / "memory.max").write_text(f"{1 << 30}\n")
    (cg / "memory.stat").write_text(f"anon 1\ninactive_file {256 << 20}\n")
    assert cgroup_remaining_bytes(cg) == (1 << 30) - (256 << 20)  # limit less the working set (usage − cache)


def test_a_huge_hf_model_on_the_cpu_is_refused_by_kc_train_before_any_launch(tmp_path, driver, monkeypatch):
    job = _hf_job(tmp_path, **HUGE)  # vocab 4M x hidden 16384: terabytes of fp32 AdamW state, on this machine
    launched = []
    monkeypatch.setattr("kuangchao.cli.train.prefect_api_problem", lambda *a, **k: launched.append(1) or "stop")
    out = RUN.invoke(app, ["train", "--config", str(job)])
    assert out.exit_code == 2 and not launched, out.output
    assert re.search(r"parallel: the plan needs an estimated [\d.]+ GiB per rank .* but cpu has [\d.]+ GiB", out.output)
    with pytest.raises(PlanError, match="GiB per rank"):  # what the flow's pre-check calls
        raise_for_plan(load_config(job))
    warned = RUN.invoke(app, ["plan", "--config", str(job)])  # kc plan explains it, after the warning
    assert warned.exit_code == 0 and "warning: parallel: the plan needs an estimated" in warned.output
    assert "kc train would refuse this plan here" in warned.output
    warning = warned.output.split("warning: parallel: ")[1].split("\nmodel")[0].splitlines()
    assert any(line.startswith("  but cpu has") for line in warning), warning  # the finding, then each remedy below
    assert "  - lower micro_batch_size (now 4) to hold fewer activations" in warning, warning
    small = _hf_job(tmp_path)  # the control: the same directory with sane sizes fits this machine
    raise_for_plan(load_config(small))
    assert "warning" not in RUN.invoke(app, ["plan", "--config", str(small)]).output
