"""Shared helpers and session fixtures of the lifecycle tests (flow, recovery, deployment).

Its fixtures (``session_store``, ``reference_run``) serve every test module without an import: ``tests/conftest.py``
loads this module as a plugin; the Prefect test server is the session fixture ``prefect_api`` there. Import only
the helpers. One Prefect test server and one MLflow sqlite store serve the whole session; every test uses its own
task name, checkpoint directory and run directory.
"""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS = 12
INTERVAL = 2


@pytest.fixture(scope="session")
def session_store(tmp_path_factory) -> Path:
    """A directory holding the session's MLflow sqlite store (created once: its migrations take seconds)."""
    return tmp_path_factory.mktemp("kc-lifecycle")


def tiny_overrides(workdir: Path, store: Path, task: str | None = None, **extra) -> list[str]:
    """``--set`` overrides of a short tiny run writing everything under ``workdir``."""
    task = task or f"kc-test-{uuid.uuid4().hex[:6]}"
    base = {
        "task.name": task,
        "train.steps": STEPS,
        "train.warmup_steps": 2,
        "train.log_interval": INTERVAL,
        "checkpoint.interval": INTERVAL,
        "checkpoint.keep_last": 3,
        # the lifecycle tests keep their workload: 8 windows of text packed across documents
        "data.packing": "concat",
        "parallel.micro_batch_size": 8,
        "checkpoint.dir": str(workdir / "ckpt"),
        "tracking.uri": f"sqlite:///{store / 'mlflow.db'}",
        "permission.audit_log": str(workdir / "audit"),
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def override_value(overrides: list[str], key: str) -> str:
    """The value of ``key`` in ``overrides``."""
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(key + "="))


def loss_history(tracking_uri: str, run_id: str) -> list[tuple[int, float]]:
    """Every logged ``loss`` value of a run as (step, value), sorted, duplicates kept."""
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri).get_metric_history(run_id, "loss"))


def worker_pid(runs_glob: str, rank: int) -> int | None:
    """PID of ``rank`` from its heartbeat file, found by the glob of an attempt directory."""
    from kuangchao_core.sched.heartbeat import read_beat

    for path in glob.glob(os.path.join(runs_glob, "heartbeat", f"rank_{rank}.hb")):
        beat = read_beat(path)
        if beat is not None:
            return beat.pid
    return None


class Saboteur(threading.Thread):
    """Sends ``sig`` to worker ``rank`` of the given attempts once ``ready()`` holds (polled every 5 ms).

    ``attempt_glob`` is a glob with ``{attempt}`` for the attempt directory, e.g. ``runs/task/*/attempt_{attempt}``.
    ``fired`` records ``(attempt, pid, monotonic time)`` of every signal sent.
    """

    def __init__(self, attempt_glob: str, attempts, rank: int = 1, sig=signal.SIGKILL, ready=None, timeout_s=240.0):
        super().__init__(daemon=True)
        self.attempt_glob, self.attempts, self.rank, self.sig = attempt_glob, list(attempts), rank, sig
        self.ready = ready or (lambda: True)
        self.timeout_s = timeout_s
        self.fired: list[tuple[int, int, float]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        for attempt in self.attempts:
            pattern = self.attempt_glob.format(attempt=attempt)
            while not self._halt.is_set() and time.monotonic() < deadline:
                pid = worker_pid(pattern, self.rank)
                if pid is not None and self.ready():
                    try:
                        os.kill(pid, self.sig)
                        self.fired.append((attempt, pid, time.monotonic()))
                    except ProcessLookupError:
                        continue
                    break
                time.sleep(0.005)

    def stop(self) -> None:
        """Stop watching."""
        self._halt.set()
        self.join(timeout=5)


def committed(ckpt_task_dir: Path, step: int) -> bool:
    """Whether checkpoint ``step`` of any lineage of the task has its manifest (was committed)."""
    return bool(glob.glob(str(ckpt_task_dir / "*" / f"step_{step:08d}" / "manifest.json")))


def run_flow(
    workdir: Path, overrides: list[str], config_path: str = TINY, resume: str | None = None, env: dict | None = None
) -> dict:
    """Run ``train_flow`` in-process with runs under ``workdir/runs`` and ``env`` set for its workers (restores the
    environment afterwards)."""
    from flows.train import train_flow

    changes = {"KC_RUNS_DIR": str(workdir / "runs"), **(env or {})}
    old = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        return train_flow(config_path=config_path, overrides=overrides, resume=resume)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def reference_run(prefect_api, session_store, tmp_path_factory) -> dict:
    """An uninterrupted flow run of the short tiny job: its summary, overrides and per-step MLflow losses. Its
    workers run under NCCL's rules (``KC_COMM_RULES=nccl``: a stand-in device, host tensors refused on device
    groups), so every test of this run is also a test of the GPU path's contract."""
    workdir = tmp_path_factory.mktemp("reference")
    pin_store = workdir / "pin-store"  # an audit pin store (issue 38), a plain one: no root needed
    pin_store.mkdir()
    (pin_store / "pins.jsonl").touch()
    overrides = tiny_overrides(
        workdir,
        session_store,
        **{
            "tracking.system_metrics_interval_s": 1,
            "tracking.register_model": f"kc-test-{uuid.uuid4().hex[:6]}",
            "permission.pin_store": str(pin_store),
        },
    )
    started = time.time()
    summary = run_flow(workdir, overrides, env={"KC_COMM_RULES": "nccl"})
    ended = time.time()
    uri = override_value(overrides, "tracking.uri")
    return {
        "started": started,  # around the flow's call (epoch seconds)
        "ended": ended,
        "workdir": workdir,
        "overrides": overrides,
        "summary": summary,
        "tracking_uri": uri,
        "pin_store": str(pin_store),
        "losses": loss_history(uri, summary["mlflow_run_id"]),
    }
