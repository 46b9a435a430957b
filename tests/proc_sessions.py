"""Processes of a test's commands, from Linux ``/proc``: what is alive, which sessions a process tree spans, what
is left of them (tests of ``kc train``'s interrupts, issue 45)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, session, …); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def live() -> dict[int, list[str]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := stat_fields(int(name))) is not None and fields[0] not in ("Z", "X"):
            out[int(name)] = fields
    return out


def sessions_below(root: int) -> set[int]:
    """The session ids of ``root`` and every live descendant (torchrun and the server's guard start their own)."""
    procs = live()
    children: dict[int, list[int]] = {}
    for pid, fields in procs.items():
        children.setdefault(int(fields[1]), []).append(pid)
    sessions, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            sessions.add(int(procs[pid][3]))
        todo.extend(children.get(pid, []))
    return sessions


def left_in(sessions: set[int]) -> list[str]:
    return [f"{pid} {cmdline(pid)}" for pid, fields in live().items() if int(fields[3]) in sessions]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


def wait_for(cond, timeout_s: float, step_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(step_s)


def nothing_left(sessions: set[int], within_s: float = 3.0) -> None:
    """Assert that no live process is in ``sessions`` within ``within_s`` (the kernel's bookkeeping)."""
    assert wait_for(lambda: not left_in(sessions), within_s), left_in(sessions)
