"""Launcher, heartbeats and restart policy, with real torchrun processes (2 local workers, no GPU)."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kuangchao_core.errors import ConfigError, DataError, PermissionDenied, WorkerFailed
from kuangchao_core.sched.heartbeat import HeartbeatMonitor, HeartbeatWriter, heartbeat_path, read_beat
from kuangchao_core.sched.launch_spec import LaunchSpec
from kuangchao_core.sched.launcher import free_port, run_workers
from kuangchao_core.sched.recovery import RestartPolicy, supervise

ROOT = Path(__file__).resolve().parent.parent

WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    from torch.distributed.elastic.multiprocessing.errors import record
    from kuangchao_core.sched.heartbeat import HeartbeatWriter

    @record
    def main():
        mode, target, arg = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
        rank = int(os.environ["RANK"])
        hb = HeartbeatWriter.from_env()
        hb.start()
        print(f"hello from {rank} attempt {os.environ['KC_ATTEMPT']}", flush=True)
        if mode == "ok" or rank != target:
            # in "slowio" the other rank outlives the writer by more than the timeout: an exited rank is not watched
            time.sleep({"ok": arg, "slowio": arg + 2.0}.get(mode, 60))
            hb.stop()
            return
        if mode == "raise":
            raise ValueError(f"boom on rank {rank}")
        if mode == "exit":
            print("about to exit 3", flush=True)
            sys.exit(3)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stop":
            time.sleep(arg)
            with open(os.environ["KC_TEST_MARK"], "w") as f:
                f.write(repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGSTOP)
        if mode == "slowio":
            # a long blocking "checkpoint write": the beat thread keeps going
            with open(os.path.join(os.environ["KC_HEARTBEAT_DIR"], "..", "big.bin"), "wb") as f:
                t = time.monotonic()
                while time.monotonic() - t < arg:
                    f.write(b"x" * 65536)
                    f.flush()
                    os.fsync(f.fileno())
                    time.sleep(0.05)
            hb.stop()

    if __name__ == "__main__":
        main()
    """
)


@pytest.fixture
def worker_env(tmp_path):
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    (mod_dir / "kc_test_worker.py").write_text(WORKER)
    return {"PYTHONPATH": os.pathsep.join([str(mod_dir), str(ROOT)]), "KC_TEST_MARK": str(tmp_path / "stopped_at")}


def _run(worker_env, tmp_path, mode, target=1, arg=0.2, **kw):
    lines: list[str] = []
    kw.setdefault("heartbeat_interval_s", 0.3)
    try:
        res = run_workers(
            LaunchSpec(
                "kc_test_worker",
                [mode, str(target), str(arg)],
                nproc=2,
                env=worker_env,
                run_dir=tmp_path / "run",
                log_sink=lines.append,
                timeout_s=90,
                **kw,
            )
        )
    except WorkerFailed as e:
        return e, lines
    return res, lines


def test_success_streams_rank_prefixed_lines(worker_env, tmp_path):
    res, lines = _run(worker_env, tmp_path, "ok", arg=0.2)
    assert res.exit_code == 0
    assert any(ln.startswith("[rank0]:hello from 0 attempt 0") for ln in lines), lines
    assert any(ln.startswith("[rank1]:hello from 1 attempt 0") for ln in lines), lines
    assert (res.attempt_dir / "launcher.log").read_text().count("hello from") == 2


def test_exception_names_rank_and_message(worker_env, tmp_path):
    err, _ = _run(worker_env, tmp_path, "raise", target=1)
    assert isinstance(err, WorkerFailed), err
    assert err.rank == 1
    assert "boom on rank 1" in err.cause
    assert err.exit_code == 1


def test_plain_exit_code_names_rank(worker_env, tmp_path):
    err, _ = _run(worker_env, tmp_path, "exit", target=0)
    assert isinstance(err, WorkerFailed), err
    assert err.rank == 0 and err.exit_code == 3
    assert "exited with code 3" in err.cause and "about to exit 3" in err.cause


def test_sigkill_names_signal(worker_env, tmp_path):
    err, _ = _run(worker_env, tmp_path, "kill", target=1)
    assert isinstance(err, WorkerFailed), err
    assert err.rank == 1
    assert "SIGKILL" in err.cause
    assert err.exit_code == -signal.SIGKILL


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_sigstop_detected_by_heartbeat_and_group_killed(worker_env, tmp_path):
    timeout, interval = 1.5, 0.3
    err, _ = _run(
        worker_env, tmp_path, "stop", target=1, arg=0.5, heartbeat_timeout_s=timeout, heartbeat_interval_s=interval
    )
    raised_at = time.monotonic()
    assert isinstance(err, WorkerFailed), err
    assert err.rank == 1 and "heartbeat lost" in err.cause
    stopped_at = float((tmp_path / "stopped_at").read_text())
    # the last beat came at most one interval before the stop; detection within timeout + one interval of it
    assert timeout - interval <= raised_at - stopped_at <= timeout + interval, raised_at - stopped_at
    hb_dir = tmp_path / "run" / "attempt_0" / "heartbeat"
    pids = [read_beat(heartbeat_path(hb_dir, r)).pid for r in (0, 1)]
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), "worker processes survived the heartbeat kill"


