"""Checkpoints: round trip, integrity, crash safety, retention, no pickle, multi-rank, CLI."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from kuangchao.cli.checkpoint_cmd import register
from kuangchao_core.ckpt.integrity import find_latest_intact, verify_checkpoint
from kuangchao_core.ckpt.reader import (
    load_shard,
    read_manifest,
    read_rng,
    read_shard_extra,
    read_shard_slices,
    read_state,
)
from kuangchao_core.ckpt.retention import apply_retention
from kuangchao_core.ckpt.rng import capture_rng_state, restore_rng_state
from kuangchao_core.ckpt.writer import CheckpointWriter
from kuangchao_core.errors import CheckpointCorrupt, CheckpointError, PermissionDenied
from kuangchao_core.parallel.optim_state import flatten_optimizer_state, load_optimizer_state
from kuangchao_core.perm.guard_api import AllowAll, DenyAll, install_guard
from tests.mp import run_distributed

ROOT = Path(__file__).resolve().parent.parent
TASK = "unit"


@pytest.fixture(autouse=True)
def allow_all():
    previous = install_guard(AllowAll())
    yield
    install_guard(previous)


def _noop() -> None:
    return None


def _model_and_opt(seed: int = 0, steps: int = 3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, foreach=False)
    for _ in range(steps):
        loss = model(torch.randn(5, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def _save_simple(root: Path, step: int, value: float = 1.0, **kw) -> Path:
    writer = CheckpointWriter(root, TASK, 0, 1, barrier=_noop, **kw)
    tensors = {"param.w": torch.full((64, 64), value), "param.b": torch.arange(10.0) + value}
    return writer.save(step, tensors, capture_rng_state(), state={"lr": 0.1}, meta={"model": {"h": 64}, "parallel": {}})


# --------------------------------------------------------------------------------------------- round trip


def test_roundtrip_params_adamw_and_rng(tmp_path):
    model, opt = _model_and_opt()
    names = [n for n, _ in model.named_parameters()]
    tensors = {f"param.{n}": p.detach() for n, p in model.named_parameters()}
    opt_tensors, opt_meta = flatten_optimizer_state(opt, names)
    tensors.update(opt_tensors)
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(9)
    rng = capture_rng_state()
    expected = (torch.rand(6), np.random.rand(4), [random.random() for _ in range(3)], torch.randn(3))

    writer = CheckpointWriter(tmp_path, TASK, 0, 1, barrier=_noop)
    step_dir = writer.save(3, tensors, rng, state={"sampler": {"pos": 15}, "optimizer_meta": opt_meta}, meta={})
    assert step_dir == tmp_path / TASK / "step_00000003"
    assert verify_checkpoint(step_dir) == []

    # perturb every stream so that a restore that silently does nothing cannot pass
    torch.manual_seed(999)
    np.random.seed(999)
    random.seed(999)
    not_restored = torch.rand(6)
    assert not torch.equal(not_restored, expected[0])

    restore_rng_state(read_rng(step_dir, 0))
    assert torch.equal(torch.rand(6), expected[0])
    assert np.array_equal(np.random.rand(4), expected[1])
    assert [random.random() for _ in range(3)] == expected[2]
    assert torch.equal(torch.randn(3), expected[3])

    state = read_state(step_dir)
    assert state["step"] == 3 and state["sampler"] == {"pos": 15}
    loaded = load_shard(step_dir, 0, verify=True)
    fresh, fresh_opt = _model_and_opt(seed=1, steps=0)
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            p.copy_(loaded[f"param.{n}"])
    load_optimizer_state(fresh_opt, names, loaded, state["optimizer_meta"])

    ref = opt.state_dict()
    got = fresh_opt.state_dict()
    assert got["param_groups"] == ref["param_groups"]
    assert isinstance(fresh_opt.param_groups[0]["betas"], tuple)
    for idx, st in ref["state"].items():
        assert set(got["state"][idx]) == set(st)
        for k, v in st.items():
            assert isinstance(got["state"][idx][k], torch.Tensor) and got["state"][idx][k].dtype == v.dtype
            assert torch.equal(got["state"][idx][k], v), k
    # one more identical step gives bitwise identical parameters
    x = torch.randn(5, 8)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_optimizer_state_matched_by_name_not_order(tmp_path):
    model, opt = _model_and_opt()
    tensors, meta = flatten_optimizer_state(opt, dict(model.named_parameters()))
    fresh, _ = _model_and_opt(seed=3, steps=0)
    params = dict(fresh.named_parameters())
    reordered = list(reversed(list(params)))
    fresh_opt = torch.optim.AdamW([params[n] for n in reordered], lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    load_optimizer_state(fresh_opt, reordered, tensors, meta)
    ref_by_name = {n: opt.state[p] for n, p in model.named_parameters()}
    for n in reordered:
        assert torch.equal(fresh_opt.state[params[n]]["exp_avg"], ref_by_name[n]["exp_avg"])
    with pytest.raises(CheckpointError, match="param group 0 differs"):
        load_optimizer_state(fresh_opt, [f"x{i}" for i in range(len(reordered))], tensors, meta)


def test_slices_and_shard_meta_recorded(tmp_path):
    writer = CheckpointWriter(tmp_path, TASK, 0, 1, barrier=_noop)
    t = torch.ones(2, 3)
    step_dir = writer.save(
        1,
        {"param.a": t, "param.b": torch.zeros(4)},
        capture_rng_state(),
        slices={"param.a": {"full_shape": [4, 3], "ranges": [[2, 4], [0, 3]]}},
        shard_meta={"zero": 1},
    )
    sl = read_shard_slices(step_dir, 0)
    assert sl["param.a"] == {"full_shape": [4, 3], "offsets": [2, 0], "shape": [2, 3]}
    assert sl["param.b"] == {"full_shape": [4], "offsets": [0], "shape": [4]}
    assert read_manifest(step_dir)["tensors"]["shards/rank_00000.safetensors"] == sl
    assert read_shard_extra(step_dir, 0) == {"zero": 1}
    with pytest.raises(CheckpointError, match="outside the full size"):
        writer.save(2, {"param.a": t}, {}, slices={"param.a": {"full_shape": [3, 3], "offsets": [2, 0]}})


# --------------------------------------------------------------------------------------------- integrity


def _flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) - 5 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_manifest", "missing_rng", "format_version"])
def test_damage_detected_and_previous_used(tmp_path, caplog, damage):
    good = _save_simple(tmp_path, 1, 1.0)
    bad = _save_simple(tmp_path, 2, 2.0)
    shard = bad / "shards" / "rank_00000.safetensors"
    expect = {
        "flip": "sha256",
        "truncate": "size",
        "no_manifest": "manifest.json is missing",
        "missing_rng": "rng/rank_00000.json: missing",
        "format_version": "format_version",
    }[damage]
    if damage == "flip":
        _flip_byte(shard)
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "no_manifest":
        (bad / "manifest.json").unlink()
    elif damage == "missing_rng":
        (bad / "rng" / "rank_00000.json").unlink()
    else:
        m = json.loads((bad / "manifest.json").read_text())
        m["format_version"] = 99
        (bad / "manifest.json").write_text(json.dumps(m))

    problems = verify_checkpoint(bad)
    assert any(expect in p for p in problems), problems
    assert verify_checkpoint(good) == []
    with caplog.at_level(logging.WARNING, logger="kuangchao.ckpt"):
        assert find_latest_intact(tmp_path / TASK) == good
    assert any("step_00000002" in r.getMessage() and expect in r.getMessage() for r in caplog.records)


def test_load_shard_refuses_mismatching_files(tmp_path):
    step_dir = _save_simple(tmp_path, 1)
    shard = step_dir / "shards" / "rank_00000.safetensors"
    _flip_byte(shard, offset=len(shard.read_bytes()) - 1)
    with pytest.raises(CheckpointCorrupt, match="sha256") as ei:
        load_shard(step_dir, 0, verify=True)
    assert ei.value.path == str(step_dir)
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(CheckpointCorrupt, match="size 50 bytes"):
        load_shard(step_dir, 0)
    with pytest.raises(CheckpointCorrupt, match="not listed"):
        load_shard(step_dir, 3)
    (step_dir / "manifest.json").unlink()
    with pytest.raises(CheckpointCorrupt, match="manifest.json is missing"):
        read_state(step_dir)
    assert find_latest_intact(tmp_path / TASK) is None


def test_files_are_only_safetensors_and_json(tmp_path):
    step_dir = _save_simple(tmp_path, 4)
    files = sorted(p for p in step_dir.rglob("*") if p.is_file())
    assert {p.relative_to(step_dir).as_posix() for p in files} == {
        "manifest.json",
        "state.json",
        "rng/rank_00000.json",
        "shards/rank_00000.safetensors",
    }
    for p in files:
        raw = p.read_bytes()
        if p.suffix == ".json":
            assert raw[:1] == b"{", f"{p} is not a JSON object"
            json.loads(raw)
        else:
            (n,) = struct.unpack("<Q", raw[:8])
            header = json.loads(raw[8 : 8 + n])
            end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
            assert len(raw) == 8 + n + end
    src = "\n".join(p.read_text() for p in (ROOT / "kuangchao_core" / "ckpt").glob("*.py"))
    assert "torch.load" not in src and "import pickle" not in src


def test_existing_step_refused_when_intact_moved_aside_when_corrupt(tmp_path):
    first = _save_simple(tmp_path, 3, 1.0)
    # an intact step is another writer's: refused, not moved aside (issue 26: two writers on one lineage)
    with pytest.raises(CheckpointError, match="already exists and is intact"):
        _save_simple(tmp_path, 3, 5.0)
    assert verify_checkpoint(first) == []
    assert torch.equal(load_shard(first, 0)["param.b"], torch.arange(10.0) + 1.0)
    assert not [p for p in (tmp_path / TASK).iterdir() if ".replaced-" in p.name]
    # a corrupt one (a resume from an older step finds it) is kept aside for inspection and replaced
    shard = next((first / "shards").iterdir())
    shard.write_bytes(shard.read_bytes()[:-4] + b"XXXX")
    assert verify_checkpoint(first) != []
    _save_simple(tmp_path, 3, 5.0)
    assert verify_checkpoint(first) == []
    assert torch.equal(load_shard(first, 0)["param.b"], torch.arange(10.0) + 5.0)
    aside = [p for p in (tmp_path / TASK).iterdir() if ".replaced-" in p.name]
    assert len(aside) == 1 and verify_checkpoint(aside[0]) != []
    with pytest.raises(CheckpointError, match="already exists"):
        _save_simple(tmp_path, 3, 7.0, on_existing="error")
    assert torch.equal(load_shard(first, 0)["param.b"], torch.arange(10.0) + 5.0)


def test_guard_is_consulted(tmp_path):
    step_dir = _save_simple(tmp_path, 1)
    install_guard(DenyAll())
    with pytest.raises(PermissionDenied, match="checkpoint:unit"):
        _save_simple(tmp_path, 2)
    with pytest.raises(PermissionDenied, match="checkpoint_read"):
        load_shard(step_dir, 0)
    assert verify_checkpoint(step_dir) == []  # hashing needs no token: it deserialises nothing


# --------------------------------------------------------------------------------------------- crash safety

_CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    from pathlib import Path
    from kuangchao_core.ckpt.storage import LocalStorage
    from kuangchao_core.ckpt.writer import CheckpointWriter
    from kuangchao_core.ckpt.rng import capture_rng_state
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    root, stage = Path(sys.argv[1]), sys.argv[2]
    install_guard(AllowAll())

    class Faulty(LocalStorage):
        def write_with(self, key, fill):
            if stage == "mid_shard":
                def half(p):
                    fill(p)
                    data = p.read_bytes()
                    p.write_bytes(data[: len(data) // 2])
                    os._exit(17)
                return super().write_with(key, half)
            return super().write_with(key, fill)

        def rename_dir(self, src, dst):
            if stage == "before_publish" and ".tmp-" in src:
                os._exit(17)
            return super().rename_dir(src, dst)

    calls = []
    def barrier():
        calls.append(1)
        if len(calls) == 2 and stage == "after_files":
            os._exit(17)
        if len(calls) == 2 and stage == "sigkill":
            (root / "in_barrier").write_text("x")
            time.sleep(60)

    w = CheckpointWriter(root, "unit", 0, 1, barrier=barrier, storage=Faulty(root), attempt_id="crash")
    w.save(2, {"param.w": torch.randn(256, 256)}, capture_rng_state(), state={}, meta={})
    print("SAVED")
    """
)


