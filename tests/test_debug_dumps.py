"""`kc debug comm` / `kc debug memory` fed by the job (issue 13, OPS.4).

- The engine's own worker (``python -m kuangchao_core.engine.worker`` under torchrun, a real dp2 Gloo job) answers
  ``SIGUSR1`` mid-training: both ranks write their group state and memory records into the run directory, and
  ``kc debug comm|memory RUN_DIR`` read them. The negative control runs the same worker with its dump handler
  unwired: the signal then yields no dumps and the check fails.
- ``kc debug comm RUN_DIR`` reports the group whose rank order differs between ranks (two processes that build a
  deliberately mismatched group and call ``dump_on_signal`` themselves), and only that one: the consistent group
  is the control.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kuangchao.cli.main import app
from tests.mp import run_distributed

RUN = CliRunner()


def _signalled(rank: int, world_size: int, run_dir: str) -> bool:
    import os
    import signal
    import time

    import torch

    import kuangchao.distributed as kc
    from kuangchao_core.engine.debug_dumps import dump_on_signal
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    dump_on_signal(run_dir, rank)
    kc.init(backend="gloo")
    ok = kc.CommGroup(ranks=[0, 1], backend="gloo", name="ok")
    kc.CommGroup(ranks=[0, 1] if rank == 0 else [1, 0], backend="gloo", name="mixed")  # the deliberate bug
    kc.all_reduce(tensor=torch.ones(2), group=ok)
    os.kill(os.getpid(), signal.SIGUSR1)  # as `kill -USR1 <pid>` of an operator would
    mine = Path(run_dir) / "debug" / "comm" / f"rank_{rank:05d}.json"
    deadline = time.time() + 20
    while not mine.exists() and time.time() < deadline:
        time.sleep(0.05)
    kc.all_reduce(tensor=torch.ones(2), group=ok)  # both dumps are written before anyone leaves
    return mine.exists()


def test_sigusr1_dumps_feed_kc_debug_and_a_mismatched_group_order_is_reported(tmp_path):
    run_dir = tmp_path / "run"
    assert run_distributed(_signalled, 2, args=(str(run_dir),), timeout=120) == [True, True]
    res = RUN.invoke(app, ["debug", "comm", str(run_dir)])
    assert res.exit_code == 1, res.output
    problems = res.output.split("problems:", 1)[1]
    assert "mixed" in problems and "order" in problems
    assert "'ok'" not in problems and " ok " not in problems  # the consistent group is not reported
    res = RUN.invoke(app, ["debug", "memory", str(run_dir)])
    assert res.exit_code == 0 and "== rank_00000" in res.output and "== rank_00001" in res.output, res.output


# ---------------------------------------------------------------------- the real worker answers SIGUSR1
#: a stand-in for the worker whose state dumps were never wired (the negative control's sabotage)
UNWIRED_WORKER = """\
import sys

import kuangchao_core.engine.debug_dumps as dumps

dumps.dump_on_signal = lambda *args, **kwargs: None
from kuangchao_core.engine.worker import main

sys.exit(main(sys.argv[1:]))
"""
DUMP_WAIT_S = 30  # how long the workers are signalled for their dumps


def _dumps_of_signalled_workers(tmp_path: Path, wired: bool) -> dict:
    """Start a dp2 job with torchrun running the engine's worker (or, unwired, the same worker without its dump
    handler), SIGUSR1 its two worker processes once they train, and return what came of it: the comm dumps the
    run directory holds (``{rank: groups}``) within DUMP_WAIT_S."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from tests.engine_helpers import tiny_job

    run_dir = tmp_path / "run"
    cfg = tiny_job(str(run_dir), task={"name": "dumps"}, parallel={"data_parallel_size": 2}, train={"steps": 100000})
    config = tmp_path / "job.yaml"
    config.write_text(cfg.to_yaml(), encoding="utf-8")
    target = ["-m", "kuangchao_core.engine.worker"]
    if not wired:
        script = tmp_path / "unwired_worker.py"
        script.write_text(UNWIRED_WORKER, encoding="utf-8")
        target = [str(script)]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "KC_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    launcher = subprocess.Popen(
        [*cmd, *target, "--config", str(config), "--resume", "never"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    comm_dir = run_dir / "debug" / "comm"
    logs = [run_dir / "logs" / f"worker-{r}.jsonl" for r in range(2)]
    found: dict = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(p.exists() and "worker ready" in p.read_text() for p in logs):
            assert launcher.poll() is None, "the job ended before its workers were ready"
            time.sleep(0.2)
        workers = psutil.Process(launcher.pid).children()
        assert len(workers) == 2, workers
        deadline = time.monotonic() + DUMP_WAIT_S
        while time.monotonic() < deadline:  # signal until both dumps show collectives issued while training
            for w in workers:
                if _alive(w):
                    os.kill(w.pid, signal.SIGUSR1)  # as `kill -USR1 <pid>` of an operator would
            time.sleep(1.0)
            found = {}
            for r in range(2):
                path = comm_dir / f"rank_{r:05d}.json"
                try:
                    found[r] = json.loads(path.read_text())
                except (OSError, ValueError):  # not written yet, or being written
                    continue
            if len(found) == 2 and all(any(g["ops_issued"] > 0 for g in d["groups"]) for d in found.values()):
                break
            if not any(_alive(w) for w in workers):  # the signal ended them: nothing more will be written
                break
    finally:
        launcher.terminate()
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(launcher.pid).children(recursive=True):
                child.kill()
            launcher.kill()
            launcher.wait()
    return {"run_dir": run_dir, "dumps": found}


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_both_workers_dumped_their_groups(result: dict) -> None:
    dumps = result["dumps"]
    assert sorted(dumps) == [0, 1], f"state dumps of ranks {sorted(dumps)} only"
    for rank, dump in dumps.items():
        whole = [g for g in dump["groups"] if sorted(g["ranks"]) == [0, 1]]
        assert whole and any(g["ops_issued"] > 0 for g in whole), (rank, dump["groups"])


@pytest.mark.slow
def test_the_engine_worker_answers_sigusr1_with_dumps_that_kc_debug_reads(tmp_path):
    result = _dumps_of_signalled_workers(tmp_path, wired=True)
    _assert_both_workers_dumped_their_groups(result)
    res = RUN.invoke(app, ["debug", "comm", str(result["run_dir"]), "--json"])
    assert res.exit_code in (0, 1), res.output  # 1: ranks caught a few collectives apart, mid-training
    assert json.loads(res.output)["ranks"] == [0, 1]
    res = RUN.invoke(app, ["debug", "memory", str(result["run_dir"])])
    assert res.exit_code == 0 and "== rank_00000" in res.output and "== rank_00001" in res.output, res.output
    # the running job's per-module records (issue 44): its blocks' parameters, the optimizer's state, the DP
    # gradient buckets from the HAL pool, their sum printed
    assert "records total" in res.output and "dp.grad_buckets" in res.output, res.output
    for rank in (0, 1):
        rep = json.loads((result["run_dir"] / "debug" / "memory" / f"rank_{rank:05d}.json").read_text())
        kinds = {(r["module"], r["kind"]) for r in rep["records"]}
        assert {("model.layers.0", "params"), ("dp.grad_buckets", "grads")} <= kinds, kinds
        assert rep["records_bytes"] == sum(r["bytes"] for r in rep["records"]) > 0


@pytest.mark.slow
def test_negative_control_a_worker_without_its_dump_handler_fails_the_check(tmp_path):
    result = _dumps_of_signalled_workers(tmp_path, wired=False)
    with pytest.raises(AssertionError):
        _assert_both_workers_dumped_their_groups(result)
