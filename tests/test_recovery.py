"""Issue 5 recovery: worker death and hangs are recovered with bitwise-identical losses; hopeless jobs stop.

Faults are injected from outside: a worker's PID comes from its heartbeat file and gets SIGKILL or SIGSTOP.
The uninterrupted reference is the session's ``reference_run`` (same config, same seed).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from kuangchao_core.config import load_config
from kuangchao_core.errors import ConfigError, DataError, WorkerFailed
from tests.conftest_prefect import (
    INTERVAL,
    STEPS,
    TINY,
    Saboteur,
    committed,
    loss_history,
    override_value,
    run_flow,
    tiny_overrides,
)
from tests.engine_helpers import only_lineage


@pytest.fixture(scope="module")
def moto_s3(s3_endpoint):
    """The module's moto S3 server with one bucket; AWS_* env points boto3 at fake credentials."""
    import boto3

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="kc-ckpt")
    yield s3_endpoint
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _ckpt_dir(overrides: list[str]) -> Path:
    return Path(override_value(overrides, "checkpoint.dir")) / override_value(overrides, "task.name")


def _attempt_glob(workdir: Path, overrides: list[str]) -> str:
    return str(workdir / "runs" / override_value(overrides, "task.name") / "*" / "attempt_{attempt}")


def _ref_values(ref: dict) -> list[float]:
    return [v for _, v in ref["losses"]]


# ----------------------------------------------------------------------------------------------------- full flows


def test_sigkill_mid_run_flow_recovers_bitwise_and_mirrors_to_s3(reference_run, tmp_path, moto_s3):
    from mlflow.tracking import MlflowClient

    from kuangchao_core.ckpt.s3 import S3Settings, list_checkpoints

    store = Path(override_value(reference_run["overrides"], "tracking.uri")[len("sqlite:///") :]).parent
    overrides = tiny_overrides(tmp_path, store)
    overrides += ["checkpoint.uri=s3://kc-ckpt/runs", f"checkpoint.endpoint_url={moto_s3}"]
    task_dir = _ckpt_dir(overrides)
    killer = Saboteur(_attempt_glob(tmp_path, overrides), [0], rank=1, ready=lambda: committed(task_dir, 8))
    killer.start()
    try:
        summary = run_flow(tmp_path, overrides)
    finally:
        killer.stop()
    assert len(killer.fired) == 1, "the worker was never killed"
    assert summary["attempts"] == 2 and summary["restarts"] == 1, summary
    # the launcher names the first rank torchrun saw fail: the killed one or a peer whose collective broke
    assert summary["restart_causes"][0].startswith("attempt 0: rank ")

    uri = override_value(overrides, "tracking.uri")
    losses = loss_history(uri, summary["mlflow_run_id"])
    assert [s for s, _ in losses] == list(range(1, STEPS + 1)), "every step exactly once in MLflow"
    assert [v for _, v in losses] == _ref_values(reference_run), "recovered losses differ from the uninterrupted run"

    run = MlflowClient(uri).get_run(summary["mlflow_run_id"])
    assert run.data.tags["kuangchao.attempts"] == "2"
    assert run.data.tags["kuangchao.restart.1.cause"].startswith("rank ")
    assert run.data.metrics["restarts"] == 1

    # both attempts wrote into the one lineage of this flow run, which is what S3 holds
    assert summary["lineage"] == only_lineage(task_dir).name
    s3_task = f"{override_value(overrides, 'task.name')}/{summary['lineage']}"
    remote = dict(list_checkpoints("s3://kc-ckpt/runs", s3_task, settings=S3Settings(endpoint_url=moto_s3)))
    assert STEPS in remote and summary["checkpoint_uri"] == remote[STEPS]