@pytest.mark.parametrize("stage", ["mid_shard", "after_files", "before_publish", "sigkill"])
def test_crash_during_save_keeps_previous(tmp_path, stage):
    prev = _save_simple(tmp_path, 1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), stage], env=env, stdout=subprocess.PIPE)
    if stage == "sigkill":
        deadline = time.time() + 60
        while not (tmp_path / "in_barrier").exists():
            assert proc.poll() is None and time.time() < deadline, "child ended before reaching the barrier"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode in (17, -signal.SIGKILL) and b"SAVED" not in out

    task = tmp_path / TASK
    names = {p.name for p in task.iterdir()}
    assert "step_00000002" not in names
    assert any(n.startswith("step_00000002.tmp-") for n in names), names
    assert verify_checkpoint(prev) == []
    assert find_latest_intact(task) == prev

    # the next attempt (same nonce) succeeds, and retention clears what was abandoned
    new = _save_simple(tmp_path, 2, attempt_id="crash", keep_last=5)
    assert verify_checkpoint(new) == [] and find_latest_intact(task) == new
    assert sorted(p.name for p in task.iterdir() if p.is_dir()) == ["step_00000001", "step_00000002"]


# --------------------------------------------------------------------------------------------- retention


def test_retention_counts_only_intact(tmp_path):
    task = tmp_path / TASK
    for s in range(1, 6):
        _save_simple(tmp_path, s, float(s))
    _flip_byte(task / "step_00000005" / "shards" / "rank_00000.safetensors")  # newest is corrupt
    (task / "step_00000006" / "shards").mkdir(parents=True)  # interrupted, no manifest
    (task / "step_00000006" / "shards" / "rank_00000.safetensors").write_bytes(b"partial")
    (task / "step_00000003.tmp-old").mkdir()  # abandoned, older than newest intact
    (task / "step_00000009.tmp-live").mkdir()  # newer than newest intact: maybe still being written
    (task / "step_0004.backup").mkdir()  # not a checkpoint name

    result = apply_retention(task, keep_last=2)
    assert result.kept == ["step_00000004", "step_00000003"]
    assert sorted(result.deleted) == ["step_00000001", "step_00000002"]
    assert sorted(result.corrupt) == ["step_00000005", "step_00000006"]
    assert result.removed_tmp == ["step_00000003.tmp-old"]
    left = sorted(p.name for p in task.iterdir())
    assert left == [
        "step_00000003",
        "step_00000004",
        "step_00000005",
        "step_00000006",
        "step_00000009.tmp-live",
        "step_0004.backup",
    ]
    assert find_latest_intact(task) == task / "step_00000004"
    with pytest.raises(CheckpointError, match="keep_last"):
        apply_retention(task, keep_last=0)


