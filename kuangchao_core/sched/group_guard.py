"""A helper process that nothing outlives: a command in its own process group, ended with its owner (issue 38 §5).

:func:`start_guarded` starts this module as a *guard* in a new session (its own process group) with its standard
input a pipe from the caller; the guard starts the command in that group and waits. The whole group — the command
and anything it started, grandchildren included — is stopped (SIGTERM, then SIGKILL after ``grace_s``) when:

- the guard reads end-of-file on its standard input: the caller closed the pipe, or its process ended in any way,
  ``kill -9`` included (the kernel closes the caller's end);
- the guard itself is sent SIGTERM, SIGINT or SIGHUP (``Popen.terminate`` of the guard: a normal stop);
- the command exits on its own: what it left behind in the group is stopped, and the guard exits with the
  command's code (a signal ``N`` as ``128 + N``), so the caller's ``Popen.poll`` reads the command's outcome.

The command is started with ``PR_SET_PDEATHSIG`` (SIGKILL), so even a ``kill -9`` of the guard takes the command
with it. Being in its own group, the command never sees the terminal's Ctrl-C meant for the caller; the caller's
end of the pipe decides. Used for Prefect's temporary API server under ``kc train``
(``kuangchao/cli/prefect_server.py``), which otherwise outlived a killed ``kc train``, its port and 200 MB with it.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time

#: how long the group gets between SIGTERM and SIGKILL
DEFAULT_GRACE_S = 3.0
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.2


def start_guarded(cmd: list[str], env: dict[str, str] | None = None, grace_s: float = DEFAULT_GRACE_S, **popen):
    """Start ``cmd`` under a guard in a new session; the guard's ``Popen`` (its ``pid`` is the group's id). Keep the
    returned object: its ``stdin`` is the lifeline (closing it, or this process ending, stops the group);
    ``terminate()`` stops the group too, ``poll()`` reads the command's exit code. ``popen``: more ``Popen``
    arguments (``stdout``, ``stderr``, ``cwd``) for the guard, whose streams the command inherits."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    boot = (
        f"import sys; sys.path.insert(0, {root!r}); from kuangchao_core.sched.group_guard import main; sys.exit(main())"
    )
    argv = [sys.executable, "-c", boot, "--grace", str(grace_s), "--", *cmd]
    return subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, start_new_session=True, **popen)


def group_members(pgid: int) -> list[int]:
    """The live processes (zombies left out) of process group ``pgid``, from ``/proc``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(name))
    return out


def _die_with_parent() -> None:  # in the command's process, between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _stop_group(grace_s: float) -> None:
    """SIGTERM to every other process of this group, then SIGKILL to what is left after ``grace_s``."""
    me, group = os.getpid(), os.getpgrp()
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        others = [p for p in group_members(group) if p != me]
        for pid in others:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while others and time.monotonic() < deadline:
            time.sleep(0.05)
            try:  # reap the command (the others are not this process's children)
                os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pass
            others = [p for p in group_members(group) if p != me]
        if not others:
            return


def _parse(argv: list[str]) -> tuple[float, list[str]]:
    grace = DEFAULT_GRACE_S
    if argv[:1] == ["--grace"]:
        grace, argv = float(argv[1]), argv[2:]
    if argv[:1] != ["--"] or len(argv) < 2:
        raise SystemExit("usage: group_guard [--grace S] -- COMMAND [ARG ...]")
    return grace, argv[1:]


def main(argv: list[str] | None = None) -> int:
    """Run the guard: start the command, wait for end-of-file, a stop signal or the command's end; stop the group.
    Returns the exit code (the command's when it ended on its own, else 0)."""
    grace_s, cmd = _parse(list(sys.argv[1:] if argv is None else argv))
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)  # noqa: PLW1509 - no threads
    stdin_open = True
    while not stop and child.poll() is None:
        if not stdin_open:
            time.sleep(_POLL_S)
            continue
        try:
            ready, _, _ = select.select([0], [], [], _POLL_S)
            if ready and not os.read(0, 4096):
                break  # end-of-file: the owner is gone
        except OSError:  # no standard input at all: only signals and the command's end count
            stdin_open = False
    code = child.poll()
    _stop_group(grace_s)
    if code is None:
        return 0
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
