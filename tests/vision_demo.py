"""Run ``configs/vision-demo.yaml`` in test processes (Gloo, CPU) with its data and output under a directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "configs" / "vision-demo.yaml"


def demo_config(work: Path, shapes: Path, **overrides: Any):
    """The demo's config with its data under ``shapes`` and its checkpoints and MLflow under ``work``;
    ``overrides``: ``section.key`` -> value."""
    from kuangchao_core.config import load_config

    sets = {
        "data.path": str(shapes / "train.jsonl"),
        "data.eval_path": str(shapes / "heldout.jsonl"),
        "checkpoint.dir": str(work / "ckpt"),
        "checkpoint.resume": "never",
        "tracking.uri": f"sqlite:///{work}/mlflow.db",
        **overrides,
    }
    return load_config(str(DEMO), overrides=[f"{k}={v}" for k, v in sets.items()])


def run_demo(rank: int, world_size: int, cfg, tracking: str | None = None, artifacts: str | None = None):
    """Train the demo in this process (one rank of a Gloo group): the held-out loss and exact match before and
    after, the losses, the data-wait summary (``DataWait.summary`` with the steps' times) and, with ``tracking`` (an
    MLflow URI; ``artifacts`` its artifact root), rank 0's MLflow run id with metrics and samples logged there."""
    from tests.engine_helpers import trainer_in_process

    trainer = trainer_in_process(cfg, rank, world_size)
    before = (trainer.evaluator(), trainer.samples()[0])  # collective: every rank
    sink = run_id = None
    if tracking is not None and rank == 0:
        from mlflow.tracking import MlflowClient

        from kuangchao_core.obs.mlflow_sink import MlflowMetricSink

        client = MlflowClient(tracking_uri=tracking)
        run_id = client.create_run(client.create_experiment("vision-demo", artifact_location=artifacts)).info.run_id
        sink = MlflowMetricSink(tracking, run_id, task=cfg.task.name)
    try:
        state = trainer.run(resume="never", metric_sink=sink)
    finally:
        if sink is not None:
            sink.close()
    after = (trainer.evaluator(), trainer.samples()[0])
    wait = trainer.data_wait.summary(trainer.step_seconds)
    return {"losses": list(state.losses), "before": before, "after": after, "wait": wait, "run_id": run_id}
