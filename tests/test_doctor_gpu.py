"""``kc doctor`` on GPU clusters (issue 44 item 5): the per-node driver/CUDA/NCCL probe, agreement across nodes
(error for CUDA/NCCL major.minor, warning for the driver and GPU model), and the NCCL smoke's skip and judging."""

from __future__ import annotations

import json

import pytest
import torch

from kuangchao_core.sched import gpu_versions as G
from kuangchao_core.sched import nccl_smoke as S


def _gpu_node(cuda="12.4", nccl="2.21.5", driver="550.54.15", gpus=("NVIDIA H100 80GB HBM3",) * 8) -> dict:
    return {"cuda": cuda, "nccl": nccl, "driver": driver, "gpus": list(gpus), "cuda_available": True, "why": {}}


def _cpu_node() -> dict:
    why = "torch 2.5.0+cpu is built without CUDA"
    return {
        "cuda": "none",
        "nccl": "none",
        "driver": "none",
        "gpus": "none",
        "cuda_available": False,
        "why": {"cuda": why, "nccl": f"CUDA not available: {why}", "gpus": why, "driver": "no nvidia-smi on PATH"},
    }


def test_the_probe_on_this_machine_says_none_with_a_reason_where_there_is_no_gpu():
    got = G.probe_gpu_versions()
    assert set(G.FIELDS) <= set(got) and json.loads(json.dumps(got)) == got  # one JSON line for an agent
    if torch.cuda.is_available():  # a GPU machine: real values, no reasons
        assert got["cuda"] == torch.version.cuda and got["nccl"] != G.NONE and len(got["gpus"]) >= 1
        return
    assert got["cuda_available"] is False
    for field in ("nccl", "gpus"):
        assert got[field] == G.NONE and "CUDA not available" in got["why"][field]
    if torch.version.cuda is None:
        assert got["cuda"] == G.NONE and "built without CUDA" in got["why"]["cuda"]
    if got["driver"] == G.NONE:
        assert "nvidia-smi" in got["why"]["driver"]


def test_the_driver_is_read_from_proc_when_nvidia_smi_is_absent(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi on PATH
    proc = tmp_path / "version"
    proc.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
        "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
    )
    assert G.read_driver_version(proc) == ("550.54.15", "")
    value, why = G.read_driver_version(tmp_path / "absent")
    assert value == G.NONE and "no nvidia-smi on PATH" in why and "absent" in why


def test_nodes_that_agree_pass_every_line_and_a_patch_level_difference_still_agrees():
    checks = G.gpu_agreement_checks({"a": _gpu_node(), "b": _gpu_node(cuda="12.4.1", nccl="2.21.1"), "c": _gpu_node()})
    assert [c.name for c in checks] == ["gpu_cuda", "gpu_nccl", "gpu_driver", "gpu_model"]
    assert all(c.ok and not c.warn for c in checks), checks
    assert "12.4 on every node (3 compared)" in checks[0].detail
    assert "8 x NVIDIA H100" in checks[3].detail


def test_a_cuda_or_nccl_major_minor_mismatch_is_an_error_naming_the_odd_node():
    checks = {
        c.name: c for c in G.gpu_agreement_checks({"a": _gpu_node(), "b": _gpu_node(cuda="12.1"), "c": _gpu_node()})
    }
    bad = checks["gpu_cuda"]
    assert not bad.ok and "b: 12.1" in bad.detail and "a, c: 12.4" in bad.detail and "NCCL" in bad.detail
    assert bad.fix and checks["gpu_nccl"].ok  # the negative control: only the field that differs fails

    nccl = {c.name: c for c in G.gpu_agreement_checks({"a": _gpu_node(), "b": _gpu_node(nccl="2.18.3")})}
    assert not nccl["gpu_nccl"].ok and "2.18.3" in nccl["gpu_nccl"].detail and nccl["gpu_cuda"].ok

    mixed = {c.name: c for c in G.gpu_agreement_checks({"gpu1": _gpu_node(), "gpu2": _gpu_node(), "cpu": _cpu_node()})}
    assert not mixed["gpu_cuda"].ok and "cpu: none (torch 2.5.0+cpu is built without CUDA)" in mixed["gpu_cuda"].detail


