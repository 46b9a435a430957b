"""Issue 32 §1, §6: ``cluster.slurm`` validated under its field paths, the batch script and the sbatch line as
rendered (readable, the torchrun step as specified, nothing secret), and Slurm's one-line records parsed."""

from __future__ import annotations

import shlex

import pytest

from kuangchao_core.config import load_config
from kuangchao_core.errors import ConfigError
from kuangchao_core.sched.slurm import commands, script
from tests.conftest_prefect import TINY

SLURM = [
    "cluster.mode=slurm",
    "cluster.nproc_per_node=null",
    "cluster.slurm.nodes=2",
    "cluster.slurm.tasks_per_node=2",
    "parallel.data_parallel_size=2",
    "parallel.tensor_parallel_size=2",
]


def _cfg(*extra: str):
    return load_config(TINY, [*SLURM, *extra])


def _errors(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, list(overrides))
    return dict(info.value.errors)


def test_bad_slurm_settings_are_refused_under_their_field_paths():
    assert "cluster.slurm.partition" in _errors(*SLURM, "cluster.slurm.partition=debug --export=ALL")
    assert "cluster.slurm.time_limit" in _errors(*SLURM, "cluster.slurm.time_limit=soon")
    assert "cluster.slurm.extra_sbatch_args.0" in _errors(*SLURM, 'cluster.slurm.extra_sbatch_args=["--export=ALL"]')
    assert "cluster.slurm.export_env.0" in _errors(*SLURM, 'cluster.slurm.export_env=["KC_TOKENS"]')
    assert "cluster.slurm.unknown" in _errors(*SLURM, "cluster.slurm.unknown=1")
    assert "cluster.slurm.switches_wait" in _errors(*SLURM, "cluster.slurm.switches_wait=10")
    assert "cluster.slurm.checkpoint_before_limit_s" in _errors(*SLURM, "cluster.slurm.checkpoint_before_limit_s=-1")
    late = _errors(*SLURM, "cluster.slurm.time_limit=2", "cluster.slurm.checkpoint_before_limit_s=120")
    assert (
        "120 s is not less than cluster.slurm.time_limit 2 (120 s)" in late["cluster.slurm.checkpoint_before_limit_s"]
    )
    assert "cluster.slurm" in _errors("cluster.mode=slurm", "cluster.nproc_per_node=null")
    assert "cluster.slurm" in _errors("cluster.slurm.nodes=2")  # settings of a mode the job does not run in
    shape = _errors(*SLURM, "cluster.slurm.nodes=3")
    assert "cluster.slurm.nodes 3 × cluster.slurm.tasks_per_node 2 = 6" in shape["parallel.data_parallel_size"]
    assert "cluster.nproc_per_node" in _errors(*SLURM, "cluster.nproc_per_node=4")
    assert _cfg().cluster.devices == 4


def test_the_batch_script_runs_one_torchrun_per_node_on_the_first_nodes_address(tmp_path):
    cfg = _cfg(
        "cluster.slurm.partition=gpu",
        "cluster.slurm.account=proj1",
        "cluster.slurm.qos=high",
        "cluster.slurm.time_limit=01:30:00",
        "cluster.slurm.gpus_per_node=8",
        "cluster.slurm.constraint=h100",
        "cluster.slurm.exclusive=true",
        "cluster.slurm.switches=1",
        "cluster.slurm.switches_wait=10:00",
        'cluster.slurm.extra_sbatch_args=["--mem=64G"]',
    )
    text = script.render_script(cfg, tmp_path, 3, ["--config", str(tmp_path / "config.yaml")], 29601, "/py")
    sbatch = [ln.split(" ", 1)[1] for ln in text.splitlines() if ln.startswith("#SBATCH ")]
    assert sbatch == [
        f"--job-name={cfg.task.name}",
        "--nodes=2",
        "--ntasks-per-node=1",
        f"--output={tmp_path}/attempt_3/slurm/batch-%j.out",
        f"--chdir={tmp_path}",
        "--partition=gpu",
        "--account=proj1",
        "--qos=high",
        "--constraint=h100",
        "--time=01:30:00",
        "--gpus-per-node=8",
        "--exclusive",
        "--switches=1@10:00",
        "--mem=64G",
        "--signal=B:USR1@120",  # cluster.slurm.checkpoint_before_limit_s's default
    ]
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert 'scontrol show node -o "$head_node"' in text and "NodeAddr=" in text
    step = shlex.split(text[text.index("srun ") : text.index(" &\n")].replace("\\\n", " "))
    assert step[:4] == ["srun", "--ntasks-per-node=1", "--nodes=$SLURM_NNODES", "--kill-on-bad-exit=1"]
    run = step.index("kuangchao_core.sched.bound_rdzv")  # torchrun with the kc-c10d rendezvous (issue 38 item 2)
    assert step[run - 2 : run] == ["/py", "-m"] and step[run - 3] == "--"
    assert step[run + 1 :] == [
        "--nnodes=$SLURM_NNODES",
        "--nproc-per-node=2",
        "--rdzv_backend=kc-c10d",
        "--rdzv_endpoint=$head_addr:29601",
        "--rdzv_id=$SLURM_JOB_ID-3",
        "--max-restarts=0",
        "-m",
        "kuangchao_core.engine.worker",
        "--config",
        str(tmp_path / "config.yaml"),
    ]


