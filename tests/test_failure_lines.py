"""One clear line per failure (issue 27 §3), the fast parts: the live view leaves torchrun's failure reports and the
ranks' tracebacks out of the console (they stay in launcher.log), Prefect's console repeats of a deliberate error
are dropped, ``kc train``'s line and exit code per error, and the orchestrator declaring a killed node lost from its
peers' failure (their connections to it dropped) within seconds instead of the heartbeat limit.

The whole job's refusal is in tests/test_second_run.py; the killed host on the bench in tests/test_cluster.py."""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from pathlib import Path

import pytest

from kuangchao_core.errors import ConfigError, NothingToTrain, WorkerFailed
from kuangchao_core.obs.console import FailureNoise, LiveView
from kuangchao_core.obs.voice import message_of, parse

# what torchrun prints when rank 1 of two dies and rank 0 sees its connection drop (shortened from a real run)
TORCHRUN_FAILURE = """\
[rank0]:KC_EVENT {"event": "start", "total_steps": 12, "start_step": 0, "world_size": 2}
[rank0]:{"ts": "t", "level": "WARNING", "rank": 0, "logger": "kuangchao.engine", "msg": "slow step"}
[rank1]:a worker's own free-text line
[rank0]:Traceback (most recent call last):
[rank0]:  File "/work/main/kuangchao_core/comm/dispatch.py", line 90, in run
[rank0]:    work = issue(async_op)
[rank0]:           ^^^^^^^^^^^^^^^
[rank0]:RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1234
[rank0]:
[rank0]:The above exception was the direct cause of the following exception:
[rank0]:
[rank0]:Traceback (most recent call last):
[rank0]:  File "/work/main/kuangchao_core/engine/worker.py", line 120, in main
[rank0]:    trainer.run()
[rank0]:kuangchao_core.errors.CommError: all_reduce on group 'dp' failed at seq 7: Connection closed by peer
[rank0]:  second line of that message
[rank0]:[E1203 00:42:05.698000 6283 torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:100] Gloo connection lost
W1203 00:42:05.698000 6266 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] \
Sending process 6283 closing signal SIGTERM
E1203 00:42:06.088000 6266 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] \
failed (exitcode: -9) local_rank: 1 (pid: 6284) of binary: python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
kuangchao_core.engine.worker FAILED
------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 6283)  (SIGTERM)
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 6284)  (SIGKILL)
======================================================
[rank1]:the worker speaks again after a traceback
"""


def test_the_live_view_shows_the_workers_lines_but_not_torchruns_failure_report():
    out = io.StringIO()
    view = LiveView(stream=out, rich_live=False)
    for line in TORCHRUN_FAILURE.splitlines():
        view(line)
    lines = out.getvalue().splitlines()
    shown = [parse(line)[1:] for line in lines]  # (level, source, message): every line in the one voice
    assert shown[1] == ("WARNING", "rank0", "slow step") and shown[2] == (
        "INFO",
        "rank1",
        "a worker's own free-text line",
    )
    assert shown[-1] == ("INFO", "rank1", "the worker speaks again after a traceback"), shown
    text = out.getvalue()
    for noise in ("Traceback", "ChildFailedError", "Connection closed", "====", "Root Cause", "exitcode", "SIGTERM"):
        assert noise not in text, (noise, text)
    assert len(shown) == 4, lines  # the start line, the warning, the two free-text lines
    # the control: without the filter every one of those lines reached the console
    bare = FailureNoise()
    assert sum(bare(line) for line in TORCHRUN_FAILURE.splitlines()) >= 30


