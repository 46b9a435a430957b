"""``sched/fast_exit.exit_now``: a finished rank or torchrun ends without the interpreter's teardown, and nothing it
wrote is lost — the standard streams (block-buffered into a pipe) and the logging handlers' files are flushed first,
and the exit code is the one asked for. The control ends the same process with a bare ``os._exit``: the buffered
output is gone, so the flush is what keeps it."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import logging, os, sys
logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
logging.getLogger("kc").info("the last log line")
print("the last output line", end="")  # no newline, into a pipe: it sits in the buffer
if sys.argv[2] == "exit_now":
    from kuangchao_core.sched.fast_exit import exit_now
    exit_now(3)
os._exit(3)
"""


def _run(tmp_path, how: str) -> tuple[subprocess.CompletedProcess, str]:
    log = tmp_path / f"{how}.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # the streams buffered, as under torchrun
    argv = [sys.executable, "-c", SCRIPT, str(log), how]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=env)
    return out, log.read_text() if log.exists() else ""


def test_exit_now_keeps_the_output_and_the_log_and_the_exit_code(tmp_path):
    out, log = _run(tmp_path, "exit_now")
    assert out.returncode == 3, out.stderr
    assert out.stdout == "the last output line"
    assert "the last log line" in log

    control, _ = _run(tmp_path, "os_exit")  # the same end without the flush
    assert control.returncode == 3, control.stderr
    assert control.stdout == ""
