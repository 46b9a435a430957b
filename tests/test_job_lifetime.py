"""Ranks live only as long as their job, and each sees only its own token (issue 26, items 1 and 6).

Attacks stopped:
- ``kill -9`` of the orchestrator left torchrun and the workers training (their own session) until their token
  expired, writing the lineage beside the next run. Now the launcher's lifeline closes with its process and every
  rank ends within seconds. Real processes: an orchestrator process running the launcher, torchrun, two ranks.
  Negative control: a rank that does not hold the lifeline is still alive after the kill (so the test can see it).
- every rank's ``/proc/<pid>/environ`` held ``KC_TOKENS`` with every rank's token, the monitor's included. Now each
  rank receives its own tokens over the lifeline, and no process of the tree has a token in its environment.
- a node agent's ranks outlived an orchestrator that died on another machine: the agent's launcher watches the
  orchestrator's beat and stops its ranks when it goes silent.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kuangchao_core.errors import WorkerFailed
from kuangchao_core.sched.launch_spec import LaunchSpec
from kuangchao_core.sched.launcher import run_workers
from kuangchao_core.sched.lifeline import Lifeline, split_tokens, wait_gone

ROOT = Path(__file__).resolve().parent.parent

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    rank = os.environ["RANK"]
    tokens = {}
    if sys.argv[2] == "hold":
        from kuangchao_core.perm.runtime import take_environment_tokens
        tokens = take_environment_tokens()
    environ = open("/proc/self/environ", "rb").read().decode(errors="replace")
    parent = open(f"/proc/{os.getppid()}/environ", "rb").read().decode(errors="replace")
    (out / f"rank_{rank}.json").write_text(json.dumps(
        {"pid": os.getpid(), "tokens": tokens, "environ": environ, "parent_environ": parent}))
    time.sleep(float(sys.argv[3]))
    """
)

