"""``configs/vision-demo.yaml`` (issue 31's demo) as a user meets it, a short version for ``make test``.

The README's commands, run as typed in a fresh directory (the config's relative data, checkpoint and MLflow paths
land there): ``kc data shapes data/shapes`` (32 images of 16 px, 8 held out) and ``kc train --config
configs/vision-demo.yaml`` (on the session's Prefect server) with a few ``--set`` that make it short — 60 steps of 8
rows at 16 px, decoder tp2 with the encoder data-parallel, as the demo — then ``kc plan`` of the demo and ``kc
checkpoint convert --format hf`` of the run's last step (these two in this process). Checked from what the user sees:
the run's log (the final ``data wait`` line: under 5 % of the step time, the issue's bound; the held-out loss at the
end), MLflow (the loss of step 1, ``eval_exact_match``, the greedy answers' text and their images, equal to the
held-out image files) and the converted directory (a transformers LLaVA). The held-out loss must fall below three
quarters of the untrained model's loss (step 1's, before any update: ~ln of the byte vocabulary, 5.5; the answers' letters are learnt within tens of
steps): a run that stopped learning fails it. A learning-trend check, not an equality: the layouts' equality with one
process and its negative controls are tests/test_vlm_engine.py's. The full demo (>= 90 % held-out exact match, in
minutes) is ``python -m tests.vision_demo_full``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
KC = [sys.executable, "-m", "kuangchao.cli.main"]
SHORT = {
    "train.steps": 60,
    "train.eval_interval": 60,
    "train.warmup_steps": 5,
    "train.log_interval": 20,
    "checkpoint.interval": 1000,
    "parallel.micro_batch_size": 8,
    "model.vision.image_size": 16,
    "data.seq_len": 64,
    "tracking.system_metrics": "false",
}


def _kc(argv: list[str], cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    out = subprocess.run([*KC, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (argv, out.stdout[-3000:], out.stderr[-3000:])
    return out


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, prefect_api):
    work = tmp_path_factory.mktemp("vision_demo")
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "KC_RUNS_DIR": str(work / "runs"), "OMP_NUM_THREADS": "1"}
    made = _kc(
        ["data", "shapes", "data/shapes", "--size", "16", "--train", "32", "--heldout", "8", "--seed", "3"],
        work,
        env,
        120,
    )
    sets = [a for k, v in SHORT.items() for a in ("--set", f"{k}={v}")]
    demo = str(ROOT / "configs" / "vision-demo.yaml")
    trained = _kc(["train", "--config", demo, *sets], work, env, 400)
    (summary,) = [json.loads(p.read_text()) for p in (work / "runs").glob("kc-vision-demo/*/summary.json")]
    log = Path(summary["run_dir"], "logs", "worker-0.jsonl").read_text(encoding="utf-8")
    events = [json.loads(line) for line in log.splitlines() if line.strip()]
    print(trained.stdout.splitlines()[-1])  # the start-up and shutdown phases, for --durations readers
    return {"work": work, "made": made.stdout, "console": trained.stdout, "summary": summary, "log": events}


def test_short_demo_learns_and_never_waits_for_data(short_run):
    from mlflow.tracking import MlflowClient

    assert "OK data/shapes: 32 training images (128 records)" in short_run["made"]
    log, summary = short_run["log"], short_run["summary"]
    assert summary["trained_steps"] == SHORT["train.steps"] and summary["layout"] == "dp1-tp2-pp1-zero0"
    wait = [e for e in log if e["msg"] == "data wait"][-1]
    assert wait["steps"] == SHORT["train.steps"] - 1  # the first step, filling the decode pool, is left out
    assert wait["share"] < 0.05, wait
    (held_out,) = [e for e in log if e["msg"] == "eval_loss"]
    assert held_out["step"] == SHORT["train.steps"]
    assert f"held-out loss {held_out['eval_loss']:.4f} at step {SHORT['train.steps']}" in short_run["console"]
    client = MlflowClient(f"sqlite:///{short_run['work'] / 'mlflow.db'}")
    first = [m.value for m in client.get_metric_history(summary["mlflow_run_id"], "loss") if m.step == 1]
    assert len(first) == 1 and held_out["eval_loss"] < 0.75 * first[0], (first, held_out)


def test_short_demo_logs_greedy_answers_with_their_images_to_mlflow(short_run):
    from mlflow.tracking import MlflowClient
    from PIL import Image

    work, summary = short_run["work"], short_run["summary"]
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    run_id = summary["mlflow_run_id"]
    assert 0.0 <= client.get_run(run_id).data.metrics["eval_exact_match"] <= 1.0
    step = f"step_{SHORT['train.steps']:08d}"
    files = {Path(f.path).name for f in client.list_artifacts(run_id, "samples")}
    assert f"{step}.txt" in files, files
    text = Path(client.download_artifacts(run_id, f"samples/{step}.txt", str(work / "got"))).read_text()
    records = [json.loads(line) for line in (work / "data/shapes/heldout.jsonl").read_text().splitlines()]
    answer = records[0]["conversations"][-1]["value"] + "\n"  # the answer and its end token, as the text shows it
    assert text.count(" -> ") >= 1 and f"(expected {answer!r})" in text, text
    pngs = sorted(f for f in files if f.startswith(f"{step}_row") and f.endswith(".png"))
    assert pngs, files
    for name in pngs:  # each shown answer's image is its question's image, as the gate decoded it (16 px: as drawn)
        row = int(name.removesuffix(".png").rsplit("_row", 1)[1])
        got = np.asarray(Image.open(client.download_artifacts(run_id, f"samples/{name}", str(work / "got"))))
        own = np.asarray(Image.open(work / "data/shapes" / records[row]["image"]).convert("RGB"))
        other = np.asarray(Image.open(work / "data/shapes" / records[-1]["image"]).convert("RGB"))
        assert np.array_equal(got, own), name
        assert not np.array_equal(got, other), name  # control: the check tells two images apart


def test_the_demo_plans_and_its_checkpoint_converts_to_a_transformers_llava(short_run):
    """``kc plan`` and ``kc checkpoint convert`` in this process (the same commands, without a second start-up)."""
    import glob

    from typer.testing import CliRunner

    from kuangchao.cli.main import app

    work, summary = short_run["work"], short_run["summary"]
    demo = str(ROOT / "configs" / "vision-demo.yaml")
    plan = CliRunner().invoke(app, ["plan", "--config", demo])
    assert plan.exit_code == 0, plan.output
    assert "vision encoder (data parallel)" in plan.output and "16 images per rank per micro-batch" in plan.output
    # the README's $(ls -d checkpoints/kc-vision-demo/run-*/step_* | tail -1): the run's last step
    step = sorted(glob.glob(str(work / "checkpoints/kc-vision-demo/run-*/step_*")))[-1]
    assert step == summary["checkpoint_path"] and step.endswith(f"step_{SHORT['train.steps']:08d}")
    out = work / "llava"
    converted = CliRunner().invoke(app, ["checkpoint", "convert", step, str(out), "--format", "hf"])
    assert converted.exit_code == 0, converted.output
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"], config
    assert config["vision_config"]["image_size"] == 16 and (out / "model.safetensors").is_file()
    exported = json.loads(Path(summary["model_dir"], "config.json").read_text())  # kc train's own export at the end
    assert exported["architectures"] == config["architectures"], exported
    # logged as its files, not as the text-only pyfunc model (its LlamaForCausalLM cannot load a LLaVA)
    assert not Path(summary["model_dir"], "MLmodel").exists()