# --------------------------------------------------------------------------------------------- multi-rank


def _two_rank_body(rank, world_size, root):
    import torch.distributed as dist

    install_guard(AllowAll())
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    rows = slice(4 * rank, 4 * rank + 4)
    torch.manual_seed(100 + rank)
    writer = CheckpointWriter(root, TASK, rank, world_size, barrier=dist.barrier, attempt_id="mp")
    step_dir = writer.save(
        7,
        {"param.w": full[rows], "param.bias": torch.ones(3)},
        capture_rng_state(),
        state={"sampler": {"epoch": 1}} if rank == 0 else None,
        meta={"model": {"hidden": 6}, "parallel": {"tensor_parallel_size": 2}},
        slices={"param.w": {"full_shape": [8, 6], "offsets": [4 * rank, 0]}},
    )
    dist.barrier()
    return {"dir": str(step_dir), "problems": verify_checkpoint(step_dir), "rand": torch.rand(3).tolist()}


def test_two_process_save_verifies(tmp_path):
    results = run_distributed(_two_rank_body, world_size=2, args=(str(tmp_path),), timeout=120)
    step_dir = Path(results[0]["dir"])
    assert results[1]["dir"] == str(step_dir) and step_dir.name == "step_00000007"
    assert results[0]["problems"] == [] and results[1]["problems"] == []
    m = read_manifest(step_dir)
    assert m["world_size"] == 2 and m["step"] == 7 and m["parallel"] == {"tensor_parallel_size": 2}
    assert set(m["files"]) == {
        "state.json",
        "shards/rank_00000.safetensors",
        "shards/rank_00001.safetensors",
        "rng/rank_00000.json",
        "rng/rank_00001.json",
    }
    full = torch.zeros(8, 6)
    for r in range(2):
        sl = m["tensors"][f"shards/rank_{r:05d}.safetensors"]["param.w"]
        t = load_shard(step_dir, r)["param.w"]
        o = sl["offsets"]
        full[o[0] : o[0] + t.shape[0], o[1] : o[1] + t.shape[1]] = t
    assert torch.equal(full, torch.arange(48, dtype=torch.float32).reshape(8, 6))
    for r in range(2):  # each rank's RNG file restores that rank's stream
        restore_rng_state(read_rng(step_dir, r))
        assert torch.rand(3).tolist() == results[r]["rand"]
    assert read_state(step_dir)["sampler"] == {"epoch": 1}
    assert not [p for p in (tmp_path / TASK).iterdir() if ".tmp-" in p.name]


