"""The process tree of a launched group, from Linux ``/proc``, and its SIGKILL (:func:`kill_tree`): the launcher's
way to end an attempt whose ranks may sit in sessions of their own."""

from __future__ import annotations

import os
import signal
import subprocess


def _proc_children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name is in parentheses and may itself contain spaces or parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def process_tree(pid: int) -> list[int]:
    """``pid`` and all of its descendants (Linux ``/proc``), parents first."""
    children = _proc_children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_tree(proc: subprocess.Popen, extra_pids: list[int] = ()) -> None:
    """SIGKILL ``proc``, every descendant and ``extra_pids`` (workers may sit in sessions of their own)."""
    pids = process_tree(proc.pid) + [p for p in extra_pids if p]
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
