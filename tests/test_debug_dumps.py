"""`kc debug comm` / `kc debug memory` fed by the job (issue 13, OPS.4): SIGUSR1 makes every rank of a real Gloo job
write its group state and memory records into the run directory, and `kc debug comm RUN_DIR` reports the group whose
rank order differs between ranks (and only that one: the consistent group is the control)."""

from __future__ import annotations

from pathlib import Path

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
