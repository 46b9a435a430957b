"""A user's second run (issue 15), through real flow runs (Prefect test server, MLflow store, Gloo workers).

Run A trains 8 steps (checkpoints at 4 and 8); run B of the same task, ``--resume never``, trains 6 steps with
checkpoints every 2 and ``keep_last: 2``. Before lineages, B's checkpoints shadowed or were deleted by A's, B's summary
named A's step 8, and ``resume: auto`` continued A. Then a resume past ``train.steps`` must say so, not report a
training that did not happen; and a stale ``PREFECT_API_URL`` must give one line, not a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kuangchao_core.ckpt.lineage import list_lineages, plan_resume
from kuangchao_core.config import load_config
from kuangchao_core.config.settings import lineage_key
from kuangchao_core.errors import NothingToTrain
from kuangchao_core.obs.voice import message_of, parse
from tests.conftest_prefect import TINY, tiny_overrides

ROOT = Path(__file__).resolve().parent.parent


def _flow(workdir: Path, overrides: list[str], **kwargs):
    from flows.train import train_flow

    old = os.environ.get("KC_RUNS_DIR")
    os.environ["KC_RUNS_DIR"] = str(workdir / "runs")
    try:
        return train_flow(config_path=TINY, overrides=overrides, **kwargs)
    finally:
        if old is None:
            os.environ.pop("KC_RUNS_DIR", None)
        else:
            os.environ["KC_RUNS_DIR"] = old


def _overrides(workdir: Path, store: Path, task: str, steps: int, interval: int, keep: int) -> list[str]:
    return tiny_overrides(
        workdir,
        store,
        task=task,
        **{
            "train.steps": steps,
            "train.warmup_steps": 2,
            "checkpoint.interval": interval,
            "checkpoint.keep_last": keep,
        },
    )


@pytest.fixture(scope="module")
def two_runs(prefect_api, session_store, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("second-run")
    a = _overrides(workdir, session_store, "kc-second-run", 8, 4, 3)
    b = _overrides(workdir, session_store, "kc-second-run", 6, 2, 2) + ["train.eval_interval=2"]
    first = _flow(workdir, a, resume="never")
    second = _flow(workdir, b, resume="never")
    return {"workdir": workdir, "a": a, "b": b, "first": first, "second": second}


def test_two_runs_keep_their_checkpoints_apart(two_runs):
    first, second = two_runs["first"], two_runs["second"]
    assert first["lineage"] != second["lineage"]
    cfg = load_config(TINY, two_runs["b"])
    task = Path(cfg.checkpoint.dir) / cfg.task.name
    steps = {lin.name: lin.steps() for lin in list_lineages(task)}
    assert steps == {first["lineage"]: [4, 8], second["lineage"]: [4, 6]}, steps
    assert not list(task.glob("**/*.replaced-*")), "a step directory of one run was moved aside by the other"
    # the second run's summary names its own model, and lists exactly the checkpoints that exist
    assert second["checkpoint_step"] == 6 and second["steps"] == 6 and second["trained_steps"] == 6
    assert second["checkpoint_path"] == str((task / second["lineage"] / "step_00000006").resolve())
    assert second["checkpoints"] == [4, 6]
    # and resume: auto continues it, not the first run (whose step 8 is higher)
    plan = plan_resume(lineage_key(cfg), "auto")
    assert (plan.lineage, plan.step) == (second["lineage"], 6)


def test_second_runs_mlflow_holds_only_its_own_checkpoints(two_runs):
    from mlflow.tracking import MlflowClient

    second = two_runs["second"]
    uri = next(o.split("=", 1)[1] for o in two_runs["b"] if o.startswith("tracking.uri="))
    client = MlflowClient(uri)
    run = client.get_run(second["mlflow_run_id"])
    assert run.data.tags["kuangchao.lineage"] == second["lineage"]
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert logged == {"checkpoints/step_00000004", "checkpoints/step_00000006"}, logged
    path = client.download_artifacts(run.info.run_id, "checkpoints/step_00000006/checkpoint.json")
    assert second["lineage"] in json.loads(Path(path).read_text())["path"]
    # run-level values a run list shows, logged at the final step
    assert run.data.metrics["final_loss"] == pytest.approx(second["final_loss"])
    assert run.data.metrics["tokens_per_s_mean"] > 0
    assert {m.step for m in client.get_metric_history(run.info.run_id, "final_loss")} == {6}
    # train.eval_interval: the held-out loss every 2 steps
    held_out = client.get_metric_history(run.info.run_id, "eval_loss")
    assert sorted(m.step for m in held_out) == [2, 4, 6] and all(0 < m.value < 10 for m in held_out)
    # the experiment opens in MLflow's model-training view, not the GenAI one
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"


def test_resume_past_train_steps_fails_with_the_fix_before_any_worker(two_runs):
    workdir = two_runs["workdir"]
    shorter = [o for o in two_runs["b"] if not o.startswith("train.steps=")] + ["train.steps=4"]
    with pytest.raises(NothingToTrain) as info:
        _flow(workdir, shorter)
    text = str(info.value)
    assert "already at step 6 of 4" in text and "--resume never" in text and "raise train.steps" in text


def test_kc_train_resumed_past_train_steps_prints_one_line_and_exits_2(two_runs, prefect_api):
    """Issue 27 §3: the refusal is one line with its fix on the console, exit code 2, no Prefect traceback (before:
    ~20 lines, the message four times, inside ``Encountered exception during execution`` and its traceback)."""
    workdir = two_runs["workdir"]
    shorter = [o for o in two_runs["b"] if not o.startswith("train.steps=")] + ["train.steps=4"]
    argv = [sys.executable, "-m", "kuangchao.cli.main", "train", "--config", TINY, "--resume", "auto"]
    argv += [a for o in shorter for a in ("--set", o)]
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "KC_RUNS_DIR": str(workdir / "runs"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-4000:])
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "Encountered exception" not in text, text
    said = [line for line in text.splitlines() if "already at step 6 of 4" in line]
    assert len(said) == 1, text
    assert (
        message_of(said[0]).startswith("kc train: ") and "--resume never" in said[0] and "raise train.steps" in said[0]
    )
    assert [parse(line)[1] for line in said] == ["ERROR"]  # the refusal, the one error line
    assert not [line for line in text.splitlines() if line != said[0] and " ERROR " in line], text


def test_resume_past_train_steps_with_skip_trains_nothing_and_says_so(two_runs):
    workdir = two_runs["workdir"]
    shorter = [o for o in two_runs["b"] if not o.startswith("train.steps=")] + ["train.steps=4"]
    state = _flow(workdir, shorter, if_finished="skip", return_state=True)
    assert state.is_completed() and state.name == "Skipped"
    assert "0 steps trained" in state.message and "step 6 of 4" in state.message
    summary = state.result()
    assert summary["trained_steps"] == 0 and summary["outcome"] == "nothing to train"
    assert "final_loss" not in summary and "tokens_per_s_mean" not in summary


def test_kc_train_with_an_unreachable_prefect_api_prints_one_line(tmp_path):
    from kuangchao_core.sched.launcher import free_port

    url = f"http://127.0.0.1:{free_port()}/api"
    env = {**os.environ, "PREFECT_API_URL": url}
    out = subprocess.run(
        [sys.executable, "-m", "kuangchao.cli.main", "train", "--config", TINY, "--set", "train.steps=2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert url in lines[0] and "prefect config unset PREFECT_API_URL" in lines[0] and "Traceback" not in out.stderr
