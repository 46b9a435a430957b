"""Cancelling the Prefect flow run of a running ``kc train`` stops the job; a Slurm time limit close to running out
checkpoints first (issue 32 §3).

``kc train`` runs its flow in its own process (no worker to kill it): the process follows its flow run's state and,
once the flow run is Cancelling (``prefect flow-run cancel``, as here, or the UI's Cancel), stops the
training (a Slurm job is cancelled with ``scancel``, every rank ends) and the flow run ends Cancelled, not Failed and not
retried. On the real Slurm lab (``slurm_cluster``) and in local mode, with the session's Prefect server.

A job with a one-minute time limit and ``--signal=B:USR1@50`` (``cluster.slurm.checkpoint_before_limit_s``) is
signalled by Slurm 10 to 60 s after it starts (Slurm's timer is coarse): every rank checkpoints the same step and the
job ends itself before the limit; ``kc train --resume auto`` continues from that step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType

from kuangchao_core.obs.voice import message_of
from kuangchao_core.sched.heartbeat import read_beat
from kuangchao_core.sched.lifeline import wait_gone
from tests.test_slurm import _finish, _overrides, _slurm, _start_train, _summary, _wait

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

#: cancelled to ended: the poll (2 s), the launcher's unwinding, the flow's end
CANCEL_BOUND_S = 60


def _running_flow_run(task: str):
    """The running ``kuangchao-train`` flow run of ``task`` on the session's Prefect server (None: not yet)."""
    running = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=running, limit=200)
    mine = [r for r in runs if f"task.name={task}" in (r.parameters.get("overrides") or [])]
    return mine[0] if mine else None


def _beating_pids(proc, tmp_path: Path, ranks: int) -> tuple[Path, list[int]]:
    """The run directory and the pids of its ``ranks`` ranks, once all of them beat (fails as soon as ``kc train``
    ends instead)."""

    def beating():
        assert proc.poll() is None, f"kc train ended early: {_finish(proc, tmp_path)[1][-3000:]}"
        hb = next(iter(tmp_path.glob("runs/*/*/attempt_0/heartbeat")), None)
        found = list(hb.glob("rank_*.hb")) if hb is not None else []
        return found if len(found) == ranks else None

    beats = _wait(beating, 400, f"{ranks} ranks beating")
    pids = [b.pid for f in beats if (b := read_beat(f)) is not None]
    return beats[0].parents[2], pids


