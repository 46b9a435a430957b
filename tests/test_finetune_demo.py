"""Pretrain → fine-tune (issue 14 §7): ``configs/finetune-demo.yaml`` runs through the real flow on the model the demo
registered.

A base is pretrained here on the demo's corpus (``configs/tiny.yaml``, a few steps: this test checks the pipeline, not
the accuracy the config reaches), exported with its tokenizer and registered in the test's MLflow store as
``kc-tiny-demo`` (what ``make demo`` does). The flow then runs ``configs/finetune-demo.yaml`` unchanged but for where
it writes and how many steps: ``models:/kc-tiny-demo@newest`` resolves to that version, two Gloo workers train LoRA
adapters on the subtraction instructions, the run evaluates before its first step (``eval_exact_match`` and the
sample answers at step 0) and at the end, exports the PEFT adapters and registers them as ``kc-finetune-demo``.
"""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from kuangchao_core.config import load_config
from kuangchao_core.obs.model_registry import log_model_dir, register_model
from kuangchao_core.perm import guard_api
from tests.conftest_prefect import ROOT, run_flow
from tests.engine_helpers import only_lineage, run_trainers
from tests.mp import run_distributed

BASE_STEPS = 20
FT_STEPS = 8


def _pretrain_base(tmp, uri: str) -> None:
    from kuangchao_core.engine.release import export_model

    cfg = load_config(
        str(ROOT / "configs" / "tiny.yaml"),
        [
            f"train.steps={BASE_STEPS}",
            "parallel.data_parallel_size=1",
            "cluster.nproc_per_node=1",
            "permission.mode=trusted",
            f"checkpoint.dir={tmp / 'ckpt'}",
            f"checkpoint.interval={BASE_STEPS}",
            f"tracking.uri={uri}",
        ],
    )
    run_distributed(run_trainers, 1, args=([{"cfg": cfg}],), timeout=300)
    step = only_lineage(tmp / "ckpt" / cfg.task.name) / f"step_{BASE_STEPS:08d}"
    previous = guard_api.install_guard(guard_api.AllowAll())
    try:
        record = export_model(step, tmp / "base", "byte", 128)
    finally:
        guard_api.install_guard(previous)
    client = MlflowClient(uri)
    exp_id = client.create_experiment("kc-tiny-demo")
    run_id = client.create_run(exp_id, tags={"mlflow.runName": "pretrained-base"}).info.run_id
    source = log_model_dir(cfg, run_id, tmp / "base", record)
    register_model(cfg, run_id, "kc-tiny-demo", source, record, None)
    client.set_terminated(run_id)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_finetune_demo_config_runs_on_the_registered_demo_model(prefect_api, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _pretrain_base(tmp_path, uri)
    summary = run_flow(
        tmp_path,
        [
            f"train.steps={FT_STEPS}",
            f"train.eval_interval={FT_STEPS}",
            f"checkpoint.interval={FT_STEPS}",
            f"checkpoint.dir={tmp_path / 'ft-ckpt'}",
            f"tracking.uri={uri}",
            f"permission.audit_log={tmp_path / 'audit'}",
            "tracking.system_metrics=false",
        ],
        config_path=str(ROOT / "configs" / "finetune-demo.yaml"),
    )
    assert summary["steps"] == FT_STEPS and summary["attempts"] == 1
    client = MlflowClient(uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["kuangchao.base_model"] == "kc-tiny-demo v1"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_exact_match"))
    assert [s for s, _ in history] == [0, FT_STEPS], history  # before the first step, and at the end
    assert history[0][1] <= 0.05  # a 20-step addition model does not subtract
    assert summary["heldout_accuracy"] is not None
    samples = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert {"samples/step_00000000.txt", f"samples/step_{FT_STEPS:08d}.txt", "samples/final.txt"} <= samples
    version = client.get_model_version_by_alias("kc-finetune-demo", "newest")
    assert version.tags["kuangchao.format"] == "peft" and version.run_id == run.info.run_id
    files = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert {"model/adapter_model.safetensors", "model/adapter_config.json", "model/tokenizer.json"} <= files
