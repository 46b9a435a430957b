"""State dumps a running job writes for ``kc debug comm`` and ``kc debug memory`` (OPS.4).

Every rank writes ``<run_dir>/debug/comm/rank_<r>.json`` (its communication groups: order, backend, operations
issued, last sequence number) and ``<run_dir>/debug/memory/rank_<r>.json`` (allocation records per module) when a
collective times out and whenever the process receives ``SIGUSR1`` (``kill -USR1`` every worker of a hung job, then
``kc debug comm RUN_DIR``). The signal is taken by a thread of its own (:func:`dump_on_signal` blocks it in the
caller and in every thread started after), so a rank stuck inside a collective still answers.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

log = logging.getLogger("kuangchao.engine.debug_dumps")


def dump_dir(run_dir: str | os.PathLike, kind: str) -> Path:
    """``<run_dir>/debug/<kind>`` (``comm`` or ``memory``)."""
    return Path(run_dir) / "debug" / kind


def write_state_dumps(run_dir: str | os.PathLike, rank: int, reason: str) -> list[Path]:
    """Write this rank's group and memory dumps into the run directory; returns the files."""
    from kuangchao_core.comm.state import write_dump
    from kuangchao_core.hal.memory import write_memory_report

    name = f"rank_{rank:05d}.json"
    paths = [
        write_dump(dump_dir(run_dir, "comm") / name, rank),
        write_memory_report(dump_dir(run_dir, "memory") / name),
    ]
    log.warning("rank %d wrote its state dumps (%s): %s", rank, reason, ", ".join(map(str, paths)))
    return paths


def dump_on_signal(run_dir: str | os.PathLike, rank: int, signum: int = signal.SIGUSR1) -> threading.Thread:
    """Answer ``signum`` with :func:`write_state_dumps` from a daemon thread; call before starting other threads.
    Also writes them when a collective times out."""
    from kuangchao_core.comm import diag

    def answer(reason: str) -> None:
        try:
            write_state_dumps(run_dir, rank, reason)
        except Exception as exc:  # a failed dump is reported, the job goes on
            log.error("rank %d: state dumps failed: %s", rank, exc)

    # threads started before this one (torch's) may still take the signal: never with the default action (exit)
    signal.signal(signum, lambda *_: threading.Thread(target=answer, args=("signal",), daemon=True).start())
    signal.pthread_sigmask(signal.SIG_BLOCK, {signum})

    def wait() -> None:
        while True:
            signal.sigwait({signum})
            answer(f"signal {signal.Signals(signum).name}")

    thread = threading.Thread(target=wait, name="kc-state-dumps", daemon=True)
    thread.start()
    diag.TIMEOUT_HOOKS.append(lambda: write_state_dumps(run_dir, rank, "collective timeout"))
    return thread
