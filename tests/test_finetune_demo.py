"""Pretrain → fine-tune (issue 14 §7): ``configs/finetune-demo.yaml``, unchanged but for where it writes, runs through
the real flow on the model ``make demo`` registers, and raises the held-out exact match on subtraction from 0 to
≥ 80 %.

The base is ``tests/data/kc-tiny-demo/``: the model ``make demo`` exported (``configs/tiny.yaml``, 3500 steps, 91 %
exact match on held-out sums), shipped so this test does not spend three minutes pretraining it; regenerate it with
``make demo`` and copy ``runs/kc-tiny-demo/<run>/model/`` there. The test registers it in its MLflow store as
``kc-tiny-demo`` (what ``make demo`` does); ``models:/kc-tiny-demo@newest`` resolves to that version, two Gloo workers
train LoRA adapters on the subtraction instructions for the config's 2000 steps, the run evaluates before its first
step and every 500 steps, exports the PEFT adapters and registers them as ``kc-finetune-demo``.

The threshold is the issue's (≥ 0.8 of 256 held-out problems); the accuracy the recipe reaches was measured on this
base with four seeds at one process (0.94, 1.00, 1.00, 0.99 after 2000 steps), so 0.8 holds with a wide margin, and the
same run before its first step scores 0 (the control: the base does not subtract).
"""

from __future__ import annotations

import json
import shutil

import pytest
from mlflow.tracking import MlflowClient

from kuangchao_core.config import load_config
from kuangchao_core.obs.model_registry import log_model_dir, register_model
from tests.conftest_prefect import ROOT, run_flow

BASE = ROOT / "tests" / "data" / "kc-tiny-demo"


def _register_base(tmp, uri: str) -> None:
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), [f"tracking.uri={uri}"])
    shutil.copytree(BASE, tmp / "base")
    record = json.loads((tmp / "base" / "export.json").read_text(encoding="utf-8"))
    client = MlflowClient(uri)
    exp_id = client.create_experiment("kc-tiny-demo")
    run_id = client.create_run(exp_id, tags={"mlflow.runName": "pretrained-base"}).info.run_id
    source = log_model_dir(cfg, run_id, tmp / "base", record)
    register_model(cfg, run_id, "kc-tiny-demo", source, record, None)
    client.set_terminated(run_id)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_finetune_demo_config_learns_subtraction_on_the_registered_demo_model(prefect_api, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _register_base(tmp_path, uri)
    cfg = load_config(str(ROOT / "configs" / "finetune-demo.yaml"))
    steps, every = cfg.train.steps, cfg.train.eval_interval
    summary = run_flow(
        tmp_path,
        [
            f"checkpoint.dir={tmp_path / 'ft-ckpt'}",
            f"tracking.uri={uri}",
            f"permission.audit_log={tmp_path / 'audit'}",
            "tracking.system_metrics=false",
        ],
        config_path=str(ROOT / "configs" / "finetune-demo.yaml"),
    )
    assert summary["steps"] == steps and summary["attempts"] == 1
    client = MlflowClient(uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["kuangchao.base_model"] == "kc-tiny-demo v1"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_exact_match"))
    assert [s for s, _ in history] == list(range(0, steps + 1, every)), history  # before the first step, then each
    before, after = history[0][1], history[-1][1]
    print(f"fine-tune demo: held-out exact match {before:.3f} -> {after:.3f} ({history})")
    assert before <= 0.02, history  # the addition model does not subtract
    assert after >= 0.8, history
    assert summary["heldout_accuracy"] == pytest.approx(after)
    samples = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert {"samples/step_00000000.txt", f"samples/step_{steps:08d}.txt", "samples/final.txt"} <= samples
    version = client.get_model_version_by_alias("kc-finetune-demo", "newest")
    assert version.tags["kuangchao.format"] == "peft" and version.run_id == run.info.run_id
    files = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert {"model/adapter_model.safetensors", "model/adapter_config.json", "model/tokenizer.json"} <= files