def test_prefects_console_repeats_of_a_deliberate_error_are_dropped():
    from kuangchao.cli.failure_lines import ExpectedFailureFilter

    quiet = ExpectedFailureFilter()

    def record(msg: str, exc: BaseException | None = None) -> logging.LogRecord:
        info = (type(exc), exc, None) if exc is not None else None
        return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, msg, None, info)

    refusal = NothingToTrain(4, 2, "/ckpt/step_00000004")
    assert not quiet.filter(record("Encountered exception during execution: %r", refusal))
    assert not quiet.filter(record("kuangchao-train failed: invalid configuration"))
    assert not quiet.filter(record("Finished in state Failed('Flow run encountered an exception: NothingToTrain: x')"))
    assert not quiet.filter(record("Finished in state Failed('Task run encountered an exception WorkerFailed: x')"))
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = WorkerFailed(1, "boom")
    assert not quiet.filter(record("Task run failed with exception", wrapped))
    not_retried = record("launch not retried: permanent (a worker failure: WorkerFailed: worker rank 1 failed)")
    not_retried.kc_not_retried = WorkerFailed(1, "boom")  # what tasks/retry_policy.py attaches (issue 44)
    assert not quiet.filter(not_retried)
    bug = record("launch not retried: permanent (not a failure known to pass on a retry: ValueError: a bug)")
    bug.kc_not_retried = ValueError("a bug")
    assert quiet.filter(bug)  # control: a failure the CLI does not say itself stays
    # anything else stays: the user's progress lines, an unexpected crash with its traceback
    assert quiet.filter(record("attempt 0 failed: rank 1: boom; recovering"))
    assert quiet.filter(record("Encountered exception during execution", ValueError("a bug")))
    assert quiet.filter(record("Finished in state Failed('Flow run encountered an exception: ValueError: a bug')"))


def test_kc_trains_line_and_exit_code_per_error():
    from kuangchao.cli.failure_lines import failure_lines

    lines, code = failure_lines(NothingToTrain(100, 40, "/ckpt/step_00000100"), "job.yaml")
    assert code == 2 and len(lines) == 1
    assert "already at step 100 of 40" in lines[0] and "--resume never" in lines[0] and "\n" not in lines[0]
    lines, code = failure_lines(ConfigError([("train.steps", "must be > 0")], "job.yaml"), "x.yaml")
    assert (lines, code) == (["kc train: job.yaml: train.steps: must be > 0"], 2)
    lines, code = failure_lines(WorkerFailed(1, "CommError: wrong backend\n  fix: use gloo"), "job.yaml")
    assert code == 1 and lines == ["kc train failed: worker rank 1 failed: CommError: wrong backend fix: use gloo"]


# --- the orchestrator's watch: a killed node is lost as soon as its peers report, not after the heartbeat limit


class _Agent(threading.Thread):
    """A node agent's beat; ``result`` is written after ``fail_after_s`` (None: never), ``dies_after_s`` ends it."""

    def __init__(self, out: Path, dies_after_s: float | None = None, result: dict | None = None, at: float = 0.0):
        super().__init__(daemon=True)
        self.out, self.dies_after_s, self.result, self.at = out, dies_after_s, result, at
        self.halt = threading.Event()

    def run(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        t0, n = time.monotonic(), 0
        while not self.halt.is_set():
            now = time.monotonic() - t0
            if self.dies_after_s is not None and now > self.dies_after_s:
                return  # the machine died: no beat, no result
            n += 1
            (self.out / "agent.json").write_text(json.dumps({"counter": n}))
            if self.result is not None and now > self.at:
                (self.out / "result.json").write_text(json.dumps(self.result))
                self.result = None
            time.sleep(0.1)


def _run_watch(tmp: Path, agents: dict[str, _Agent], lost_after: float = 60.0) -> tuple[WorkerFailed, float]:
    from kuangchao_core.sched.node_watch import AttemptWatch

    watch = AttemptWatch(tmp, 0, agents, lost_after=lost_after, start_timeout=180.0)
    for agent in agents.values():
        agent.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerFailed) as info:
            watch.watch(0.05)
    finally:
        for agent in agents.values():
            agent.halt.set()
    return info.value, time.monotonic() - t0


def test_a_killed_node_is_lost_once_its_peers_report_the_drop_not_after_the_heartbeat_limit(tmp_path):
    nodes = tmp_path / "attempt_0" / "nodes"
    drop = "on rank 0: CommError: all_reduce on group 'dp' failed: Connection closed by peer [10.0.0.2]:1234"
    agents = {
        "h0": _Agent(nodes / "h0", result={"ok": False, "rank": 0, "cause": drop, "exit_code": 1}, at=2.0),
        "h1": _Agent(nodes / "h1", dies_after_s=1.0),
    }
    exc, took = _run_watch(tmp_path, agents, lost_after=60.0)
    assert exc.node == "h1" and exc.rank is None and "lost" in exc.cause, exc  # not the surviving h0
    assert took < 10.0, f"lost after {took:.1f} s (heartbeat limit 60 s)"
    assert (tmp_path / "attempt_0" / "stop").exists()  # the survivors were stopped


