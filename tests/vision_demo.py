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
