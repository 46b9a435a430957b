"""``LaunchSpec``: everything one node's launcher needs to run one attempt of a worker group (issue 28 §3).

:func:`kuangchao_core.sched.launcher.run_workers` takes one spec instead of a long parameter list, so a caller
says what it launches in one value it can build, log and pass on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LaunchSpec:
    """One attempt of ``python -m module *args`` on ``nproc`` local workers.

    ``run_dir/attempt_<n>/`` receives the per-rank logs and error files (``logs/``), the heartbeat files
    (``heartbeat/``) and the full launcher output (``launcher.log``); ``env`` is added to this process's
    environment. With ``heartbeat_timeout_s`` set, a rank silent for longer (after its first beat; before it only
    if ``startup_grace_s`` is set and passes) makes the launcher SIGKILL the group. ``timeout_s`` bounds the whole
    attempt. For several nodes set ``nnodes``, ``node_rank``, ``master_addr``, ``master_port`` and a shared
    ``rdzv_id``; heartbeats are then watched for this node's ranks. ``local_addr`` is the address this node's
    agent announces (the c10d rendezvous orders nodes by it) and ``rdzv_is_host`` says whether this node hosts the
    rendezvous store (hosts that share a hostname, e.g. network namespaces, cannot tell by themselves).
    ``out_dir`` (default ``run_dir/attempt_<n>``) receives this node's logs; the heartbeat directory stays shared.
    A ``stop_file`` that appears makes the launcher SIGKILL the group (the orchestrator stopping a node's share);
    so does an ``owner_beat`` file (the orchestrator's ``{"counter": n}``) that stops changing for
    ``owner_lost_after_s`` (the orchestrator died). ``KC_TOKENS`` in ``env`` is handed out per rank over the
    lifeline. Every output line goes to ``log_sink``. ``command``: a whole torchrun command line to run instead of
    the one built from the fields (a Slurm batch script's); the launcher adds this node's address and log options.
    """

    module: str
    args: list[str]
    nproc: int
    env: dict | None
    run_dir: Path
    heartbeat_timeout_s: float | None = None
    heartbeat_interval_s: float = 1.0
    log_sink: Callable[[str], None] | None = None
    attempt: int = 0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    rdzv_id: str | None = None
    local_addr: str | None = None
    rdzv_is_host: bool | None = None
    out_dir: Path | None = None
    stop_file: Path | None = None
    startup_grace_s: float | None = None
    shutdown_timeout_s: int = 2
    monitor_interval_s: float = 0.1
    timeout_s: float | None = None
    cwd: Path | None = None
    python: str = sys.executable
    owner_beat: Path | None = None
    owner_lost_after_s: float = 10.0
    command: list[str] | None = None