def test_the_sbatch_line_exports_an_allow_list_and_never_a_secret(tmp_path):
    cfg = _cfg('cluster.slurm.export_env=["MY_SITE_VAR"]')
    env = {
        "PATH": "/bin",
        "PYTHONPATH": "/src",
        "MY_SITE_VAR": "1",
        "KC_TOKENS": "secret-token",
        "AWS_SECRET_ACCESS_KEY": "secret-key",
        "KC_SIGNING_KEY": "secret-pem",
    }
    argv = script.sbatch_argv(cfg, tmp_path / "job.sbatch", env)
    assert argv == ["sbatch", "--parsable", "--export=PATH,PYTHONPATH,MY_SITE_VAR", str(tmp_path / "job.sbatch")]
    step = script.step_env(cfg, {**env, "SLURM_JOB_ID": "7", "SLURM_NNODES": "2"})
    assert step == {"PATH": "/bin", "PYTHONPATH": "/src", "MY_SITE_VAR": "1", "SLURM_JOB_ID": "7", "SLURM_NNODES": "2"}
    assert "secret" not in " ".join(argv) + repr(step)
    assert script.sbatch_argv(cfg, "x", {})[2] == "--export=NONE"


def test_kc_slurm_script_runs_kc_train_inside_the_allocation(tmp_path):
    cfg = _cfg("cluster.slurm.partition=debug")
    text = script.example_script(cfg, "job.yaml", ["train.steps=5"], python="/py")
    assert "#SBATCH --nodes=2" in text and "#SBATCH --partition=debug" in text
    assert "#SBATCH --export=" in text and "ALL" not in text
    assert text.rstrip().endswith("-m kuangchao.cli.main train --config " + str((tmp_path / "x").parent.cwd() / "job.yaml")
                                  + " --set train.steps=5")  # fmt: skip


def test_slurm_records_are_read_as_scontrol_prints_them():
    line = (
        "JobId=12 JobName=kc JobState=PENDING Reason=ReqNodeNotAvail, UnavailableNodes:n3 Dependency=(null) "
        "NodeList=(null) TRES=cpu=2,node=2 Command=/tmp/job.sbatch"
    )
    rec = commands.parse_record(line)
    assert rec["JobState"] == "PENDING" and rec["NodeList"] == "(null)" and rec["TRES"] == "cpu=2,node=2"
    assert rec["Reason"] == "ReqNodeNotAvail, UnavailableNodes:n3"
    assert commands.parse_record("NodeName=n1 Arch=x86_64 NodeAddr=198.18.7.11 State=IDLE")["NodeAddr"] == "198.18.7.11"


def test_how_a_slurm_job_ended_decides_retry_or_stop():
    from kuangchao_core.errors import WorkerFailed
    from kuangchao_core.sched.slurm.job import _raise_for_end

    ok = {"n1": {"ok": True}, "n2": {"ok": True}}
    _raise_for_end("COMPLETED", {}, "7", ok)  # every node ok: the attempt succeeded
    with pytest.raises(WorkerFailed) as failed:
        _raise_for_end("COMPLETED", {}, "7", {"n1": {"ok": True}, "n2": None})
    assert "no result from node(s) n2" in failed.value.cause  # completed without a node's word is no success
    bad = {"n1": {"ok": False, "rank": 1, "cause": "stopped by the orchestrator"}, "n2": {"ok": False, "rank": 3,
           "cause": "exited with code 1", "exit_code": 1}}  # fmt: skip
    with pytest.raises(WorkerFailed) as failed:
        _raise_for_end("FAILED", {"Reason": "NonZeroExitCode"}, "7", bad)
    assert failed.value.rank == 3 and "on node n2: exited with code 1" in failed.value.cause
    assert "Slurm job 7 ended FAILED (NonZeroExitCode)" in failed.value.cause
    with pytest.raises(WorkerFailed) as failed:
        _raise_for_end("NODE_FAIL", {}, "7", {"n1": {"ok": True}, "n2": None})
    assert failed.value.node == "n2" and failed.value.rank is None  # a lost node: left out of the next attempt
    for state in ("CANCELLED", "TIMEOUT"):  # Slurm's or a user's decision: not retried, said with Slurm's state
        with pytest.raises(commands.SlurmRefused, match=f"Slurm job 7 ended {state}"):
            _raise_for_end(state, {}, "7", ok)


