"""Malformed checkpoints (issue 16 item 4, part): a manifest naming files outside its step, an absurd world size,
or a symbolic link in the step make that step "not intact" — never an exception — so the newest intact step is
used instead, retention leaves the bad one alone, and ``kc checkpoint verify`` exits 1 listing the problem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.ckpt.integrity import find_latest_intact, verify_checkpoint
from kuangchao_core.ckpt.retention import apply_retention
from kuangchao_core.ckpt.rng import capture_rng_state
from kuangchao_core.ckpt.writer import CheckpointWriter

TASK = "attacked"


pytestmark = pytest.mark.usefixtures("trusted")


def _save(root: Path, step: int) -> Path:
    writer = CheckpointWriter(root, TASK, 0, 1, barrier=lambda: None)
    return writer.save(
        step,
        {"param.w": torch.full((4, 4), float(step))},
        capture_rng_state(),
        state={},
        meta={"model": {}, "parallel": {}},
    )


def _rewrite_manifest(step_dir: Path, change) -> None:
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _escape(m):
    m["files"]["../../../../etc/hostname"] = {"sha256": "0" * 64, "size": 1}


def _absolute(m):
    m["files"]["/etc/hostname"] = {"sha256": "0" * 64, "size": 1}


def _world(m):
    m["world_size"] = 10**9


@pytest.mark.parametrize(
    ("attack", "needle"), [(_escape, "outside the step"), (_absolute, "outside the step"), (_world, "world_size")]
)
def test_a_malformed_manifest_makes_its_step_not_intact_and_the_previous_one_is_used(tmp_path, attack, needle):
    good = _save(tmp_path, 2)
    bad = _save(tmp_path, 4)
    assert verify_checkpoint(bad) == []  # the control: intact before the attack
    _rewrite_manifest(bad, attack)
    problems = verify_checkpoint(bad)
    assert problems and any(needle in p for p in problems), problems
    assert find_latest_intact(bad.parent) == good
    apply_retention(bad.parent, keep_last=1)  # does not raise; the corrupt step is never counted nor deleted
    assert bad.exists() and good.exists()
    out = CliRunner().invoke(app, ["checkpoint", "verify", str(bad)])
    assert (
        out.exit_code == 1 and needle in out.output and out.exception is None or isinstance(out.exception, SystemExit)
    )


def test_a_symbolic_link_in_a_step_is_refused_not_followed(tmp_path):
    good = _save(tmp_path, 2)
    bad = _save(tmp_path, 4)
    private = tmp_path / "private.key"
    private.write_text("-----BEGIN PRIVATE KEY-----")
    os.symlink(private, bad / "shards" / "extra.safetensors")
    problems = verify_checkpoint(bad)
    assert any("symbolic link" in p for p in problems), problems
    assert find_latest_intact(bad.parent) == good
    # a step directory that is itself a link to another step
    os.symlink(good, bad.parent / "step_00000006")
    assert any("symbolic link" in p for p in verify_checkpoint(bad.parent / "step_00000006"))


def _tamper_int8(step_dir: Path) -> str:
    """Re-save rank 0's shard with one parameter as int8 (same shape) and fix the manifest's sha256, size and tensor
    table, as a buggy converter or an attacker with the manifest would: the step still verifies, and only loading
    it finds the fault (an unfixed tensor table is caught by verification: tests/test_ckpt_tensor_table.py)."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import save_file

    shard = next((step_dir / "shards").glob("rank_*.safetensors"))
    rel = f"shards/{shard.name}"
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    name = next(k for k in sorted(tensors) if k.startswith("param.") and tensors[k].dim() == 2)
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, str(shard), metadata=meta)
    data = shard.read_bytes()

    def fix(m):
        m["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        m["tensor_table"][rel][name]["dtype"] = "I8"

    _rewrite_manifest(step_dir, fix)
    return name


def _job(tmp: str, layers: int = 2):
    from tests.engine_helpers import tiny_job

    return tiny_job(
        tmp,
        task={"name": "t", "seed": 7},
        model={"preset": "tiny", "num_layers": layers},
        train={"steps": 4, "warmup_steps": 1, "device": "cpu", "log_interval": 100},
        checkpoint={"dir": f"{tmp}/ckpt", "interval": 2, "keep_last": 5, "resume": "never"},
    )


def _train_tamper_retry(rank: int, world: int, tmp: str) -> dict:
    """One process: train 4 steps, tamper the newest step, resume (fails, marks it bad), resume again."""
    from tests.engine_helpers import only_lineage, run_trainers

    first = run_trainers(rank, world, [{"cfg": _job(tmp)}])[0]
    lineage = only_lineage(Path(tmp) / "ckpt" / "t")
    newest = lineage / "step_00000004"
    tampered = _tamper_int8(newest)
    out = {"first": first["losses"], "tampered": tampered, "verified_after_tamper": verify_checkpoint(newest)}
    try:
        run_trainers(rank, world, [{"cfg": _job(tmp), "resume": "auto", "lineage": lineage.name}])
        out["failed"] = None
    except Exception as exc:  # noqa: BLE001 - the failure is what the test looks at
        out["failed"] = str(exc)
    out["verified_after_failure"] = verify_checkpoint(newest)
    again = run_trainers(rank, world, [{"cfg": _job(tmp), "resume": "auto", "lineage": lineage.name}])[0]
    out.update(again_losses=again["losses"], again_steps=again["steps_run"], previous=str(lineage / "step_00000002"))
    return out


def test_an_unloadable_newest_checkpoint_is_marked_bad_and_the_next_attempt_resumes_from_the_previous(tmp_path):
    from tests.mp import run_distributed

    r = run_distributed(_train_tamper_retry, 1, args=(str(tmp_path),), timeout=180)[0]
    assert r["verified_after_tamper"] == []  # the attack: the tampered step still verifies
    assert r["failed"] and "marked bad" in r["failed"] and "floating point" in r["failed"]
    assert r["tampered"].removeprefix("param.") in r["failed"]
    assert any("marked bad" in p for p in r["verified_after_failure"])
    # the next attempt (same pinned lineage) resumed from step 2 and trained steps 3-4 exactly as the first run did
    assert r["again_steps"] == 2 and r["again_losses"][-2:] == r["first"][-2:]
    # another model's job is refused naming both shapes (the flow before launch, the worker before loading),
    # without marking the checkpoint: the job is wrong, not the step
    from kuangchao_core.ckpt.integrity import read_manifest
    from kuangchao_core.engine.checkpointing import model_mismatch
    from kuangchao_core.models.llama import config_from_model_section

    previous = Path(r["previous"])
    manifest = read_manifest(previous)
    assert "num_layers 2 vs 3" in model_mismatch(manifest, config_from_model_section(_job(str(tmp_path), 3).model))
    assert model_mismatch(manifest, config_from_model_section(_job(str(tmp_path)).model)) is None
    assert not (previous / "BAD.json").exists()
    # `kc debug checkpoint` says the same: usable with the job's config, refused for another model's, and the
    # marked step names why (OPS.4)
    from typer.testing import CliRunner

    from kuangchao.cli.main import app

    run = CliRunner()
    for layers, name in ((2, "job.yaml"), (3, "other.yaml")):
        (tmp_path / name).write_text(_job(str(tmp_path), layers).to_yaml(), encoding="utf-8")
    res = run.invoke(app, ["debug", "checkpoint", str(previous), "--config", str(tmp_path / "job.yaml")])
    assert res.exit_code == 0 and "usable" in res.output and "step               2" in res.output, res.output
    res = run.invoke(app, ["debug", "checkpoint", str(previous), "--config", str(tmp_path / "other.yaml")])
    assert res.exit_code == 1 and "num_layers 2 vs 3" in res.output
    [marked] = [p.parent for p in previous.parent.glob("step_00000004*/BAD.json")]  # moved aside by the rerun
    res = run.invoke(app, ["debug", "checkpoint", str(marked)])
    assert res.exit_code == 1 and "marked bad" in res.output, res.output