def _cancel_and_check(proc, tmp_path: Path, task: str, pids: list[int], api: str) -> tuple[str, object]:
    """Cancel the flow run of ``task`` with ``prefect flow-run cancel`` (the README's command); ``kc train`` must end
    within the bound, non-zero, with one line saying so; its ranks gone; the flow run Cancelled. Returns the output
    and the flow run."""
    flow_run = _wait(lambda: _running_flow_run(task), 60, "the running flow run")
    cancelled = time.monotonic()  # the bound includes the Prefect CLI's own start
    cli = subprocess.run(
        [sys.executable, "-m", "prefect", "flow-run", "cancel", str(flow_run.id)],
        env={**os.environ, "PREFECT_API_URL": api},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    code, output = _finish(proc, tmp_path, timeout_s=CANCEL_BOUND_S + 60)
    took = time.monotonic() - cancelled
    print(f"kc train ended {took:.1f} s after `prefect flow-run cancel` started")  # the figure, with pytest -s
    assert took < CANCEL_BOUND_S, f"kc train ended {took:.0f} s after the cancel: {output[-3000:]}"
    assert code == 1, output[-3000:]
    lines = [
        ln for ln in output.splitlines() if message_of(ln).startswith("kc train: the run was cancelled in Prefect")
    ]
    assert len(lines) == 1 and str(flow_run.id) in lines[0], output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert len(pids) >= 2 and wait_gone(pids, 30) == [], "ranks still running after the cancel"
    with get_client(sync_client=True) as client:
        final = client.read_flow_run(flow_run.id).state
    assert final.type == StateType.CANCELLED, f"flow run ended {final.type}: {final.message}"
    return output, flow_run


def test_cancelling_the_flow_run_scancels_the_slurm_job_and_ends_every_rank(
    slurm_cluster, prefect_api, tmp_path
):  # fmt: skip
    lab = slurm_cluster
    task = "kc-slurm-prefect-cancel"
    overrides = _overrides(
        tmp_path,
        task,
        tmp_path,
        **_slurm(lab, nodes=2, tasks=1),
        **{"parallel.tensor_parallel_size": 1, "train.steps": 5000, "cluster.max_restarts": 2},
    )
    proc = _start_train(lab, tmp_path, overrides, {"PREFECT_API_URL": prefect_api})
    try:
        run_dir, pids = _beating_pids(proc, tmp_path, 2)
        job = json.loads((run_dir / "attempt_0/slurm/submit.json").read_text())["job_id"]
        _cancel_and_check(proc, tmp_path, task, pids, prefect_api)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert job not in lab.run(["squeue", "-h", "-o", "%i"]).stdout.split(), "the Slurm job is still queued"
    states = (run_dir / "attempt_0/slurm/states.log").read_text()
    assert f"Slurm job {job}: RUNNING" in states, states
    assert not list(run_dir.glob("attempt_1")), "a cancelled run is not resubmitted"
    sacct = _wait(
        lambda: (s if (s := lab.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State"]).stdout.strip())
                 not in ("", "RUNNING", "COMPLETING") else None), 120, "sacct showing the job's end",
    )  # fmt: skip
    assert sacct.startswith("CANCELLED"), sacct


def test_cancelling_the_flow_run_of_a_local_job_ends_its_ranks(prefect_api, tmp_path):
    task = "kc-local-prefect-cancel"
    overrides = _overrides(
        tmp_path,
        task,
        tmp_path,
        **{
            "parallel.tensor_parallel_size": 1,
            "cluster.nproc_per_node": 2,
            "train.steps": 5000,
            "cluster.max_restarts": 2,
        },
    )
    local = SimpleNamespace(env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    proc = _start_train(local, tmp_path, overrides, {"PREFECT_API_URL": prefect_api})
    try:
        run_dir, pids = _beating_pids(proc, tmp_path, 2)
        _cancel_and_check(proc, tmp_path, task, pids, prefect_api)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not list(run_dir.glob("attempt_1")), "a cancelled run is not restarted"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "cancelled in Prefect", summary
    from mlflow.tracking import MlflowClient

    status = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(summary["mlflow_run_id"]).info.status
    assert status == "KILLED", status


def test_a_time_limit_close_to_running_out_checkpoints_every_rank_and_resume_auto_continues(
    slurm_cluster, prefect_api, tmp_path
):  # fmt: skip
    lab = slurm_cluster
    task = "kc-slurm-time-limit"
    limit = {"cluster.slurm.time_limit": "1", "cluster.slurm.checkpoint_before_limit_s": 50}
    first = _overrides(
        tmp_path,
        task,
        tmp_path,
        **{**_slurm(lab, nodes=2, tasks=1), **limit},
        **{"parallel.tensor_parallel_size": 1, "train.steps": 5000, "checkpoint.interval": 1000},
    )
    started = time.monotonic()
    code, output = _finish(_start_train(lab, tmp_path, first, {"PREFECT_API_URL": prefect_api}), tmp_path, 400)
    took = time.monotonic() - started
    assert code == 1, output[-3000:]
    said = [ln for ln in output.splitlines() if "reached its time limit after checkpointing at step" in ln]
    assert len(said) == 1 and message_of(said[0]).startswith("kc train failed: Slurm job"), output[-3000:]
    step = int(said[0].split("checkpointing at step ")[1].split()[0])
    assert 0 < step < 5000, said[0]
    (slurm_dir,) = tmp_path.glob("runs/*/*/attempt_0/slurm")
    job = json.loads((slurm_dir / "submit.json").read_text())["job_id"]
    script = (slurm_dir / "job.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@50" in script and "#SBATCH --time=1" in script
    signalled = (slurm_dir / "time_limit_near").stat().st_mtime  # the batch shell's trap ran
    (manifest,) = tmp_path.glob(f"ckpt/{task}/*/step_{step:08d}/manifest.json")
    assert manifest.stat().st_mtime >= signalled, "the checkpoint was written after the signal"
    assert json.loads((slurm_dir / "time_limit_near.step").read_text())["step"] == step
    assert not list(slurm_dir.parent.parent.glob("attempt_1")), "a job at its time limit is not resubmitted"
    sacct = _wait(
        lambda: (s if (s := lab.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State"]).stdout.strip())
                 not in ("", "RUNNING", "COMPLETING") else None), 120, "sacct showing the job's end",
    )  # fmt: skip
    assert sacct == "COMPLETED", f"the job ended {sacct}: it ran out instead of stopping itself ({took:.0f} s)"

    # kc train resuming "auto" (checkpoint.resume, what --resume auto sets) continues from that step: two more steps
    resume = _overrides(
        tmp_path,
        task,
        tmp_path,
        **_slurm(lab, nodes=2, tasks=1),
        **{"parallel.tensor_parallel_size": 1, "train.steps": step + 2, "checkpoint.resume": "auto"},
    )
    proc = _start_train(lab, tmp_path, resume, {"PREFECT_API_URL": prefect_api})
    code, output = _finish(proc, tmp_path, 400)
    assert code == 0, output[-3000:]
    summary = _summary(output)
    assert summary["resumed_from"] == str(manifest.parent), summary