def test_a_node_failing_on_its_own_is_named_before_the_peers_that_saw_it_drop(tmp_path):
    nodes = tmp_path / "attempt_0" / "nodes"
    drop = "Connection reset by peer"
    agents = {
        "h0": _Agent(nodes / "h0", result={"ok": False, "rank": 0, "cause": drop, "exit_code": 1}, at=0.5),
        "h1": _Agent(
            nodes / "h1", result={"ok": False, "rank": 3, "cause": "killed by SIGKILL", "exit_code": -9}, at=1
        ),
    }
    exc, took = _run_watch(tmp_path, agents)
    assert exc.node is None and exc.rank == 3 and "h1" in exc.cause and "SIGKILL" in exc.cause, exc
    assert took < 10.0


def test_a_node_whose_torchrun_died_without_a_report_is_lost(tmp_path):
    nodes = tmp_path / "attempt_0" / "nodes"
    dead = {
        "ok": False,
        "rank": None,
        "cause": "torchrun exited with code -9 without a worker failure report; last output: x",
        "exit_code": -9,
    }
    agents = {"h0": _Agent(nodes / "h0"), "h1": _Agent(nodes / "h1", result=dead, at=0.5)}
    exc, took = _run_watch(tmp_path, agents)
    assert exc.node == "h1" and "torchrun died" in exc.cause, exc
    assert took < 5.0


# --- the whole job: a worker failure's cause once on the console, the full torch output in the run directory


def test_kc_train_of_a_failing_worker_says_the_cause_once_and_keeps_torchs_output_in_the_run_dir(prefect_api, tmp_path):
    """`kc train` (real flow, two workers under torchrun) fine-tuning a base with a NaN weight: every rank stops
    with ``AnomalyStop`` at its first checkpoint (never retried). The console has one ``kc train failed`` line naming
    it, neither a traceback nor torchrun's report; ``attempt_0/launcher.log`` has both (before: the ranks' tracebacks,
    torchrun's ``ChildFailedError`` block and Prefect's task and flow tracebacks, the cause repeated each time)."""
    import os
    import subprocess
    import sys

    from tests.test_diverged_run import _nan_copy

    root = Path(__file__).resolve().parent.parent
    base = _nan_copy(root / "tests" / "data" / "kc-tiny-demo", tmp_path / "nan-base")
    overrides = {
        "task.name": "kc-one-line",
        "model.checkpoint": str(base),
        "train.steps": 4,
        "train.warmup_steps": 0,
        "train.log_interval": 1,
        "train.eval_interval": 1000,
        "checkpoint.interval": 2,
        "checkpoint.dir": str(tmp_path / "ckpt"),
        "checkpoint.resume": "never",
        "data.synthetic.num_train": 512,
        "parallel.micro_batch_size": 2,
        "permission.audit_log": str(tmp_path / "audit"),
        "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "tracking.system_metrics": "false",
        "cluster.max_restarts": 2,
    }
    argv = [sys.executable, "-m", "kuangchao.cli.main", "train", "--config", str(root / "configs" / "tiny.yaml")]
    argv += [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "KC_RUNS_DIR": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    text = out.stdout + out.stderr
    (tmp_path / "console.txt").write_text(text)
    assert out.returncode == 1, text[-4000:]
    failed = [line for line in text.splitlines() if message_of(line).startswith("kc train failed:")]
    assert len(failed) == 1 and "AnomalyStop" in failed[0] and "rank" in failed[0], text[-4000:]
    for noise in ("Traceback", "ChildFailedError", "Root Cause", "Encountered exception", "Task run failed"):
        assert noise not in text, (noise, text[-4000:])
    assert len([line for line in text.splitlines() if "AnomalyStop" in line]) == 1, text[-4000:]
    logs = list((tmp_path / "runs").glob("kc-one-line/*/attempt_0/launcher.log"))
    assert len(logs) == 1
    full = logs[0].read_text()
    assert "Traceback" in full and "ChildFailedError" in full  # torch's whole report, kept in the run directory
    per_rank = "".join(p.read_text(errors="replace") for p in logs[0].parent.glob("logs/**/*") if p.is_file())
    assert "AnomalyStop" in full + per_rank
