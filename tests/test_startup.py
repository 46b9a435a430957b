"""Start in seconds (issue 27 §2), the fast parts: a ``kc train`` with nothing to train is refused before any Prefect
run starts, within the issue's 3 s, with exit code 2; the phase clock the run summary's ``startup_s`` and
``after_last_step_s`` come from adds up to what it measured. The phases of a real flow run are checked on the
session's reference run in tests/test_flow.py; the start-up against torchrun is measured in benchmarks/startup.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kuangchao_core.obs import phases
from kuangchao_core.obs.voice import message_of

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def _finished_lineage(tmp_path: Path, overrides: list[str], step: int) -> Path:
    """An intact checkpoint at ``step`` in a lineage of the job ``overrides`` describe (what a finished run leaves)."""
    import torch

    from kuangchao_core.ckpt.lineage import create_lineage, plan_resume
    from kuangchao_core.ckpt.writer import CheckpointWriter
    from kuangchao_core.config import load_config
    from kuangchao_core.config.settings import lineage_key
    from kuangchao_core.perm import guard_api

    cfg = load_config(TINY, overrides)
    plan = plan_resume(lineage_key(cfg), "auto")
    create_lineage(lineage_key(cfg), plan.lineage)
    previous = guard_api.install_guard(guard_api.AllowAll())
    try:
        writer = CheckpointWriter(cfg.checkpoint.dir, cfg.task.name, 0, 1, barrier=lambda: None, lineage=plan.lineage)
        return writer.save(step, {"param.w": torch.zeros(2)}, rng_state={}, state={"step": step})
    finally:
        guard_api.install_guard(previous)


@pytest.mark.serial  # a bound of 3 s from process start: it measured the other worker's load (3.38 s) beside it
def test_a_refused_kc_train_exits_2_within_3_s_before_any_prefect_run(tmp_path):
    """The lineage is at step 6, the job asks for 4: one line naming train.steps, exit 2, within 3 s of the
    process's start. The Prefect API configured does not answer: before, kc train said so (exit 1), or on
    Prefect's temporary server started a flow run to refuse it (~31 s on a warm machine)."""
    overrides = [
        "task.name=kc-refused",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"permission.audit_log={tmp_path / 'audit'}",
    ]
    step_dir = _finished_lineage(tmp_path, overrides, 6)
    argv = [sys.executable, "-m", "kuangchao.cli.main", "train", "--config", TINY, "--set", "train.steps=4"]
    argv += [a for o in overrides for a in ("--set", o)]
    env = {
        **os.environ,
        "PREFECT_API_URL": "http://127.0.0.1:9/api",  # nothing listens there
        "KC_RUNS_DIR": str(tmp_path / "runs"),
        "OMP_NUM_THREADS": "1",
    }
    started = time.monotonic()
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and message_of(lines[0]).startswith("kc train: already at step 6 of 4"), (
        out.stderr
    )  # as the flow says
    assert str(step_dir) in lines[0] and "--resume never" in lines[0], out.stderr
    assert "Prefect" not in out.stderr, out.stderr  # refused before the Prefect API was asked anything
    assert not (tmp_path / "runs").exists()  # no flow run, no run directory
    assert took <= 3.0, f"a refusal took {took:.2f} s (issue 27 §2: <= 3 s)"


def test_the_phases_add_up_to_the_measured_totals():
    origin = time.time() - 1.0  # the process started a second ago
    clock = phases.begin(origin)
    clock.add("imports", 0.4)
    clock.add("imports", 0.1)  # the flow's imports add to the CLI's
    clock.mark(phases.FLOW_CALLED)
    time.sleep(0.05)
    assert phases.pending() is clock
    claimed = phases.claim()
    assert claimed is clock and phases.pending() is None and phases.active() is clock
    assert clock.seconds["prefect"] >= 0.05  # from kc train's call to the flow's body
    with clock.phase("doctor"):
        time.sleep(0.02)
    clock.on_event({"event": "start"})
    assert clock.startup() is None  # no step yet
    clock.on_event({"event": "step", "step": 1})
    time.sleep(0.02)
    clock.on_event({"event": "step", "step": 2})
    startup = clock.startup()
    assert startup["first_step"] == 1 and startup["imports"] == pytest.approx(0.5)
    assert startup["total"] == pytest.approx(clock.first_step[1] - origin, abs=0.01)
    assert startup["total"] >= 1.05
    parts = sum(v for k, v in startup.items() if k not in ("total", "first_step"))
    assert parts == pytest.approx(startup["total"], abs=0.03)  # rounding only: "other" is what no phase covers
    clock.add("checkpoint", 0.01)
    after = clock.after_last_step(now=clock.last_step[1] + 0.5)
    assert after["total"] == 0.5 and after["checkpoint"] == 0.01 and after["other"] == 0.49
    phases.release(clock)
    assert phases.active() is None
    fresh = phases.claim()  # a flow nothing began (a deployment's): measured from its own start
    assert fresh is not clock and time.time() - fresh.origin < 1.0
    phases.release(fresh)
    line = phases.compact(startup, after)
    assert line.startswith("start-up ") and "to step 1" in line and "after the last step 0.5 s" in line


def test_process_start_time_is_this_processs():
    import psutil

    assert phases.process_start_time() == pytest.approx(psutil.Process().create_time(), abs=0.05)


def test_the_gloo_check_started_early_is_the_doctors_and_runs_once(monkeypatch):
    """kc train starts the doctor's Gloo check before it imports the flow; the doctor then takes that result (a real
    two-process Gloo all_reduce) instead of running the check a second time."""
    from kuangchao_core.sched import doctor

    calls = []
    real = doctor.check_gloo

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(doctor, "check_gloo", counted)
    assert doctor.start_gloo_check(60.0, reuse_gloo_s=0)
    report = doctor.run_doctor(
        None, skip=("versions", "cuda", "nodes", "checkpoint_storage", "mlflow", "prefect"), reuse_gloo_s=0
    )
    assert [c.name for c in report.checks] == ["gloo"] and report.checks[0].ok, report.checks
    assert len(calls) == 1  # the early one; before: the doctor ran its own
    doctor.run_doctor(None, skip=("versions", "cuda", "nodes", "checkpoint_storage", "mlflow", "prefect"))
    assert len(calls) == 2  # taken once: a later doctor runs the check itself


def test_the_first_step_is_the_step_feeds_not_the_first_logged_line():
    """With log_interval 250 the first step line says step 250; rank 0's step feed (``steps`` batches of every step)
    says step 1 far earlier: start-up ends there, and the end is the first sighting of the last step."""
    clock = phases.PhaseClock(time.time())
    clock.on_event({"event": "steps", "first_step": 1, "step": 9})
    first_seen = clock.first_step[1]
    time.sleep(0.02)
    clock.on_event({"event": "step", "step": 250})  # the first logged line, later
    clock.on_event({"event": "steps", "first_step": 240, "step": 250})  # the same last step, seen again
    assert clock.first_step == (1, first_seen) and clock.startup()["first_step"] == 1
    assert clock.last_step[0] == 250 and clock.last_step[1] < time.time()
    seen = clock.last_step[1]
    clock.on_event({"event": "steps", "first_step": 250, "step": 250})
    assert clock.last_step[1] == seen  # a step already seen does not move the end