def test_long_blocking_write_does_not_trip_heartbeat(worker_env, tmp_path):
    res, _ = _run(worker_env, tmp_path, "slowio", target=0, arg=2.5, heartbeat_timeout_s=1.0, heartbeat_interval_s=0.2)
    assert not isinstance(res, WorkerFailed), res
    assert res.exit_code == 0


def test_monitor_unit_fake_clock(tmp_path):
    now = [100.0]
    w = HeartbeatWriter(tmp_path, rank=0, interval_s=1.0, attempt=2)
    mon = HeartbeatMonitor(tmp_path, [0, 1], timeout_s=3.0, attempt=2, clock=lambda: now[0])
    assert mon.poll() is None  # nobody has beaten: not watched yet (no startup grace)
    w.beat()
    assert mon.poll() is None and mon.seen(0)
    now[0] += 2.9
    assert mon.poll() is None
    w.beat()
    now[0] += 0.1
    assert mon.poll() is None  # the beat reset the deadline
    now[0] += 3.01
    assert mon.poll() == (0, pytest.approx(3.01))
    # beats of another attempt are stale and ignored
    stale = HeartbeatWriter(tmp_path, rank=1, interval_s=1.0, attempt=1)
    stale.beat()
    mon2 = HeartbeatMonitor(tmp_path, [1], timeout_s=3.0, attempt=2, clock=lambda: now[0], startup_grace_s=5.0)
    assert mon2.poll() is None and not mon2.seen(1) and mon2.stale_beats == 1
    now[0] += 5.1
    assert mon2.poll()[0] == 1  # no first beat within the startup grace


def test_free_port_differs_per_attempt(worker_env, tmp_path):
    ports = {free_port() for _ in range(5)}
    assert len(ports) > 1


# --- supervise -------------------------------------------------------------------------------------------------------


def test_supervise_runs_exactly_one_plus_max_restarts(tmp_path):
    calls: list[int] = []
    restarts: list[tuple[int, str]] = []

    def launch(attempt):
        calls.append(attempt)
        raise WorkerFailed(1, f"killed by SIGKILL on attempt {attempt}", -9)

    with pytest.raises(WorkerFailed) as ei:
        supervise(launch, RestartPolicy(max_restarts=2), on_restart=lambda a, e: restarts.append((a, e.cause)))
    assert calls == [0, 1, 2]
    assert [a for a, _ in restarts] == [1, 2]
    assert ei.value.rank == 1
    assert "3 attempts" in str(ei.value) and "SIGKILL" in str(ei.value)


def test_supervise_recovers_and_reports(tmp_path):
    def launch(attempt):
        if attempt < 1:
            raise WorkerFailed(0, "heartbeat lost for 3.2 s")
        return f"ok{attempt}"

    out = supervise(launch, RestartPolicy(max_restarts=3))
    assert out.attempts == 2 and out.result == "ok1"
    assert [(f.rank, f.cause) for f in out.failures] == [(0, "heartbeat lost for 3.2 s")]


@pytest.mark.parametrize(
    "exc",
    [
        ConfigError([("train.steps", "must be > 0")]),
        DataError("empty dataset"),
        PermissionDenied("send", "group:x", "no"),
    ],
)
def test_supervise_never_retries_user_errors(exc):
    calls = []

    def launch(attempt):
        calls.append(attempt)
        raise exc

    with pytest.raises(type(exc)):
        supervise(launch, RestartPolicy(max_restarts=5, retry_on=(Exception,)))
    assert calls == [0]


def test_supervise_real_processes_fresh_port_each_attempt(worker_env, tmp_path):
    endpoints = []

    def launch(attempt):
        mode = "kill" if attempt == 0 else "ok"
        res = run_workers(
            LaunchSpec(
                "kc_test_worker", [mode, "1", "0.1"], 2, worker_env, tmp_path / "run", attempt=attempt, timeout_s=90
            )
        )
        endpoints.append(res.rdzv_endpoint)
        return res

    out = supervise(launch, RestartPolicy(max_restarts=1))
    assert out.attempts == 2 and out.failures[0].rank == 1 and "SIGKILL" in out.failures[0].cause
    assert (tmp_path / "run" / "attempt_0").is_dir() and (tmp_path / "run" / "attempt_1").is_dir()
    assert out.result.attempt == 1


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("the launcher's process-tree kill reads /proc")