# --------------------------------------------------------------------------------------------- CLI


def _cli():
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """test root"""

    register(app)
    return app


def test_cli_verify_and_list(tmp_path):
    good = _save_simple(tmp_path, 1)
    bad = _save_simple(tmp_path, 2)
    runner = CliRunner()
    r = runner.invoke(_cli(), ["checkpoint", "verify", str(good)])
    assert r.exit_code == 0 and "OK" in r.output
    _flip_byte(bad / "shards" / "rank_00000.safetensors")
    r = runner.invoke(_cli(), ["checkpoint", "verify", str(bad)])
    assert r.exit_code == 1 and "CORRUPT" in r.output and "sha256" in r.output
    r = runner.invoke(_cli(), ["checkpoint", "verify", "--json", str(bad)])
    assert r.exit_code == 1 and json.loads(r.output)["intact"] is False
    r = runner.invoke(_cli(), ["checkpoint", "verify", str(tmp_path / "nope")])
    assert r.exit_code == 2
    (tmp_path / TASK / "step_00000003.tmp-x").mkdir()
    r = runner.invoke(_cli(), ["checkpoint", "list", "--json", str(tmp_path)])
    assert r.exit_code == 0
    rows = {row["name"]: row["status"] for row in map(json.loads, r.output.splitlines())}
    assert rows == {"step_00000001": "intact", "step_00000002": "corrupt", "step_00000003.tmp-x": "incomplete"}
    r = runner.invoke(_cli(), ["checkpoint", "list", str(tmp_path / TASK)])
    assert r.exit_code == 0 and "corrupt" in r.output