def test_worker_failing_every_attempt_gives_up_after_1_plus_max_restarts(reference_run, tmp_path, moto_s3):
    """Every attempt is killed (the first after its step-8 checkpoint): the run fails naming the killed rank, and the
    checkpoints it saved are in S3 — mirrored while it ran, since the flow never reached its final upload."""
    from mlflow.tracking import MlflowClient

    from kuangchao_core.ckpt.s3 import S3Settings, list_checkpoints

    store = Path(override_value(reference_run["overrides"], "tracking.uri")[len("sqlite:///") :]).parent
    overrides = tiny_overrides(tmp_path, store, **{"cluster.max_restarts": 1})
    overrides += ["checkpoint.uri=s3://kc-ckpt/failing", f"checkpoint.endpoint_url={moto_s3}"]
    task_dir = _ckpt_dir(overrides)
    killer = Saboteur(_attempt_glob(tmp_path, overrides), [0, 1, 2], rank=1, ready=lambda: committed(task_dir, 8))
    killer.start()
    try:
        with pytest.raises(WorkerFailed) as info:
            run_flow(tmp_path, overrides)
    finally:
        killer.stop()
    exc = info.value
    # the killed rank is named, not a peer that failed first on the broken connection
    assert exc.rank == 1 and "gave up after 2 attempts" in exc.cause
    assert "SIGKILL" in exc.cause, exc.cause
    attempts = sorted(Path(p).name for p in glob.glob(_attempt_glob(tmp_path, overrides).format(attempt="*")))
    assert attempts == ["attempt_0", "attempt_1"]
    assert [a for a, _, _ in killer.fired] == [0, 1]
    runs = MlflowClient(override_value(overrides, "tracking.uri")).search_runs(
        [
            MlflowClient(override_value(overrides, "tracking.uri"))
            .get_experiment_by_name(override_value(overrides, "task.name"))
            .experiment_id
        ]
    )
    assert len(runs) == 1 and runs[0].info.status == "FAILED" and runs[0].data.tags["kuangchao.attempts"] == "2"
    lineage = only_lineage(task_dir).name
    saved = sorted(int(p.parent.name[5:]) for p in (task_dir / lineage).glob("step_*/manifest.json"))
    s3_task = f"{override_value(overrides, 'task.name')}/{lineage}"
    remote = dict(list_checkpoints("s3://kc-ckpt/failing", s3_task, settings=S3Settings(endpoint_url=moto_s3)))
    # the failed job's checkpoints reached S3 (also those local retention has deleted since)
    assert 8 in saved and set(saved) <= set(remote), (saved, remote)


def test_config_error_is_not_retried(prefect_api, session_store, tmp_path):
    overrides = tiny_overrides(tmp_path, session_store, **{"parallel.micro_batch_size": "many"})
    with pytest.raises(ConfigError) as info:
        run_flow(tmp_path, overrides)
    assert any(path == "parallel.micro_batch_size" for path, _ in info.value.errors)
    assert not (tmp_path / "runs").exists(), "nothing may start on a config error"