def test_a_driver_or_gpu_model_mismatch_is_a_warning_that_says_why():
    checks = {
        c.name: c
        for c in G.gpu_agreement_checks({"a": _gpu_node(), "b": _gpu_node(driver="535.104.05", gpus=["NVIDIA A100"])})
    }
    driver = checks["gpu_driver"]
    assert driver.ok and driver.warn and "535.104.05" in driver.detail and "550.54.15" in driver.detail
    assert "warning" in driver.detail and "the job starts" in driver.detail and driver.fix
    assert checks["gpu_model"].ok and checks["gpu_model"].warn and "slowest" in checks["gpu_model"].detail
    assert checks["gpu_cuda"].ok and not checks["gpu_cuda"].warn


def test_cpu_nodes_agree_on_none_and_an_older_agent_is_named_not_compared():
    checks = G.gpu_agreement_checks({"a": _cpu_node(), "b": _cpu_node(), "old": None})
    assert all(c.ok and not c.warn for c in checks)
    assert "not compared: old" in checks[0].detail and "none (torch 2.5.0+cpu" in checks[0].detail


def test_the_smoke_is_skipped_with_the_reason_unless_every_node_has_agreeing_cuda():
    cpu = S.nccl_smoke_check({"a": _cpu_node(), "b": _gpu_node()}, run=lambda: pytest.fail("must not run"))
    assert cpu.ok and cpu.detail.startswith("skipped: no CUDA with NCCL on a (CUDA not available")
    disagree = G.nccl_smoke_skip({"a": _gpu_node(), "b": _gpu_node(nccl="2.18.3")})
    assert disagree and "gpu_nccl" in disagree
    assert G.nccl_smoke_skip({"a": _gpu_node(), "b": _gpu_node(driver="535.104.05")}) is None  # a warning only
    assert G.nccl_smoke_skip({}) == "no nodes to run it on"

    ran = []
    S.nccl_smoke_check(
        {"a": _gpu_node(), "b": _gpu_node()}, run=lambda: ran.append(1) or S.Check("nccl_smoke", True, "")
    )
    assert ran == [1]
    tcp = S.nccl_smoke_check({"a": _gpu_node(), "b": _gpu_node()}, run=None, cannot="TCP agents only report versions")
    assert tcp.ok and tcp.warn and "not run: TCP agents" in tcp.detail and "kc node start" in tcp.fix


def _write_rank(out, rank, world, value, uniform=True):
    out.mkdir(parents=True, exist_ok=True)
    rec = {"rank": rank, "world": world, "node": f"n{rank}", "value": value, "uniform": uniform}
    (out / f"rank_{rank}.json").write_text(json.dumps(rec))


def test_the_ranks_files_are_judged_by_the_full_sum_with_negative_controls(tmp_path):
    for r in range(4):
        _write_rank(tmp_path / "good", r, 4, 10.0)
    assert S.verify_rank_files(tmp_path / "good", 4) is None
    for r in range(4):  # one rank summed only part of the world (a miscounted group)
        _write_rank(tmp_path / "short", r, 4, 10.0 if r != 2 else 6.0)
    assert "rank 2 on n2: sum 6.0" in S.verify_rank_files(tmp_path / "short", 4)
    for r in range(3):
        _write_rank(tmp_path / "missing", r, 4, 10.0)
    assert S.verify_rank_files(tmp_path / "missing", 4) == "rank 3 wrote no result"
    _write_rank(tmp_path / "ragged", 0, 1, 1.0, uniform=False)
    assert "uniform False" in S.verify_rank_files(tmp_path / "ragged", 1)


def test_the_smoke_worker_runs_for_real_over_gloo_on_two_processes():
    check = S.run_local_smoke(2, backend="gloo", timeout_s=60)
    assert check.ok and "2-rank GLOO all_reduce on this machine ok" in check.detail, check
    if not torch.cuda.is_available():  # the negative control: the NCCL path on a CPU machine fails, said why
        bad = S.run_local_smoke(1, backend="nccl", timeout_s=60)
        assert not bad.ok and "rank 0 exit 1" in bad.detail and bad.fix, bad


def test_a_node_agent_publishes_the_probe_in_its_facts_and_an_older_agents_facts_still_read():
    from dataclasses import asdict

    from kuangchao_core.sched.nodes import NodeFacts, local_facts

    facts = local_facts("n1", address="127.0.0.1")
    assert set(G.FIELDS) <= set(facts.gpu) and facts.gpu["cuda"] == G.probe_gpu_versions()["cuda"]
    assert NodeFacts.from_dict(json.loads(json.dumps(asdict(facts)))) == facts  # the registry's JSON round trip
    old = {k: v for k, v in asdict(facts).items() if k != "gpu"}
    assert NodeFacts.from_dict(old).gpu is None  # then the doctor names it "not compared"
