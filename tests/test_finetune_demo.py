"""Pretrain → fine-tune (issue 14 §7): ``configs/finetune-demo.yaml`` takes the demo's registered model from its
starting exact match on subtraction (a task it never saw) to at least 80 %, through the real flow.

The base is pretrained here on the demo's own corpus (``configs/tiny.yaml``, shortened: the test does not spend the
demo's whole budget), exported with its tokenizer and registered in the test's MLflow store as ``kc-tiny-demo``
(what ``make demo`` does). The flow then runs ``configs/finetune-demo.yaml`` unchanged but for where it writes:
``models:/kc-tiny-demo@newest`` resolves to that version, two Gloo workers train LoRA adapters, the run evaluates
before its first step and at the end, exports the PEFT adapters and registers them as ``kc-finetune-demo``.
"""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from kuangchao_core.config import load_config
from kuangchao_core.obs.model_registry import log_model_dir, register_model
from kuangchao_core.perm import guard_api
from tests.conftest_prefect import ROOT, run_flow, session_store  # noqa: F401
from tests.engine_helpers import only_lineage, run_trainers
from tests.mp import run_distributed

BASE_STEPS = 1500


def _pretrain_base(tmp, uri: str) -> None:
    from kuangchao_core.ckpt.release import export_model

    cfg = load_config(
        str(ROOT / "configs" / "tiny.yaml"),
        [
            f"train.steps={BASE_STEPS}",
            "parallel.data_parallel_size=1",
            "parallel.micro_batch_size=8",  # the demo's global batch (2 ranks x 4) on one rank
            "permission.mode=trusted",
            f"checkpoint.dir={tmp / 'ckpt'}",
            f"checkpoint.interval={BASE_STEPS}",
            f"tracking.uri={uri}",
            "train.eval_interval=100000",
        ],
    )
    run_distributed(run_trainers, 1, args=([{"cfg": cfg}],), timeout=400)
    step = only_lineage(tmp / "ckpt" / cfg.task.name) / f"step_{BASE_STEPS:08d}"
    previous = guard_api.install_guard(guard_api.AllowAll())
    try:
        record = export_model(step, tmp / "base", "byte", 128)
    finally:
        guard_api.install_guard(previous)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("kc-tiny-demo") or client.create_experiment("kc-tiny-demo")
    exp_id = exp if isinstance(exp, str) else exp.experiment_id
    run_id = client.create_run(exp_id, tags={"mlflow.runName": "pretrained-base"}).info.run_id
    source = log_model_dir(cfg, run_id, tmp / "base", record)
    register_model(cfg, run_id, "kc-tiny-demo", source, record, None)
    client.set_terminated(run_id)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_finetune_demo_config_raises_subtraction_exact_match_to_80_percent(prefect_api, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _pretrain_base(tmp_path, uri)
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
    client = MlflowClient(uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["kuangchao.base_model"] == "kc-tiny-demo v1"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_exact_match"))
    before, after = history[0], history[-1]
    assert before[0] == 0 and before[1] <= 0.05, history  # the addition model does not subtract
    assert after[0] == summary["steps"] and after[1] >= 0.8, history
    assert summary["heldout_accuracy"] >= 0.8
    version = client.get_model_version_by_alias("kc-finetune-demo", "newest")
    assert version.tags["kuangchao.format"] == "peft" and version.run_id == run.info.run_id
    samples = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert "samples/step_00000000.txt" in samples and "samples/final.txt" in samples
