"""Ctrl-C and SIGTERM of ``kc train`` stop it like torchrun (issue 45 §1).

The attack, as a user met it: Ctrl-C (SIGINT to the terminal's process group) mid-training; Prefect's temporary
server died first, the flow failed on WebSocket errors, was still alive 2 minutes later, and a second Ctrl-C printed
~386 lines of tracebacks. Here a real ``kc train`` of the tiny model (2 Gloo ranks on the CPU, real Prefect — its
temporary server, or the session's server — and a real MLflow store) is started in a session of its own, as a
terminal starts it, and once it has passed a checkpoint and trains on, its process group is sent the signal:

- it exits ``128 + N`` (130 for SIGINT, 143 for SIGTERM) within 15 s, printing after the signal only the one line
  ``interrupted at step S; last checkpoint step C; resume with: kc train …`` (no traceback anywhere);
- no process is left of any session it had (its own, torchrun's, the temporary server's guard);
- its flow run is Cancelled (read from the temporary server's own database, or from the session's Prefect API) and
  its MLflow run KILLED; checkpoint C verifies; and the printed command continues from step C.
- a second Ctrl-C while the ranks have not reached their next check ends the process at once, with the same line.

The fast tests (the line, the handler, the topology probe's processes) are in ``tests/test_interrupt_parts.py``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from kuangchao_core.obs.voice import message_of, parse
from kuangchao_core.sched import interrupt
from tests.proc_sessions import left_in, live, nothing_left, sessions_below, wait_for

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
DEADLINE_S = 15.0
LINE = re.compile(r"^interrupted at step (\d+); last checkpoint step (\d+); resume with: (kc train .*--resume auto)$")
#: the progress lines a run prints while it trains (one may be on its way when the signal lands)
PROGRESS = re.compile(r"^(step \d+/\d+ |checkpoint saved at step \d+$|training \S+: steps )")


# --- a real kc train ----------------------------------------------------------------------------------------------


class Run:
    """One ``kc train`` of the tiny model in a session of its own (its process group is what a terminal signals)."""

    def __init__(self, tmp_path: Path, env: dict[str, str], log_interval: int) -> None:
        self.tmp, self.env = tmp_path, env
        self.task = f"kc-int-{uuid.uuid4().hex[:6]}"
        self.overrides = [
            f"task.name={self.task}",
            "train.steps=2000",
            "train.warmup_steps=0",
            f"train.log_interval={log_interval}",
            "train.eval_interval=100000",
            "checkpoint.interval=5",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            "checkpoint.resume=never",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
            "tracking.log_model=false",
            "tracking.register_model=null",
            "tracking.system_metrics=false",
            f"permission.audit_log={tmp_path / 'audit'}",
        ]
        self.proc = self.start(["--config", TINY, *[a for o in self.overrides for a in ("--set", o)]], "kc")

    def start(self, args: list[str], name: str) -> subprocess.Popen:
        self.out = self.tmp / f"{name}.out"
        return subprocess.Popen(
            [sys.executable, "-m", "kuangchao.cli.main", "train", *args],
            env=self.env,
            cwd=self.tmp,
            stdout=open(self.out, "w"),  # noqa: SIM115 - the process owns it
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def checkpoints(self) -> list[int]:
        found = self.tmp.glob(f"ckpt/{self.task}/*/step_*/manifest.json")  # published: step_<8 digits> only
        return sorted(int(m.group(1)) for p in found if (m := re.fullmatch(r"step_(\d{8})", p.parent.name)))

    def training_past_a_checkpoint(self, steps_seen: bool = True) -> bool:
        """A checkpoint is published and the ranks train on past it (a later step printed, or a later checkpoint)."""
        assert self.proc.poll() is None, f"kc train ended with {self.proc.returncode}:\n{self.text()[-3000:]}"
        saved = self.checkpoints()
        if not saved:
            return False
        if not steps_seen:
            return len(saved) >= 2
        printed = [
            int(m.group(1)) for ln in self.text().splitlines() if (m := re.match(r"step (\d+)/", message_of(ln)))
        ]
        return bool(printed) and max(printed) > saved[0]

    def kill_all(self, sessions: set[int]) -> None:
        for pid, fields in live().items():
            if int(fields[3]) in sessions | {self.proc.pid}:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def _env(tmp_path: Path, api: str | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "KC_RUNS_DIR": str(tmp_path / "runs"),
    }
    for name in ("PREFECT_API_URL", "PREFECT_PROFILES_PATH", "PREFECT_API_DATABASE_CONNECTION_URL"):
        env.pop(name, None)
    env.pop(interrupt.ENV_GRACE, None)  # the default grace
    if api:
        env["PREFECT_API_URL"] = api
    return env


def _interrupt(run: Run, sig: int, second_after_s: float | None = None) -> tuple[int, float, str, set[int]]:
    """Wait until ``run`` trains past a checkpoint, send ``sig`` to its process group (again after
    ``second_after_s``); its exit code, seconds from the (last) signal to its exit, what it printed after the
    first signal, and the sessions it had."""
    assert wait_for(lambda: run.training_past_a_checkpoint(second_after_s is None), 300), run.text()[-3000:]
    sessions = sessions_below(run.proc.pid)
    assert len(sessions) >= 2, sessions  # its own, torchrun's (and the temporary server's guard's): the check bites
    assert left_in(sessions)
    before = len(run.text())
    os.killpg(run.proc.pid, sig)
    sent = time.monotonic()
    if second_after_s is not None:
        time.sleep(second_after_s)
        assert run.proc.poll() is None, "the first signal alone ended it: no second signal to test"
        os.killpg(run.proc.pid, sig)
        sent = time.monotonic()
    try:
        code = run.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - sent
    return code, took, run.text()[before:], sessions


def _the_one_line(after: str, run: Run) -> re.Match:
    said = [ln for ln in after.splitlines() if ln.strip() and not PROGRESS.match(message_of(ln))]
    assert len(said) == 1, f"more than the one line after the signal:\n{after[-4000:]}"
    assert parse(said[0]), said[0]  # in the one voice (issue 45 §3)
    m = LINE.match(message_of(said[0]))
    assert m, said[0]
    assert "Traceback" not in run.text() and "Crash detected" not in run.text(), run.text()[-4000:]
    return m


def _mlflow_status(tmp_path: Path) -> list[str]:
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        return [row[0] for row in db.execute("SELECT status FROM runs")]


def _verified(run: Run, step: int) -> None:
    from kuangchao_core.ckpt.integrity import verify_checkpoint

    (step_dir,) = run.tmp.glob(f"ckpt/{run.task}/*/step_{step:08d}")
    assert verify_checkpoint(step_dir) == []


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.serial  # a 15 s bound on a stop that checkpoints: the cores to itself
def test_ctrl_c_stops_at_a_step_boundary_cancels_the_flow_run_and_the_printed_command_resumes(tmp_path):
    """SIGINT to the process group of a ``kc train`` on Prefect's temporary server (the user's default)."""
    run = Run(tmp_path, _env(tmp_path), log_interval=1)
    sessions: set[int] = set()
    try:
        code, took, after, sessions = _interrupt(run, signal.SIGINT)
        assert code == 130 and took <= DEADLINE_S, (code, took, run.text()[-3000:])
        m = _the_one_line(after, run)
        step, saved = int(m.group(1)), int(m.group(2))
        assert saved == step == max(run.checkpoints())  # stopped at a step boundary, checkpointed there
        _verified(run, saved)
        nothing_left(sessions)
        with sqlite3.connect(tmp_path / "prefect-home" / "prefect.db") as db:  # the temporary server's own store
            assert db.execute("SELECT state_type, state_name FROM flow_run").fetchall() == [("CANCELLED", "Cancelled")]
        assert _mlflow_status(tmp_path) == ["KILLED"]

        argv = shlex.split(m.group(3))[2:] + ["--set", f"train.steps={saved + 3}"]  # the printed command, shorter
        resumed = run.start(argv, "resume")
        assert resumed.wait(timeout=400) == 0, run.text()[-3000:]
        assert f"training {run.task}: steps {saved}→{saved + 3}" in run.text(), run.text()[-3000:]
        assert max(run.checkpoints()) == saved + 3
    finally:
        run.kill_all(sessions)


def _flow_run_state(api: str, id_prefix: str) -> tuple[str, str]:
    body = json.dumps({"sort": "EXPECTED_START_TIME_DESC", "limit": 200}).encode()
    request = urllib.request.Request(
        f"{api}/flow_runs/filter", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        runs = [r for r in json.loads(response.read()) if r["id"].startswith(id_prefix)]
    assert len(runs) == 1, [r["id"] for r in runs]
    return runs[0]["state"]["type"], runs[0]["state"]["name"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.serial
def test_sigterm_under_a_prefect_server_ends_the_same_way(tmp_path, prefect_api):
    """SIGTERM (what Slurm and a Prefect cancellation send) to a ``kc train`` reporting to a Prefect server: exit
    143, the one line, nothing left, the flow run Cancelled in that server's API."""
    run = Run(tmp_path, _env(tmp_path, prefect_api), log_interval=1)
    sessions: set[int] = set()
    try:
        code, took, after, sessions = _interrupt(run, signal.SIGTERM)
        assert code == 143 and took <= DEADLINE_S, (code, took, run.text()[-3000:])
        m = _the_one_line(after, run)
        assert int(m.group(2)) == max(run.checkpoints())
        _verified(run, int(m.group(2)))
        nothing_left(sessions)
        (run_dir,) = (tmp_path / "runs" / run.task).iterdir()  # <UTC time>-<first 8 of the flow run id>
        assert _flow_run_state(prefect_api, run_dir.name.rsplit("-", 1)[1]) == ("CANCELLED", "Cancelled")
        assert _mlflow_status(tmp_path) == ["KILLED"]
    finally:
        run.kill_all(sessions)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.serial
def test_a_second_ctrl_c_ends_at_once_with_the_same_line(tmp_path):
    """The ranks check for a stop every 1000 steps here, so the first Ctrl-C leaves them its grace; the second, a
    second later, kills them and ends ``kc train`` at once: exit 130 within 5 s, the one line naming the newest
    published checkpoint (intact), nothing left, the flow run Cancelled."""
    run = Run(tmp_path, _env(tmp_path), log_interval=1000)
    sessions: set[int] = set()
    try:
        code, took, after, sessions = _interrupt(run, signal.SIGINT, second_after_s=1.0)
        assert code == 130 and took <= 5.0, (code, took, run.text()[-3000:])
        m = _the_one_line(after, run)
        step, saved = int(m.group(1)), int(m.group(2))
        assert saved == max(run.checkpoints()) and step >= saved
        _verified(run, saved)
        nothing_left(sessions)
        with sqlite3.connect(tmp_path / "prefect-home" / "prefect.db") as db:
            assert db.execute("SELECT state_type FROM flow_run").fetchall() == [("CANCELLED",)]
    finally:
        run.kill_all(sessions)