def test_the_time_limit_trap_marks_the_stop_file_and_waits_for_the_step(tmp_path):
    """Issue 32 §3: Slurm's ``--signal=B:USR1@…`` reaches the batch shell; its trap creates the stop file and the
    script still waits for its step, whose exit code it returns. Real bash, the step a real background process."""
    import signal
    import subprocess
    import time

    from kuangchao_core.sched.slurm import time_limit

    cfg = _cfg("cluster.slurm.checkpoint_before_limit_s=50")
    assert script.sbatch_options(cfg, tmp_path, 0)[-1] == "--signal=B:USR1@50"
    assert "--signal" not in script.example_script(cfg, "job.yaml")  # kc train inside an allocation: no trap there
    off = _cfg("cluster.slurm.checkpoint_before_limit_s=0")
    off_text = script.render_script(off, tmp_path, 0, [], 29601)
    assert (
        "--signal" not in off_text
        and "trap '" not in off_text
        and time_limit.worker_env(off.cluster.slurm, tmp_path) == {}
    )
    assert time_limit.worker_env(cfg.cluster.slurm, tmp_path) == {"KC_STOP_FILE": str(tmp_path / "time_limit_near")}

    def run(signalled: bool) -> tuple[int, float, str]:
        (tmp_path / "time_limit_near").unlink(missing_ok=True)
        body = time_limit.step_lines("bash -c 'sleep 1; exit 3'", tmp_path)
        path = tmp_path / "job.sh"
        path.write_text("\n".join(["#!/bin/bash", "set -euo pipefail", *body]) + "\n")
        started = time.monotonic()
        env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7"}
        proc = subprocess.Popen(["bash", str(path)], stdout=subprocess.PIPE, text=True, env=env)
        if signalled:
            time.sleep(0.4)
            proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=30)
        return proc.returncode, time.monotonic() - started, out

    code, took, out = run(signalled=True)
    assert code == 3 and took >= 1, (code, took, out)  # the step's own exit code, after the step ended
    assert (tmp_path / "time_limit_near").exists() and "job 7 near its time limit" in out
    code, took, out = run(signalled=False)
    assert code == 3 and not (tmp_path / "time_limit_near").exists() and out == ""


def test_every_rank_learns_of_the_stop_file_at_the_same_log_boundary_after_a_step(tmp_path):
    from kuangchao_core.engine.live_config import LiveConfig, LiveSettings

    stop = tmp_path / "time_limit_near"
    stop.write_text("now")
    live = LiveConfig(None, 0, 1, None, LiveSettings(1.0, 2, None), stop_file=str(stop))
    live.follow(0, first=True)
    assert live.stop_requested is None, "never before the first step: a checkpoint of the resumed step is no news"
    live.follow(3, first=False)
    assert live.stop_requested is None, "only at log boundaries (where rank 0 broadcasts anyway)"
    live.follow(4, first=False)
    assert live.stop_requested == 4
    assert LiveConfig(None, 0, 1, None, LiveSettings(1.0, 1, None)).follow(5, first=False).log_interval == 1

    # with the job's global config (kc config set) the flag rides in the same broadcast as its settings
    from kuangchao_core.perm import guard_api
    from kuangchao_core.perm.audit import AuditLog
    from kuangchao_core.perm.global_config import GlobalConfig

    previous = guard_api.install_guard(guard_api.AllowAll())
    try:
        gc = GlobalConfig(str(tmp_path / "global.json"), "t", audit=AuditLog(str(tmp_path / "audit"), "t"))
        gc.set("log_interval", 3)
        live = LiveConfig(gc, 0, 1, None, LiveSettings(1.0, 2, None), stop_file=str(stop))
        assert live.follow(0, first=True).log_interval == 3 and live.stop_requested is None
        assert live.follow(6, first=False).log_interval == 3 and live.stop_requested == 6
    finally:
        guard_api.install_guard(previous)
