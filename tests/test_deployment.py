"""Deployments (issue 5) and pretrain → fine-tune (issue 14 §7): a real Prefect server and process worker run the
``nightly-finetune`` deployment — ``configs/finetune-demo.yaml`` unchanged but for where it writes and its length —
on the model ``make demo`` registers.

Everything is a subprocess of the real CLI against the session's Prefect server (a real server process;
``prefect server start`` itself runs in ``tests/test_cluster.py``): ``prefect work-pool create``,
``prefect deploy --all`` from ``deployments/prefect.yaml``, ``prefect worker start`` and
``prefect deployment run … --watch``, which returns when the flow run reaches a final state.

The base is ``tests/data/kc-tiny-demo/``: the model ``make demo`` exported (``configs/tiny.yaml``, 3000 steps, 99.2 %
exact match on held-out sums), shipped so the suite does not spend minutes pretraining it (how to regenerate it:
``tests/data/README.md``). The test registers it in its MLflow store as ``kc-tiny-demo`` (what ``make demo`` does)
with its held-out exact match, so it is the champion; the run resolves ``models:/kc-tiny-demo@champion`` to that
version, two Gloo workers train LoRA adapters on the subtraction instructions, evaluating before the first step and
every ``eval_interval`` steps, and the PEFT adapters are exported and registered as ``kc-finetune-demo``. The run is
the recipe's first 100 steps, evaluated after them (the held-out loss must fall; before its first step the base scores 0 on
exact match: it does not subtract); the whole recipe's ≥ 80 % exact match is asserted where the README's fine-tune
runs it to the end, on the model the README's own ``make demo`` trained (``tests/test_readme.py``).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kuangchao_core.config import load_config
from kuangchao_core.obs.model_registry import log_model_dir, register_model

ROOT = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).with_name("prefect"))
BASE = ROOT / "tests" / "data" / "kc-tiny-demo"
FINETUNE = ROOT / "configs" / "finetune-demo.yaml"
STEPS = 100  # the run: the recipe evaluated before its first step and after 100 (its held-out loss has fallen by then)


def _register_base(tmp: Path, uri: str) -> None:
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), [f"tracking.uri={uri}"])
    shutil.copytree(BASE, tmp / "base")
    record = json.loads((tmp / "base" / "export.json").read_text(encoding="utf-8"))
    client = MlflowClient(uri)
    exp_id = client.create_experiment("kc-tiny-demo", artifact_location=(tmp / "artifacts").as_uri())
    run_id = client.create_run(exp_id, tags={"mlflow.runName": "pretrained-base"}).info.run_id
    client.log_metric(run_id, "heldout_accuracy", 0.992, step=record["step"])  # the demo's (tests/data/README.md)
    source = log_model_dir(cfg, run_id, tmp / "base", record)
    assert "champion" in register_model(cfg, run_id, "kc-tiny-demo", source, record, None)["aliases"]
    client.set_terminated(run_id)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _cli(args: list[str], env: dict, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [PREFECT, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nightly_finetune_deployment_fine_tunes_the_registered_demo_model(prefect_api, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _register_base(tmp_path, uri)
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "KC_PROJECT_DIR": str(ROOT),
        "KC_RUNS_DIR": str(tmp_path / "runs"),
        "OMP_NUM_THREADS": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1",  # pick the run up at once instead of on the next 10 s poll
    }
    env.pop("PREFECT_PROFILES_PATH", None)
    worker = None
    try:
        _cli(["work-pool", "create", "kuangchao-process", "--type", "process"], env, 120)
        deployed = _cli(["--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"], env, 180)
        assert "on-demand" in deployed.stdout and "nightly-finetune" in deployed.stdout
        worker = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", "kuangchao-process", "--limit", "1"],
            env=env,
            cwd=tmp_path,
            stdout=open(tmp_path / "worker.log", "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        overrides = [
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"tracking.uri={uri}",
            f"permission.audit_log={tmp_path / 'audit'}",
            "tracking.system_metrics=false",
            f"train.steps={STEPS}",
            f"train.eval_interval={STEPS}",
        ]
        run = _cli(
            [
                "deployment",
                "run",
                "kuangchao-train/nightly-finetune",
                "--param",
                f"overrides={json.dumps(overrides)}",
                "--watch",
                "--watch-interval",
                "2",
                "--watch-timeout",
                "500",
            ],
            env,
            530,
        )
        assert "Completed" in run.stdout, run.stdout[-3000:]
    finally:
        if worker is not None:
            _stop(worker)
    cfg = load_config(str(FINETUNE))
    steps = every = STEPS
    assert glob.glob(str(tmp_path / "ckpt" / cfg.task.name / "run-*" / f"step_{steps:08d}" / "manifest.json"))
    client = MlflowClient(uri)
    version = client.get_model_version_by_alias("kc-finetune-demo", "newest")
    assert version.tags["kuangchao.format"] == "peft"
    run_ = client.get_run(version.run_id)
    assert run_.data.tags["kuangchao.base_model"] == "kc-tiny-demo v1"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_.info.run_id, "eval_exact_match"))
    assert [s for s, _ in history] == list(range(0, steps + 1, every)), history  # before the first step, then each
    before, after = history[0][1], history[-1][1]
    losses = sorted((m.step, m.value) for m in client.get_metric_history(run_.info.run_id, "eval_loss"))
    print(f"nightly fine-tune, {steps} steps: held-out exact match {before:.3f} -> {after:.3f}, loss {losses}")
    assert before <= 0.02, history  # the addition model does not subtract
    assert [s for s, _ in losses] == [0, steps] and losses[-1][1] < losses[0][1], losses  # it learns
    assert run_.data.metrics["heldout_accuracy"] == pytest.approx(after)
    samples = {a.path for a in client.list_artifacts(run_.info.run_id, "samples")}
    assert {"samples/step_00000000.txt", f"samples/step_{steps:08d}.txt", "samples/final.txt"} <= samples
    files = {a.path for a in client.list_artifacts(run_.info.run_id, "model")}
    assert {"model/adapter_model.safetensors", "model/adapter_config.json", "model/tokenizer.json"} <= files