def test_bad_dataset_stops_flow_before_any_worker(prefect_api, session_store, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    overrides = tiny_overrides(tmp_path, session_store, **{"data.path": str(empty), "data.format": "txt"})
    with pytest.raises(DataError, match="validation"):
        run_flow(tmp_path, overrides)
    run_dirs = glob.glob(str(tmp_path / "runs" / "*" / "*"))
    assert len(run_dirs) == 1, "the flow got as far as creating its run directory"
    assert not glob.glob(os.path.join(run_dirs[0], "attempt_*")), "a worker was started despite bad data"
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------------------ launch/recover cycles, no flow


class Cycle:
    """One job driven through ``launch_workers`` / ``plan_recovery`` directly, as the flow does it."""

    def __init__(self, workdir: Path, store: Path, **extra):
        from kuangchao_core.perm.issuance import issue_tokens_for_run

        self.workdir = workdir
        self.overrides = tiny_overrides(workdir, store, **extra)
        self.cfg = load_config(TINY, self.overrides)
        self.run_dir = workdir / "runs" / self.cfg.task.name / "run"
        self.run_dir.mkdir(parents=True)
        self.config_path = self.run_dir / "config.yaml"
        self.config_path.write_text(self.cfg.to_yaml(), encoding="utf-8")
        self.task_dir = Path(self.cfg.checkpoint.dir) / self.cfg.task.name
        self.attempt_glob = str(self.run_dir / "attempt_{attempt}")
        self._issue = issue_tokens_for_run

    def launch(self, attempt: int, resume: str = "auto"):
        from kuangchao_core.job.launch_attempt import launch_workers

        env = self._issue(self.cfg, self.run_dir, attempt)
        return launch_workers(self.cfg, self.config_path, self.run_dir, attempt, resume, None, env)

    def final_losses(self) -> list[float]:
        from kuangchao_core.ckpt.reader import read_state

        return list(read_state(self.lineage_dir / f"step_{STEPS:08d}")["losses"])

    @property
    def lineage_dir(self) -> Path:
        """The job's one checkpoint lineage (every attempt resumes inside it)."""
        return only_lineage(self.task_dir)


def _store(ref: dict) -> Path:
    return Path(override_value(ref["overrides"], "tracking.uri")[len("sqlite:///") :]).parent


def _corrupt_file(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_hung_worker_detected_in_time_then_resumed_past_corrupt_newest(reference_run, tmp_path, trusted, caplog):
    from kuangchao_core.job.recovery import plan_recovery

    timeout, interval = 3.0, 0.5
    cyc = Cycle(
        tmp_path,
        _store(reference_run),
        **{"cluster.heartbeat_timeout_s": timeout, "cluster.heartbeat_interval_s": interval},
    )
    stopper = Saboteur(cyc.attempt_glob, [0], rank=1, sig=signal.SIGSTOP, ready=lambda: committed(cyc.task_dir, 8))
    stopper.start()
    with pytest.raises(WorkerFailed) as info:
        cyc.launch(0)
    detected = time.monotonic()
    stopper.stop()
    assert len(stopper.fired) == 1
    assert "heartbeat lost" in info.value.cause and info.value.rank == 1
    # detection within timeout + one interval (+ the launcher's poll period and the group kill)
    assert detected - stopper.fired[0][2] <= timeout + interval + 1.5, detected - stopper.fired[0][2]

    steps = sorted(
        int(p.name[5:]) for p in cyc.lineage_dir.glob("step_????????") if committed(cyc.task_dir, int(p.name[5:]))
    )
    newest = steps[-1]
    _corrupt_file(cyc.lineage_dir / f"step_{newest:08d}" / "shards" / "rank_00000.safetensors")
    with caplog.at_level(logging.WARNING):
        plan = plan_recovery(cyc.cfg, 0, f"rank 1: {info.value.cause}")
    assert plan["resume_from"].endswith(f"step_{steps[-2]:08d}")
    assert any(f"step_{newest:08d}" in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)

    result = cyc.launch(1)
    assert result.steps == STEPS
    assert cyc.final_losses() == _ref_values(reference_run)


def test_killed_during_checkpoint_write_resumes_from_previous(reference_run, tmp_path, trusted):
    from kuangchao_core.job.recovery import plan_recovery

    cyc = Cycle(tmp_path, _store(reference_run))
    seen: list[int] = []

    def writing() -> bool:
        tmps = [int(Path(p).name[5:13]) for p in glob.glob(str(cyc.task_dir / "*" / "step_*.tmp-*"))]
        tmps = [s for s in tmps if s >= 8 and not committed(cyc.task_dir, s)]
        if tmps:
            seen.append(max(tmps))
        return bool(tmps)

    killer = Saboteur(cyc.attempt_glob, [0], rank=0, ready=writing)
    killer.start()
    with pytest.raises(WorkerFailed):
        cyc.launch(0)
    killer.stop()
    assert killer.fired, "no checkpoint write was caught"
    torn = seen[-1]
    assert not committed(cyc.task_dir, torn), "the kill landed after the commit; the test proved nothing"
    plan = plan_recovery(cyc.cfg, 0, "killed during checkpoint write")
    assert plan["resume_from"].endswith(f"step_{torn - INTERVAL:08d}")
    cyc.launch(1)
    assert cyc.final_losses() == _ref_values(reference_run)


@pytest.mark.slow
def test_five_sigkill_recoveries_in_a_row_each_on_first_retry(reference_run, tmp_path, trusted):
    """One job killed five times: each retry resumes from the newest checkpoint, commits a newer one (it
    recovered on its first try) and is then killed again; the sixth attempt finishes with the reference losses."""
    from kuangchao_core.job.recovery import plan_recovery

    repeats = int(os.environ.get("KC_RECOVERY_REPEATS", "5"))
    assert repeats * INTERVAL < STEPS, "every kill needs a checkpoint beyond the previous resume point"
    cyc = Cycle(tmp_path, _store(reference_run))
    resumed_from = 0
    for attempt in range(repeats):
        target = resumed_from + INTERVAL  # this attempt must get past its resume point before it is killed
        killer = Saboteur(cyc.attempt_glob, [attempt], rank=1, ready=lambda t=target: committed(cyc.task_dir, t))
        killer.start()
        with pytest.raises(WorkerFailed) as info:
            cyc.launch(attempt)
        killer.stop()
        assert killer.fired and info.value.rank == 1 and "SIGKILL" in info.value.cause, (attempt, info.value)
        plan = plan_recovery(cyc.cfg, attempt, str(info.value))
        step = int(Path(plan["resume_from"]).name.removeprefix("step_"))
        assert step >= target, f"attempt {attempt} did not get past step {resumed_from}: resumes from {step}"
        resumed_from = step
    assert cyc.launch(repeats).steps == STEPS, "the attempt after the last kill did not finish"
    assert cyc.final_losses() == _ref_values(reference_run), "losses differ from the uninterrupted run"


# ------------------------------------------------------------------------------------------------ S3 corruption


def test_corrupt_newest_s3_checkpoint_falls_back_to_previous(reference_run, tmp_path, moto_s3, trusted, caplog):
    import boto3

    from kuangchao_core.ckpt.s3 import S3Settings
    from kuangchao_core.job.checkpoints import restore_from_s3, upload_intact

    src = _ckpt_dir(reference_run["overrides"])
    overrides = tiny_overrides(tmp_path, _store(reference_run))
    overrides += ["checkpoint.uri=s3://kc-ckpt/corrupt", f"checkpoint.endpoint_url={moto_s3}"]
    cfg = load_config(TINY, overrides)
    local = Path(cfg.checkpoint.dir) / cfg.task.name
    shutil.copytree(src, local)
    settings = S3Settings(endpoint_url=moto_s3, region="us-east-1")
    uploaded = upload_intact(cfg, settings)
    steps = sorted(uploaded)
    assert len(steps) >= 2 and steps[-1] == STEPS
    s3 = boto3.client("s3", endpoint_url=moto_s3)
    lineage = only_lineage(local).name
    key = f"corrupt/{cfg.task.name}/{lineage}/step_{STEPS:08d}/shards/rank_00000.safetensors"
    body = bytearray(s3.get_object(Bucket="kc-ckpt", Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.put_object(Bucket="kc-ckpt", Key=key, Body=bytes(body))

    shutil.rmtree(local)
    with caplog.at_level(logging.WARNING):
        restored = restore_from_s3(cfg, settings)
    assert restored["step"] == steps[-2] and restored["source"] == uploaded[steps[-2]]
    assert [s["step"] for s in restored["skipped"]] == [STEPS] and "sha256" in restored["skipped"][0]["reason"]
    assert any("skipping corrupt S3 checkpoint" in r.getMessage() for r in caplog.records)
    assert restored["lineage"] == lineage  # restored into the lineage it was uploaded from
    local = local / lineage
    assert (local / f"step_{steps[-2]:08d}" / "manifest.json").exists()
    assert not (local / f"step_{STEPS:08d}").exists()
    manifest = json.loads((local / f"step_{steps[-2]:08d}" / "manifest.json").read_text())
    assert manifest["step"] == steps[-2]
