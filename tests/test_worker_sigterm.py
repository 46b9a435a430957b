"""The worker of the README's Prefect-server section stops on SIGTERM (issue 45 item 4).

The attack, as a user met it: ``prefect worker start --pool … &`` from a script, then ``kill %1``: the worker kept
running. Prefect's command turns its first SIGTERM into a SIGINT to itself, and a command started in the background
of a non-interactive shell inherits SIGINT ignored. Here both workers are started as such a shell starts them
(SIGINT ignored), on the session's real Prefect server, and sent SIGTERM once they poll: ``kc worker start`` exits
143 within 10 s with one line; Prefect's own command (the control, showing the conditions reproduce the bug) is
still running 5 s later.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kuangchao_core.obs.voice import LINE

ROOT = Path(__file__).resolve().parent.parent


def _in_the_background(argv: list[str], api: str, out: Path) -> subprocess.Popen:
    """``argv`` as ``cmd &`` in a non-interactive shell starts it: SIGINT ignored."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": api, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        argv,
        env=env,
        cwd=out.parent,
        stdout=open(out, "w"),  # noqa: SIM115 - the process owns it
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # noqa: PLW1509 - no threads here
        start_new_session=True,
    )


def _polling(proc: subprocess.Popen, out: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while "started!" not in out.read_text(errors="replace"):
        assert proc.poll() is None, out.read_text(errors="replace")
        assert time.monotonic() < deadline, f"no worker polling after {timeout_s:.0f} s:\n{out.read_text()}"
        time.sleep(0.2)


def test_kc_worker_stops_on_sigterm_where_prefects_own_command_does_not(prefect_api, tmp_path):
    pool = f"kc-worker-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "kc-worker.out"
    kc = _in_the_background(
        [sys.executable, "-m", "kuangchao.cli.main", "worker", "start", "--pool", pool], prefect_api, out
    )
    try:
        _polling(kc, out)
        kc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = kc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        if kc.poll() is None:
            kc.kill()
    text = out.read_text(errors="replace")
    assert code == 143 and took <= 10.0, (code, took, text)
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert all(LINE.match(line) for line in lines), text  # the worker's lines in kc's one voice too
    assert lines[-1].endswith("kc: kc worker: stopped by SIGTERM"), text

    # the control: Prefect's own command, started the same way, ignores the same SIGTERM
    out = tmp_path / "prefect-worker.out"
    prefect = _in_the_background([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool], prefect_api, out)
    try:
        _polling(prefect, out)
        prefect.send_signal(signal.SIGTERM)
        time.sleep(5.0)
        assert prefect.poll() is None, (
            f"Prefect's worker stopped on SIGTERM: the control no longer bites\n{out.read_text()}"
        )
    finally:
        prefect.kill()
        prefect.wait(timeout=30)
