"""Slurm as the engine of multi-node jobs (issue 32), on a real Slurm cluster: ``kc train`` with ``cluster.mode:
slurm`` submits the job with ``sbatch`` and follows it; each node's ranks get their tokens from a file of their
own, never through anything Slurm stores.

The cluster is the ``slurm_cluster`` fixture (``tests/conftest_slurm.py``: three nodes ``n1..n3`` as network
namespaces, partition ``debug``); ``kc train`` runs in the root namespace as a user's login node would.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from kuangchao_core.obs.voice import parse
from tests.conftest_prefect import TINY, loss_history
from tests.reference_runs import one_process_reference
from tests.tolerances import FP32_LOSS_REL

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8
#: what a capability token starts with (``kuangchao_core.perm.tokens``): no token may appear in what Slurm keeps
TOKEN_PREFIX = "kc1.cap."

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


def _wait(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what} did not happen within {timeout_s:g} s")


def _overrides(workdir: Path, task: str, store: Path, **extra) -> list[str]:
    base = {
        "task.name": task,
        "train.steps": STEPS,
        "train.warmup_steps": 2,
        "train.log_interval": 1,
        "train.eval_interval": 1000,
        "checkpoint.interval": 4,
        "checkpoint.dir": "ckpt",  # relative: resolved from where kc train runs (issue 32 §8)
        "tracking.uri": f"sqlite:///{store / 'mlflow.db'}",
        "permission.audit_log": "audit",
        "parallel.data_parallel_size": 2,
        "parallel.tensor_parallel_size": 2,
        "parallel.micro_batch_size": 2,
        "cluster.nproc_per_node": "null",
        "cluster.heartbeat_timeout_s": 60,
        "cluster.max_restarts": 0,
        **extra,
    }
    return [f"{k}={v}" for k, v in base.items()]


def _slurm(lab, nodes: int = 2, tasks: int = 2, partition: str | None = None) -> dict[str, object]:
    return {
        "cluster.mode": "slurm",
        "cluster.slurm.nodes": nodes,
        "cluster.slurm.tasks_per_node": tasks,
        "cluster.slurm.partition": partition or lab.partition,
        "cluster.slurm.time_limit": "15:00",
        "cluster.slurm.slurm_conf": str(lab.conf),
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """The module's MLflow store directory."""
    return tmp_path_factory.mktemp("slurm-mlflow")


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory, store) -> list[float]:
    """The dp2×tp2 job's losses from one process (same global batch: four micro-batches of 2 per step)."""
    tmp = tmp_path_factory.mktemp("slurm-ref")
    return one_process_reference(
        TINY, _overrides(tmp, "kc-slurm-ref", store) + [f"checkpoint.dir={tmp / 'ckpt'}"], STEPS, 2
    )


