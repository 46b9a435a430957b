"""`kc debug gradient` (issue 13, OPS.4): replicas of a real dp2 Gloo job are compared at a step. On one replica a
parameter drifts after step 1 and, at the snapshot step, one reduced gradient is off (as a broken reduction would
leave it): exactly those two tensors are named (the drifted parameter's reduced gradients still agree); an
untouched job's replicas agree (the control); a comparison that looked at parameters only fails the check (the
negative control); `--config` runs the job itself through the launcher, tokens included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kuangchao.cli.main import app
from tests.engine_helpers import tiny_job
from tests.mp import run_distributed

ROOT = Path(__file__).resolve().parent.parent
RUN = CliRunner()
TARGET = "model.layers.1.mlp.up_proj.weight"
GRAD_TARGET = "model.layers.0.self_attn.q_proj.weight"


def _snapshot(rank, world_size, cfg, perturb):
    import torch

    from kuangchao_core.comm import init_distributed, world_group
    from kuangchao_core.config.settings import run_settings
    from kuangchao_core.engine.trainer import Trainer
    from kuangchao_core.parallel.mesh import ParallelMesh
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    init_distributed(backend="gloo", timeout_ms=60_000)
    mesh = ParallelMesh.from_config(cfg.parallel, rank, world_size)
    trainer = Trainer(run_settings(cfg), rank, world_size, torch.device("cpu"), world_group(), mesh)
    step = trainer.train_step

    def drifting(batches):
        result = step(batches)
        params = dict(trainer.model.named_parameters())
        if perturb and rank == 1 and result.step == 1:  # a replica that drifted: one weight off by 1e-3
            with torch.no_grad():
                params[TARGET].add_(1e-3)
        if perturb and rank == 1 and result.step == 2:  # a reduced gradient off on one replica, before the snapshot
            with torch.no_grad():
                params[GRAD_TARGET].grad[0, 0] += 1e-3
        return result

    trainer.train_step = drifting
    trainer.run(resume="never")
    return True


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory) -> dict[bool, Path]:
    """perturbed? -> the run directory whose two ranks wrote their step-2 snapshots."""
    out = {}
    for perturb in (True, False):
        run_dir = tmp_path_factory.mktemp(f"run-{perturb}")
        cfg = tiny_job(str(run_dir), task={"name": "g"}, parallel={"data_parallel_size": 2}, train={"steps": 2})
        env = {"KC_RUN_DIR": str(run_dir), "KC_GRAD_SNAPSHOT_STEP": "2"}
        assert run_distributed(_snapshot, 2, args=(cfg, perturb), timeout=180, env=env) == [True, True]
        out[perturb] = run_dir
    return out


def _assert_names_the_drifted_parameter_and_gradient(run_dir: Path) -> None:
    res = RUN.invoke(app, ["debug", "gradient", str(run_dir), "--json"])
    report = json.loads(res.output)
    assert res.exit_code == 1, report
    # only these two: the drifted parameter's reduced gradients still agree between the replicas
    assert {d["tensor"] for d in report["differences"]} == {f"param.{TARGET}", f"grad.{GRAD_TARGET}"}, report


def test_a_drifted_parameter_and_a_wrong_reduced_gradient_are_named_and_untouched_replicas_agree(snapshots):
    _assert_names_the_drifted_parameter_and_gradient(snapshots[True])
    res = RUN.invoke(app, ["debug", "gradient", str(snapshots[False]), "--json"])
    report = json.loads(res.output)
    assert res.exit_code == 0 and report["differences"] == [], report


def test_negative_control_a_comparison_of_parameters_only_fails_the_check(snapshots, monkeypatch):
    """Sabotage: `kc debug gradient` compares the parameters but not the gradients."""
    from kuangchao_core.engine import grad_snapshot

    real = grad_snapshot.replica_differences
    monkeypatch.setattr(
        grad_snapshot,
        "replica_differences",
        lambda snaps: [d for d in real(snaps) if not d["tensor"].startswith("grad.")],
    )
    with pytest.raises(AssertionError):
        _assert_names_the_drifted_parameter_and_gradient(snapshots[True])


def test_kc_debug_gradient_runs_the_job_to_the_step_and_compares(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KC_RUNS_DIR": str(tmp_path / "runs"), "PYTHONPATH": str(ROOT)}
    sets = ["--set", "data.synthetic.num_train=256", "--set", f"permission.audit_log={tmp_path / 'audit'}"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kuangchao.cli.main",
            "debug",
            "gradient",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            "--step",
            "2",
            *sets,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "2 ranks at step [2]" in out.stdout and "replicas agree" in out.stdout
