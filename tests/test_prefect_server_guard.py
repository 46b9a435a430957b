"""Nothing left behind (issue 38 §5): Prefect's temporary server dies with ``kc train`` however it ends.

The attack: without ``PREFECT_API_URL``, Prefect's ``SubprocessASGIServer`` starts its uvicorn server as a plain
child stopped only from ``atexit``, so a ``kill -9`` (or SIGTERM) of ``kc train`` orphaned it, 200 MB and its port,
for as long as the machine ran. The negative control shows exactly that: Prefect's own class, in a process killed
with ``kill -9``, leaves its server alive 10 s later; the guarded class (:mod:`kuangchao.cli.prefect_server`) leaves
nothing. Then real ``kc train`` runs of the tiny job, without ``PREFECT_API_URL``: killed with ``kill -9`` or
SIGTERM once the flow has started, or left to finish, no process of the server remains within 10 s (none with its
command line and port, none in its process group) and its port is free. The guard itself
(:mod:`kuangchao_core.sched.group_guard`) is checked on plain commands: a grandchild in the group goes too.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kuangchao_core.sched.group_guard import group_members, start_guarded
from tests.proc_sessions import wait_for

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
SERVER_APP = "prefect.server.api.server:create_app"
GONE_WITHIN_S = 10.0


# --- finding the server's processes -------------------------------------------------------------------------------


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[2])


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def _descends_from(pid: int, ancestor: int) -> bool:
    for _ in range(64):
        stat = _stat(pid)
        if stat is None or stat[1] <= 1:
            return False
        if stat[1] == ancestor:
            return True
        pid = stat[1]
    return False


def _server_port(argv: list[str]) -> int | None:
    """The port of a Prefect API server's command line (``python -m uvicorn … create_app … --port N``), else None
    (the guard's own command line holds the server's as its arguments: it is found by its group)."""
    if argv[1:3] != ["-m", "uvicorn"] or SERVER_APP not in argv or "--port" not in argv:
        return None
    return int(argv[argv.index("--port") + 1])


def _servers_below(root: int) -> list[tuple[int, int, int]]:
    """(pid, pgid, port) of every Prefect API server process below process ``root``."""
    out = []
    for pid in _pids():
        port = _server_port(_cmdline(pid))
        if port is not None and _descends_from(pid, root):
            stat = _stat(pid)
            if stat is not None:
                out.append((pid, stat[2], port))
    return out


def _left_of(port: int, pgid: int | None) -> list[int]:
    """The live processes of the server on ``port``: by its command line, or in its process group ``pgid`` (never
    this test's own group)."""
    found = set(group_members(pgid)) if pgid and pgid != os.getpgrp() else set()
    for pid in _pids():
        if _server_port(_cmdline(pid)) == port and _alive(pid):
            found.add(pid)
    return sorted(found)


def _port_free(port: int) -> bool:
    """Nothing listens on ``port`` and a new server (``SO_REUSEADDR``, as uvicorn binds) can bind it."""
    with socket.socket() as probe:
        probe.settimeout(2)
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _assert_nothing_left(port: int, pgid: int | None, since: float, what: str) -> None:
    left = wait_for(lambda: not _left_of(port, pgid) and _port_free(port), GONE_WITHIN_S - (time.monotonic() - since))
    took = time.monotonic() - since
    assert left, f"{what}: the server on port {port} is still there {took:.1f} s later: {_left_of(port, pgid)}"
    assert took <= GONE_WITHIN_S


def _kill_all(port: int, pgid: int | None) -> None:
    """Clean-up of the test's own server processes (the negative control leaves one on purpose)."""
    for pid in _left_of(port, pgid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _env(tmp_path: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "KC_RUNS_DIR": str(tmp_path / "runs"),
    }
    for name in ("PREFECT_API_URL", "PREFECT_PROFILES_PATH", "PREFECT_API_DATABASE_CONNECTION_URL"):
        env.pop(name, None)
    return env


# --- the guard on plain commands ------------------------------------------------------------------------------------

_TREE = "sleep 300 & sleep 300 & wait"  # the command and two grandchildren, all in the guard's group


def test_the_guard_stops_its_whole_group_when_its_owner_is_killed(tmp_path):
    """An owner process starts a guarded shell with two grandchildren, then is killed with ``kill -9``: the whole
    group is gone within a few seconds. Control: the same tree started without the guard outlives its owner."""
    owner_code = (
        "import sys, subprocess, time\n"
        "from kuangchao_core.sched.group_guard import start_guarded\n"
        "cmd = ['sh', '-c', sys.argv[2]]\n"
        "p = start_guarded(cmd) if sys.argv[1] == 'guarded' else subprocess.Popen(cmd, start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    groups = {}
    try:
        for mode in ("guarded", "plain"):
            owner = subprocess.Popen(
                [sys.executable, "-c", owner_code, mode, _TREE], env=_env(tmp_path), stdout=subprocess.PIPE, text=True
            )
            pgid = int(owner.stdout.readline())
            groups[mode] = pgid
            assert wait_for(lambda pgid=pgid: len(group_members(pgid)) >= 3, 30), group_members(pgid)
            owner.kill()
            owner.wait()
            killed = time.monotonic()
            if mode == "guarded":
                assert wait_for(lambda pgid=pgid: not group_members(pgid), GONE_WITHIN_S), group_members(pgid)
                assert time.monotonic() - killed < 6  # SIGTERM ends sleep at once
            else:
                time.sleep(2)
                assert len(group_members(pgid)) >= 3, "control: an unguarded tree outlives its owner"
    finally:
        for pgid in groups.values():
            if group_members(pgid):
                os.killpg(pgid, signal.SIGKILL)


def test_the_guard_passes_on_the_commands_exit_code_and_stops_what_it_left(tmp_path):
    """The command exits 3 (uvicorn's "port in use", on which Prefect picks another port): the guard exits 3 too,
    after stopping the grandchild the command left in the group."""
    guard = start_guarded(["sh", "-c", "sleep 300 & exit 3"], grace_s=1.0)
    try:
        assert guard.wait(timeout=20) == 3
        assert wait_for(lambda: not group_members(guard.pid), 5), group_members(guard.pid)
    finally:
        if group_members(guard.pid):
            os.killpg(guard.pid, signal.SIGKILL)


def test_terminate_of_the_guard_stops_a_command_that_ignores_sigterm_within_the_grace():
    """``Popen.terminate`` of the guard (Prefect's normal stop at exit): SIGTERM to the group, SIGKILL after the
    grace to a command that ignores it; the guard exits 0."""
    guard = start_guarded(["sh", "-c", "trap '' TERM; sleep 300 & wait; wait"], grace_s=1.0)
    try:
        assert wait_for(lambda: len(group_members(guard.pid)) >= 3, 20)
        started = time.monotonic()
        guard.terminate()
        assert guard.wait(timeout=10) == 0
        assert wait_for(lambda: not group_members(guard.pid), 5), group_members(guard.pid)
        assert time.monotonic() - started < 5
    finally:
        if group_members(guard.pid):
            os.killpg(guard.pid, signal.SIGKILL)


# --- Prefect's temporary server: the attack and its fix -------------------------------------------------------------


def test_the_guarded_server_runs_prefects_own_command_and_environment(monkeypatch):
    """The guarded server's command and environment are those Prefect's ``SubprocessASGIServer`` uses (caught at
    its ``Popen``, nothing started): a Prefect upgrade that changes them fails here, not in a user's run."""
    import prefect.server.api.server as prefect_server_module

    from kuangchao.cli.prefect_server import uvicorn_command

    seen: dict = {}
    monkeypatch.setattr(prefect_server_module.subprocess, "Popen", lambda args, env: seen.update(args=args, env=env))
    plain = object.__new__(prefect_server_module.SubprocessASGIServer)  # not registered as any port's instance
    plain.port = 8123
    prefect_server_module.SubprocessASGIServer._run_uvicorn_command(plain)
    argv, env = uvicorn_command(8123)
    assert seen["args"] == argv and seen["env"] == env


_SERVER_CODE = (
    "import sys, time\n"
    "if sys.argv[1] == 'guarded':\n"
    "    from kuangchao.cli.prefect_server import GuardedASGIServer as Server\n"
    "else:\n"
    "    from prefect.server.api.server import SubprocessASGIServer as Server\n"
    "s = Server()\n"
    "s.start(timeout=180)\n"
    "print(s.port, flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "guarded"])
def test_a_killed_owner_orphans_prefects_own_server_but_not_the_guarded_one(tmp_path, mode):
    """The process that started the temporary server (as kc train did: ``SubprocessASGIServer().start()``) is
    killed with ``kill -9`` once the server answers. ``plain`` (the negative control, Prefect's own class): the
    server is still alive and holds its port 10 s later. ``guarded``: nothing of it is left within 10 s."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _SERVER_CODE, mode], env=_env(tmp_path), stdout=subprocess.PIPE, text=True
    )
    port, pgid = None, None
    try:
        line = owner.stdout.readline()
        assert line.strip().isdigit(), f"the server did not start (exit {owner.poll()})"
        port = int(line)
        ((_pid, pgid, found_port),) = _servers_below(owner.pid)
        assert found_port == port and not _port_free(port)
        owner.kill()
        owner.wait()
        killed = time.monotonic()
        if mode == "plain":
            time.sleep(GONE_WITHIN_S)
            assert _left_of(port, None) and not _port_free(port), "control: Prefect's own server outlives its owner"
        else:
            _assert_nothing_left(port, pgid, killed, "kill -9 of the owner")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if port is not None:
            _kill_all(port, pgid)


# --- real kc train runs -------------------------------------------------------------------------------------------


def _start_kc_train(tmp_path: Path, steps: int) -> tuple[subprocess.Popen, str]:
    task = f"kc-nolitter-{uuid.uuid4().hex[:6]}"
    sets = {
        "task.name": task,
        "train.steps": steps,
        "train.warmup_steps": 0,
        "train.log_interval": 1,
        "train.eval_interval": 1000,
        "checkpoint.interval": steps,
        "checkpoint.dir": str(tmp_path / "ckpt"),
        "checkpoint.resume": "never",
        "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "tracking.log_model": "false",
        "tracking.register_model": "null",
        "tracking.system_metrics": "false",
        "permission.audit_log": str(tmp_path / "audit"),
    }
    argv = [sys.executable, "-m", "kuangchao.cli.main", "train", "--config", TINY]
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    kc = subprocess.Popen(
        argv,
        env=_env(tmp_path),
        cwd=tmp_path,
        stdout=open(tmp_path / "kc.out", "w"),  # noqa: SIM115 - the process owns it
        stderr=open(tmp_path / "kc.err", "w"),  # noqa: SIM115
        start_new_session=True,  # the test's clean-up: kc train's own group (torchrun, the ranks)
    )
    return kc, task


def _output(tmp_path: Path) -> str:
    return "\n".join((tmp_path / n).read_text(errors="replace")[-3000:] for n in ("kc.out", "kc.err"))


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_kc_train_killed_once_its_flow_runs_leaves_no_prefect_server(tmp_path, sig):
    """``kc train`` without ``PREFECT_API_URL`` is sent ``sig`` once its flow runs (its run directory exists, the
    temporary server answers): within 10 s no process of the server is left and its port is free."""
    kc, task = _start_kc_train(tmp_path, steps=400)
    servers: list[tuple[int, int, int]] = []
    try:

        def flow_running() -> bool:
            assert kc.poll() is None, f"kc train ended with {kc.returncode}:\n{_output(tmp_path)}"
            servers[:] = servers or _servers_below(kc.pid)
            return bool(servers) and bool(glob.glob(str(tmp_path / "runs" / task / "*")))

        assert wait_for(flow_running, 300, 0.2), f"the flow did not start:\n{_output(tmp_path)}"
        ((_pid, pgid, port),) = servers
        assert pgid != os.getpgid(kc.pid) and not _port_free(port)  # its own group, listening
        os.kill(kc.pid, sig)
        sent = time.monotonic()
        kc.wait(timeout=30)
        _assert_nothing_left(port, pgid, sent, f"{signal.Signals(sig).name} of kc train")
    finally:
        if kc.poll() is None:
            kc.kill()
        kc.wait(timeout=30)
        try:
            os.killpg(kc.pid, signal.SIGKILL)  # its ranks: ended by their own lifeline, here at once
        except ProcessLookupError:
            pass
        for _pid, pgid, port in servers:
            _kill_all(port, pgid)


@pytest.mark.e2e
@pytest.mark.slow
def test_kc_train_that_finishes_leaves_no_prefect_server(tmp_path):
    """A short ``kc train`` without ``PREFECT_API_URL`` that ends normally (exit 0): no process of its temporary
    server is left once it has exited (2 s allowed for the kernel's bookkeeping), and the port is free."""
    kc, _task = _start_kc_train(tmp_path, steps=2)
    servers: list[tuple[int, int, int]] = []
    try:

        def seen_or_done() -> bool:
            servers[:] = servers or _servers_below(kc.pid)
            return bool(servers) or kc.poll() is not None

        assert wait_for(seen_or_done, 300, 0.2) and servers, f"no temporary server seen:\n{_output(tmp_path)}"
        assert kc.wait(timeout=400) == 0, _output(tmp_path)
        ended = time.monotonic()
        ((_pid, pgid, port),) = servers
        # stopped before kc train exits (Prefect's stop at exit waits for the guard, the guard for its group)
        assert wait_for(lambda: not _left_of(port, pgid) and _port_free(port), 2.0), _left_of(port, pgid)
        assert time.monotonic() - ended < GONE_WITHIN_S
    finally:
        if kc.poll() is None:
            kc.kill()
        kc.wait(timeout=30)
        for _pid, pgid, port in servers:
            _kill_all(port, pgid)
