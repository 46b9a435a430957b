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
from kuangchao_core.perm.guard_api import AllowAll, install_guard

TASK = "attacked"


@pytest.fixture(autouse=True)
def _trusted():
    """These tests write checkpoints in-process, as the storage layer's own tests do (trusted: no token)."""
    previous = install_guard(AllowAll())
    yield
    install_guard(previous)


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