def _start_train(
    lab, workdir: Path, overrides: list[str], extra_env: dict[str, str], prefix: tuple[str, ...] = ()
) -> subprocess.Popen:
    """``kc train`` from ``workdir`` in the background (after ``prefix``: ``salloc …``), its output in files."""
    env = {
        **lab.env,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PREFECT_HOME": str(workdir / "prefect-home"),
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    for name in ("PREFECT_API_URL", "KC_RUNS_DIR", "PREFECT_PROFILES_PATH"):
        env.pop(name, None)  # the run directory is runs/ under workdir, resolved there (issue 32 §8)
    env.update(extra_env)  # PREFECT_API_URL: the session's Prefect server (no temporary one per kc train)
    argv = [*prefix, sys.executable, "-m", "kuangchao.cli.main", "train", "--config", TINY, "--json"]
    return subprocess.Popen(
        argv + [a for o in overrides for a in ("--set", o)],
        env=env,
        cwd=workdir,
        stdout=open(workdir / "kc-train.out", "w"),  # noqa: SIM115 - the process owns it
        stderr=open(workdir / "kc-train.err", "w"),  # noqa: SIM115
    )


def _finish(proc: subprocess.Popen, workdir: Path, timeout_s: float = 600) -> tuple[int, str]:
    proc.wait(timeout=timeout_s)
    return proc.returncode, (workdir / "kc-train.out").read_text() + (workdir / "kc-train.err").read_text()


def _summary(text: str) -> dict:
    decoder = json.JSONDecoder()
    for start in reversed([i + 1 for i, c in enumerate(text) if c == "\n" and text[i + 1 : i + 2] == "{"]):
        try:
            found, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(found, dict) and "mlflow_run_id" in found:
            return found
    raise AssertionError(f"no run summary in the output: {text[-3000:]}")


def _assert_losses(store: Path, summary: dict, reference: list[float]) -> None:
    history = loss_history(f"sqlite:///{store / 'mlflow.db'}", summary["mlflow_run_id"])
    assert [s for s, _ in history] == list(range(1, STEPS + 1)), "every step exactly once in MLflow"
    for (step, got), want in zip(history, reference, strict=True):
        assert abs(got - want) <= FP32_LOSS_REL * abs(want), (step, got, want)


def _job_processes(run_dir: Path) -> dict[int, tuple[str, bytes]]:
    """Every process of the job on this machine (srun, the nodes' launchers, torchrun, the ranks): its command
    line and its start-up environment."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            if str(run_dir).encode() not in cmdline:
                continue
            out[int(entry)] = (
                cmdline.replace(b"\0", b" ").decode(errors="replace"),
                Path(f"/proc/{entry}/environ").read_bytes(),
            )
        except OSError:
            continue
    return out


def _what_slurm_keeps(lab, job: str, run_dir: Path) -> dict[str, str]:
    """Everything Slurm stores or shows about ``job``, and the command lines that made it."""
    state = lab.directory / "state" / f"hash.{int(job) % 10}" / f"job.{job}"
    kept = {
        "scontrol show job -d": lab.run(["scontrol", "show", "job", "-d", job]).stdout,
        "scontrol write batch_script": lab.run(["scontrol", "write", "batch_script", job, "-"]).stdout,
        "sbatch argv": json.dumps(json.loads((run_dir / "attempt_0/slurm/submit.json").read_text())["argv"]),
        "squeue": lab.run(["squeue", "-j", job, "-o", "%all"]).stdout,
    }
    for name in ("environment", "script"):  # the controller's own copy (StateSaveLocation)
        kept[f"state/{name}"] = (state / name).read_bytes().decode("latin-1") if (state / name).exists() else ""
    return kept


def test_dp2_tp2_on_two_slurm_nodes_matches_one_process_and_slurm_keeps_no_secret(
    prefect_api, slurm_cluster, tmp_path, store, one_process_losses
):
    lab = slurm_cluster
    s3_secret = "kcs3secret" + secrets.token_hex(16)  # a user's S3 credential in kc train's environment
    overrides = _overrides(tmp_path, "kc-slurm-dp2tp2", store, **_slurm(lab))
    proc = _start_train(
        lab,
        tmp_path,
        overrides,
        {"AWS_ACCESS_KEY_ID": "kcs3id", "AWS_SECRET_ACCESS_KEY": s3_secret, "PREFECT_API_URL": prefect_api},
    )
    try:
        submitted = _wait(lambda: list(tmp_path.glob("runs/*/*/attempt_0/slurm/submit.json")), 300, "the sbatch")
        run_dir = submitted[0].parents[2]
        job = json.loads(submitted[0].read_text())["job_id"]
        _wait(lambda: len(list((run_dir / "attempt_0/heartbeat").glob("rank_*.hb"))) == 4, 400, "four ranks beating")
        kept = _what_slurm_keeps(lab, job, run_dir)  # while the job runs: the script, environment, argv it keeps
        processes = _job_processes(run_dir)
        code, output = _finish(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, output[-5000:]

    # the losses are the one-process sequence, every step once in MLflow
    summary = _summary(output)
    _assert_losses(store, summary, one_process_losses)

    # Slurm ran it: two nodes, completed; the run directory keeps the batch script, its sbatch line and the states
    assert Path(summary["run_dir"]) == run_dir and run_dir.is_relative_to(tmp_path / "runs")
    script = (run_dir / "attempt_0/slurm/job.sbatch").read_text()
    assert (
        "#SBATCH --nodes=2" in script
        and "kuangchao_core.sched.bound_rdzv" in script
        and "--rdzv_backend=kc-c10d" in script
    )
    assert kept["state/script"].rstrip("\0") == script, "Slurm runs the script the run directory keeps"
    with get_client(sync_client=True) as client:  # the flow run's artifact, on the session's Prefect server
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["kc-slurm-attempt-0"]))
        )
    artifact = next((a.data for a in found if script in str(a.data)), "")  # this run's (its script names tmp_path)
    assert script in artifact and "sbatch --parsable --export=" in artifact, "the script and sbatch line as an artifact"
    kept["Prefect artifact"] = artifact
    states = (run_dir / "attempt_0/slurm/states.log").read_text()
    assert f"Slurm job {job}: RUNNING on n[1-2]" in states and f"Slurm job {job}: COMPLETED" in states, states
    said = [p[3] for line in output.splitlines() if (p := parse(line)) and p[2] == "slurm"]  # kc train's console
    assert f"Slurm job {job}: RUNNING on n[1-2]" in said, output[-5000:]  # as it changed, in the one voice (issue 45)
    assert any(m.startswith(f"Slurm job {job}: COMPLETED") for m in said), said
    console = (tmp_path / "kc-train.out").read_text().split("\n{")[0] + (tmp_path / "kc-train.err").read_text()
    voices = [line for line in console.splitlines() if line.strip() and not parse(line)]
    assert voices == [], voices  # all but --json's summary, the ranks' MLflow lines on the nodes included
    # the nodes' facts (issue 32 §5): nodes.json, one line each in the log, and the MLflow run's artifact
    facts = json.loads((run_dir / "attempt_0/slurm/nodes.json").read_text())["nodes"]
    assert [(n["name"], n["addr"], n["cpus"]) for n in facts] == [(n, lab.node_addr[n], 2) for n in ("n1", "n2")]
    assert f"Slurm node n2 ({lab.node_addr['n2']}): " in states
    logged = MlflowClient(f"sqlite:///{store / 'mlflow.db'}").list_artifacts(
        summary["mlflow_run_id"], "slurm/attempt_0"
    )
    assert [a.path for a in logged] == ["slurm/attempt_0/nodes.json"]
    sacct = _wait(
        lambda: (s if (s := lab.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State"]).stdout.strip())
                 not in ("", "RUNNING", "COMPLETING") else None), 120, "sacct showing the job's end",
    )  # fmt: skip
    assert sacct == "COMPLETED"
    for node in ("n1", "n2"):
        assert json.loads((run_dir / f"attempt_0/nodes/{node}/result.json").read_text())["ok"] is True
    assert not list((run_dir / "tokens").glob("*/*.json")), "every node's token file is read and deleted"
    share = json.loads((run_dir / "attempt_0/slurm/share.json").read_text())
    assert share["tokens"] is True and "KC_TRUST_ROOT" in share["env"], "an enforcing job: every rank used tokens"
    assert Path(share["env"]["KC_GLOBAL_CONFIG"]).is_absolute()

    # nothing secret in anything Slurm keeps about the job, nor in the job's command lines and environments
    assert kept["state/environment"] and "SLURM_CONF" in kept["state/environment"]
    assert "PYTHONPATH" in kept["state/environment"] and "AWS_SECRET_ACCESS_KEY" not in kept["state/environment"]
    launchers = [c for c, _ in processes.values() if "kuangchao_core.sched.slurm.node" in c and "srun" not in c]
    assert len(launchers) >= 2 and any(c.startswith("srun ") for c, _ in processes.values()), processes
    texts = {**kept, **{f"pid {p} {c[:60]}": c + env.decode(errors="replace") for p, (c, env) in processes.items()}}
    for what, text in texts.items():
        assert TOKEN_PREFIX not in text, f"a capability token in {what}"
        assert s3_secret not in text and "PRIVATE KEY" not in text, f"a secret in {what}"
        assert "KC_TOKENS=" not in text, f"the tokens' variable in {what}"


def test_a_job_slurm_cannot_schedule_fails_at_once_with_slurms_reason(slurm_cluster, prefect_api, tmp_path, store):
    lab = slurm_cluster
    overrides = _overrides(
        tmp_path, "kc-slurm-badpart", store, **_slurm(lab, partition="nosuchpart"), **{"cluster.max_restarts": 2}
    )
    code, output = _finish(_start_train(lab, tmp_path, overrides, {"PREFECT_API_URL": prefect_api}), tmp_path, 300)
    assert code != 0
    assert "Invalid partition name specified" in output, output[-3000:]
    assert not list(tmp_path.glob("runs/*/*/attempt_1")), "a job Slurm refuses is not retried"
    assert not list(tmp_path.glob("runs/*/*/attempt_0/nodes")), "no rank started"
    assert "kc-slurm-badpart" not in lab.run(["squeue", "-h", "-o", "%j"]).stdout


def _lab_jobs(lab) -> set[str]:
    return set(lab.run(["sacct", "-a", "-X", "-n", "-P", "-o", "JobID", "-S", "now-1days"]).stdout.split())


def test_inside_an_salloc_allocation_kc_train_uses_its_nodes_without_a_new_job(
    slurm_cluster, prefect_api, tmp_path, store, one_process_losses
):
    """Issue 32 §2: ``salloc -N2 kc train …`` (``SLURM_JOB_ID`` set): the srun step runs on the allocation's two
    nodes, no job is submitted, and the losses are the one-process ones."""
    lab = slurm_cluster
    before = _lab_jobs(lab)
    salloc = ("salloc", "-N2", "--ntasks-per-node=1", f"--partition={lab.partition}", "--time=15:00")
    overrides = _overrides(tmp_path, "kc-slurm-salloc", store, **_slurm(lab))
    code, output = _finish(
        _start_train(lab, tmp_path, overrides, {"PREFECT_API_URL": prefect_api}, prefix=salloc), tmp_path
    )
    assert code == 0, output[-5000:]
    summary = _summary(output)
    _assert_losses(store, summary, one_process_losses)
    run_dir = Path(summary["run_dir"])
    submit = json.loads((run_dir / "attempt_0/slurm/submit.json").read_text())
    assert submit["inside_allocation"] is True and submit["argv"][0] == "bash", submit
    assert _lab_jobs(lab) - before == {submit["job_id"]}, "only the allocation: kc train submitted no job"
    states = (run_dir / "attempt_0/slurm/states.log").read_text()
    assert f"srun step of job {submit['job_id']} ended: exit code 0" in states, states
    for node in ("n1", "n2"):
        assert json.loads((run_dir / f"attempt_0/nodes/{node}/result.json").read_text())["ok"] is True


def test_scancel_of_the_job_ends_the_run_with_that_reason_and_no_rank_left(slurm_cluster, prefect_api, tmp_path, store):
    """Issue 32 §3: a job cancelled in Slurm ends ``kc train`` with Slurm's state, not retried, every rank gone."""
    from kuangchao_core.sched.heartbeat import read_beat
    from kuangchao_core.sched.lifeline import wait_gone

    lab = slurm_cluster
    overrides = _overrides(
        tmp_path, "kc-slurm-scancel", store, **_slurm(lab), **{"train.steps": 5000, "cluster.max_restarts": 2}
    )
    proc = _start_train(lab, tmp_path, overrides, {"PREFECT_API_URL": prefect_api})
    try:
        submitted = _wait(lambda: list(tmp_path.glob("runs/*/*/attempt_0/slurm/submit.json")), 300, "the sbatch")
        run_dir, job = submitted[0].parents[2], json.loads(submitted[0].read_text())["job_id"]
        beats = _wait(
            lambda: found if len(found := list((run_dir / "attempt_0/heartbeat").glob("rank_*.hb"))) == 4 else None,
            400,
            "four ranks beating",
        )
        pids = [b.pid for f in beats if (b := read_beat(f)) is not None]
        assert lab.run(["scancel", job]).returncode == 0
        code, output = _finish(proc, tmp_path, timeout_s=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0 and f"Slurm job {job} ended CANCELLED" in output, output[-3000:]
    assert not list(run_dir.glob("attempt_1")), "a job cancelled in Slurm is not resubmitted"
    assert len(pids) == 4 and wait_gone(pids, 30) == [], "ranks still running after scancel"