ORCHESTRATOR = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from kuangchao_core.sched.launcher import run_workers
    script, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    tokens = {f"{m}-{r}": f"SECRET-{m}-{r}" for r in (0, 1) for m in ("worker", "data_loader")}
    tokens["monitor"] = "SECRET-monitor"
    from kuangchao_core.sched.launch_spec import LaunchSpec
    run_workers(LaunchSpec("rank_script", [str(out), mode, "120"], nproc=2, run_dir=out / "run",
                           cwd=Path(script).parent, env={"KC_TOKENS": json.dumps(tokens), "PYTHONPATH": sys.argv[4]}))
    """
)


def _ranks(out: Path, n: int, timeout_s: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = sorted(out.glob("rank_*.json"))
        if len(files) == n:
            try:
                return [json.loads(f.read_text()) for f in files]
            except ValueError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not start in {timeout_s} s: {sorted(p.name for p in out.iterdir())}")


def _start_orchestrator(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "rank_script.py").write_text(RANK_SCRIPT)
    (scripts / "orchestrator.py").write_text(ORCHESTRATOR)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(scripts / "orchestrator.py"), str(scripts / "rank_script.py"), str(out), mode, str(ROOT)],
        env=env,
        cwd=str(ROOT),
    )
    return proc, out


def _torchrun_pids(orchestrator_pid: int) -> list[int]:
    """torchrun's pid: the orchestrator's child (read before the kill; it is reparented after)."""
    out = subprocess.run(["pgrep", "-P", str(orchestrator_pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.serial  # "within seconds" of a kill -9: the cores to itself
@pytest.mark.parametrize("mode", ["hold", "no_lifeline"])
def test_kill_9_of_the_orchestrator_ends_every_rank_within_seconds(tmp_path, mode):
    proc, out = _start_orchestrator(tmp_path, mode)
    try:
        ranks = _ranks(out, 2)
        pids = [r["pid"] for r in ranks] + _torchrun_pids(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        alive = wait_gone(pids, 10.0)
        if mode == "hold":
            assert alive == [], f"processes of the job alive 10 s after kill -9 of the orchestrator: {alive}"
        else:  # negative control: a rank without the lifeline outlives its orchestrator
            assert any(r["pid"] in alive for r in ranks)
    finally:
        for p in _all_pids(out):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()


def _all_pids(out: Path) -> list[int]:
    pids = []
    for f in out.glob("rank_*.json"):
        try:
            pids.append(json.loads(f.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            pass
    return pids


def test_each_rank_receives_only_its_own_tokens_and_no_environment_holds_one(tmp_path):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "rank_script.py").write_text(RANK_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    tokens = {f"{m}-{r}": f"SECRET-{m}-{r}" for r in (0, 1) for m in ("worker", "data_loader")}
    tokens["monitor"] = "SECRET-monitor"
    run_workers(
        LaunchSpec(
            "rank_script",
            [str(out), "hold", "0"],
            nproc=2,
            env={"KC_TOKENS": json.dumps(tokens), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            run_dir=tmp_path / "run",
            cwd=scripts,
        )
    )
    ranks = {int(json.loads(f.read_text())["environ"].split("RANK=")[1].split("\0")[0]): json.loads(f.read_text())
             for f in out.glob("rank_*.json")}  # fmt: skip
    assert sorted(ranks) == [0, 1]
    for r, seen in ranks.items():
        assert seen["tokens"] == {f"worker-{r}": f"SECRET-worker-{r}", f"data_loader-{r}": f"SECRET-data_loader-{r}"}
        assert "SECRET" not in seen["environ"], f"rank {r}'s /proc environ holds a token"
        assert "SECRET" not in seen["parent_environ"], "torchrun's /proc environ holds a token"
    assert "SECRET" not in (tmp_path / "run" / "attempt_0" / "launcher.log").read_text()


def test_the_lifeline_refuses_a_process_outside_the_worker_tree():
    line = Lifeline({"worker-0": "T0"})
    try:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, "RANK": "0"})
        line.watch(child.pid)  # the workers are below this process; the test process is not

        def ask() -> dict:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(line.path)
            data = s.recv(65536)
            s.close()
            return json.loads(data)

        assert "not one of this launcher's workers" in ask()["error"]
        assert line.claimed == {}
        child.kill()
        child.wait()
    finally:
        line.close()
    assert not Path(line.path).exists()


def test_split_tokens_gives_a_rank_only_its_own_modules():
    got = split_tokens({"worker-1": "a", "data_loader-1": "b", "worker-10": "c", "monitor": "m"})
    assert got == {1: {"worker-1": "a", "data_loader-1": "b"}, 10: {"worker-10": "c"}}


def test_a_node_agents_ranks_stop_when_the_orchestrator_stops_beating(tmp_path):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "rank_script.py").write_text(RANK_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    beat = tmp_path / "orchestrator.json"
    halt = threading.Event()

    def orchestrator_beats() -> None:  # beats until "the orchestrator dies"
        n = 0
        while not halt.is_set():
            n += 1
            beat.write_text(json.dumps({"counter": n}))
            time.sleep(0.2)

    t = threading.Thread(target=orchestrator_beats, daemon=True)
    t.start()
    threading.Timer(8.0, halt.set).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match="orchestrator went silent"):
        run_workers(
            LaunchSpec(
                "rank_script",
                [str(out), "hold", "120"],
                nproc=2,
                env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                run_dir=tmp_path / "run",
                cwd=scripts,
                owner_beat=beat,
                owner_lost_after_s=3.0,
            )
        )
    assert time.monotonic() - t0 < 60
    assert wait_gone(_all_pids(out), 10.0) == []
    assert len(_all_pids(out)) == 2  # the ranks did run while the orchestrator beat


ENVIRON_SCRIPT = textwrap.dedent(
    """
    import os
    import kuangchao.distributed as kc  # takes this rank's tokens from kc launch
    from kuangchao_core.perm import guard_api
    mine = open("/proc/self/environ", "rb").read()
    parent = open(f"/proc/{os.getppid()}/environ", "rb").read()
    guard = guard_api.current_guard()
    print(f"rank {os.environ['RANK']}: token in environ {b'kc1.cap.' in mine or b'kc1.cap.' in parent}; "
          f"guard {type(guard).__name__} {getattr(guard, 'module_id', None)}", flush=True)
    """
)


def test_kc_launch_ranks_hold_their_own_token_and_none_in_their_environment(tmp_path):
    script = tmp_path / "environ_check.py"
    script.write_text(ENVIRON_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KC_TOKEN")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), KC_RUNS_DIR=str(tmp_path / "runs"))
    out = subprocess.run(
        [sys.executable, "-m", "kuangchao.cli.main", "launch", "--nproc-per-node", "2", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    for rank in (0, 1):
        line = next(ln for ln in out.stdout.splitlines() if f"rank {rank}: token in environ" in ln)
        assert "token in environ False" in line, line
        assert line.endswith(f"worker-{rank}"), line  # the rank's own token was installed
