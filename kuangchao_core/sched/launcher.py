"""Launch one attempt of a worker group under torch's elastic agent and turn any failure into ``WorkerFailed``.

``run_workers`` starts torchrun (``python -m kuangchao_core.sched.bound_rdzv``) with ``--max-restarts 0``: restarts are decided by
``sched.recovery.supervise``, one fresh rendezvous port and heartbeat directory per attempt, so no stale store keys
(pytorch#135712) or stale beats carry over. It streams every output line (prefixed ``[rank<r>]:`` for worker lines) to
``log_sink``, watches heartbeats, and on failure names the rank and the cause:

* a worker that exits non-zero: torchrun's root-cause report gives rank, exit code and the worker's error file
  (written when the worker's entry point is wrapped in ``torch.distributed.elastic.multiprocessing.errors.record``);
  the error file's message, else the signal name (``SIGKILL``), else the rank's last output line, is the cause;
* a worker that stops beating for longer than ``heartbeat_timeout_s``: the whole process tree is SIGKILLed
  (SIGTERM would stay pending on a stopped process) and the cause is ``heartbeat lost for X s``.

The ranks never see the job's tokens in their environment: ``KC_TOKENS`` is taken out of it and each rank receives
its own tokens over the launcher's lifeline (:mod:`kuangchao_core.sched.lifeline`), which also ends the ranks when
the launcher's process dies. A node agent's launcher also watches its orchestrator's beat (``owner_beat``) and
stops its ranks when the orchestrator goes silent.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from kuangchao_core.errors import WorkerFailed
from kuangchao_core.sched import interrupt
from kuangchao_core.sched.bind_address import RDZV_BACKEND, TORCHRUN, is_loopback
from kuangchao_core.sched.heartbeat import ENV_ATTEMPT, ENV_DIR, ENV_INTERVAL, HeartbeatMonitor, read_beat
from kuangchao_core.sched.launch_spec import LaunchSpec
from kuangchao_core.sched.lifeline import Lifeline
from kuangchao_core.sched.ports import free_port  # noqa: F401 - callers take it from here
from kuangchao_core.sched.proc_tree import kill_tree, process_tree  # noqa: F401 - callers take them from here
from kuangchao_core.sched.slurm.time_limit import ENV_STOP_FILE
from kuangchao_core.sched.store_gate import bind_env

_RANK_LINE = re.compile(r"^\[rank(\d+)\]:(.*)$")
_ROOT_CAUSE = "Root Cause (first observed failure):"


@dataclass
class LaunchResult:
    """What one successful attempt left behind."""

    attempt: int
    exit_code: int
    duration_s: float
    attempt_dir: Path
    log_dir: Path
    heartbeat_dir: Path
    rdzv_endpoint: str
    lines: int = 0
    extra: dict = field(default_factory=dict)


def _parse_root_cause(text: str) -> dict | None:
    """Rank, local rank, exit code, pid, error file and message from torchrun's failure report.

    torchrun names the *first observed* failure as root cause; when a rank is killed, its peers often fail first
    with a Gloo "connection reset". So a rank that died from a signal is preferred over the reported root cause —
    except SIGTERM, which is how torchrun itself stops the surviving ranks after the first failure.
    """
    i = text.rfind(_ROOT_CAUSE)
    if i < 0:
        return None
    start = text.rfind("Failures:", 0, i)
    region = text[start if start >= 0 else i :]
    entries = [e for e in (_parse_failure_block(b) for b in re.split(r"\n\s*\[\d+\]:\s*\n", region)) if e]
    root = _parse_failure_block(text[i:])
    signalled = [e for e in entries if (e.get("exit_code") or 0) < 0 and e.get("exit_code") != -signal.SIGTERM]
    return signalled[0] if signalled else root


def _parse_failure_block(block: str) -> dict | None:
    out: dict = {}
    m = re.search(r"rank\s*:\s*(-?\d+)\s*\(local_rank:\s*(-?\d+)\)", block)
    if m:
        out["rank"], out["local_rank"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)", block)
    if m:
        out["exit_code"], out["pid"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"error_file\s*:\s*(\S+)", block)
    if m:
        out["error_file"] = m.group(1)
    m = re.search(r"traceback\s*:\s*(.*)", block)
    if m:
        out["traceback"] = m.group(1).strip()
    return out if "rank" in out else None


def _error_file_message(path: str | None) -> str | None:
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    msg = data.get("message")
    if isinstance(msg, dict):
        msg = msg.get("message")
    return str(msg).strip() if msg else None


def _signal_name(exit_code: int) -> str:
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


class _OwnerWatch:
    """Whether the orchestrator's beat file (``{"counter": n}``) stopped changing for ``lost_after_s``: it died, and
    this node's ranks must not outlive it. Measured on this process's monotonic clock, so no clocks are compared."""

    def __init__(self, path: Path, lost_after_s: float):
        self.path, self.lost_after_s = Path(path), lost_after_s
        self.counter: object = None
        self.changed_at = time.monotonic()

    def lost(self) -> str | None:
        """None while the beat moves; else why it counts as lost."""
        try:
            counter = json.loads(self.path.read_text(encoding="utf-8")[:4096]).get("counter")
        except (OSError, ValueError, AttributeError):
            counter = None
        now = time.monotonic()
        if counter is not None and counter != self.counter:
            self.counter, self.changed_at = counter, now
            return None
        silent = now - self.changed_at
        return f"no beat in {silent:.1f} s (limit {self.lost_after_s:g} s)" if silent > self.lost_after_s else None


_TORCHRUNS = (TORCHRUN, "torch.distributed.run")


def _given_command(spec: LaunchSpec, log_dir: Path) -> list[str]:
    """``spec.command`` (a torchrun command line, e.g. from a Slurm batch script) with this node's own options
    added after the torchrun module: its address, its log directory, the rank-prefixed output."""
    at = next(i for i, word in enumerate(spec.command) if word in _TORCHRUNS) + 1
    own = [*(["--local-addr", spec.local_addr] if spec.local_addr else []), "--log-dir", str(log_dir), "--tee", "3"]
    return [*spec.command[:at], *own, "--monitor-interval", str(spec.monitor_interval_s), *spec.command[at:]]


def run_workers(spec: LaunchSpec) -> LaunchResult:
    """Run one attempt of ``spec`` (a :class:`~kuangchao_core.sched.launch_spec.LaunchSpec`) and wait for the group
    to finish: ``python -m module *args`` under torchrun, watched as the spec says.

    Returns a ``LaunchResult`` when every worker exits 0; raises ``WorkerFailed(rank, cause, exit_code)`` otherwise.
    """
    interrupt.raise_if_requested()  # kc train was interrupted between attempts: none starts
    if spec.nproc < 1 or spec.nnodes < 1:
        raise ValueError(f"nproc and nnodes must be >= 1 (got nproc={spec.nproc}, nnodes={spec.nnodes})")
    if spec.nnodes > 1 and spec.master_port is None:
        raise ValueError("several nodes need an agreed master_port (the rendezvous endpoint on node 0)")
    port = spec.master_port if spec.master_port is not None else free_port(spec.master_addr)
    single_host = spec.nnodes == 1 and is_loopback(spec.master_addr)
    local_addr = spec.local_addr or (spec.master_addr if single_host else None)
    endpoint = f"{spec.master_addr}:{port}"
    attempt_dir = Path(spec.run_dir) / f"attempt_{spec.attempt}"
    own_dir = Path(spec.out_dir) if spec.out_dir is not None else attempt_dir
    log_dir = own_dir / "logs"
    hb_dir = attempt_dir / "heartbeat"
    log_dir.mkdir(parents=True, exist_ok=True)
    hb_dir.mkdir(parents=True, exist_ok=True)

    full_env = dict(os.environ)
    full_env.update(spec.env or {})
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]:"
    full_env[ENV_DIR] = str(hb_dir)
    full_env[ENV_INTERVAL] = str(spec.heartbeat_interval_s)
    full_env[ENV_ATTEMPT] = str(spec.attempt)
    full_env.pop("TORCHELASTIC_ERROR_FILE", None)
    tokens = json.loads(full_env.pop("KC_TOKENS", "") or "{}")
    # a placement may give this node's slots other mesh ranks (KC_RANK_MAP, applied by the workers themselves)
    rank_map = [int(r) for r in json.loads(full_env["KC_RANK_MAP"])] if full_env.get("KC_RANK_MAP") else None
    lifeline = Lifeline(tokens, rank_map)
    full_env.update(lifeline.env())
    key_fd = bind_env(full_env, single_host)  # where the job listens; its store key, if any, by pipe

    cmd = (
        _given_command(spec, log_dir)
        if spec.command
        else [
            spec.python,
            "-m",
            TORCHRUN,
            "--nnodes",
            str(spec.nnodes),
            "--node-rank",
            str(spec.node_rank),
            "--nproc-per-node",
            str(spec.nproc),
            "--rdzv-backend",
            RDZV_BACKEND,
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            spec.rdzv_id or f"kc-{spec.attempt}-{uuid.uuid4().hex[:8]}",
            *(["--local-addr", local_addr] if local_addr else []),
            *(["--rdzv-conf", f"is_host={str(spec.rdzv_is_host).lower()}"] if spec.rdzv_is_host is not None else []),
            "--max-restarts",
            "0",
            "--monitor-interval",
            str(spec.monitor_interval_s),
            "--shutdown-timeout",
            str(max(1, int(spec.shutdown_timeout_s))),
            "--log-dir",
            str(log_dir),
            "--tee",
            "3",
            "-m",
            spec.module,
            *[str(a) for a in spec.args],
        ]
    )

    tail: deque[str] = deque(maxlen=2000)
    last_by_rank: dict[int, str] = {}
    lock = threading.Lock()
    counter = [0]
    launcher_log = open(own_dir / "launcher.log", "a", encoding="utf-8")  # noqa: SIM115 - closed in finally

    def pump(stream) -> None:
        for raw in iter(stream.readline, ""):
            line = raw.rstrip("\n")
            with lock:
                counter[0] += 1
                tail.append(line)
                m = _RANK_LINE.match(line)
                if m and m.group(2).strip():
                    last_by_rank[int(m.group(1))] = m.group(2).strip()
                launcher_log.write(line + "\n")
                if spec.log_sink is not None:
                    try:
                        spec.log_sink(line)
                    except Exception:  # noqa: BLE001 - a broken sink must not take the launcher down
                        pass
        stream.close()

    t0 = time.monotonic()
    with interrupt.attempt(full_env.get(ENV_STOP_FILE)) as watched:  # Ctrl-C of kc train: at a step boundary
        try:
            proc = subprocess.Popen(
                cmd,
                env=full_env,
                cwd=str(spec.cwd) if spec.cwd else None,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                start_new_session=True,
                pass_fds=(key_fd,) if key_fd is not None else (),
            )
        except BaseException:
            lifeline.close()
            launcher_log.close()
            raise
        finally:
            if key_fd is not None:
                os.close(key_fd)
        lifeline.watch(proc.pid)
        watched.kill = partial(kill_tree, proc)
        readers = [threading.Thread(target=pump, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)]
        for t in readers:
            t.start()

        local_ranks = [spec.node_rank * spec.nproc + i for i in range(spec.nproc)]
        if rank_map is not None:
            local_ranks = [rank_map[s] for s in local_ranks]
        monitor = (
            HeartbeatMonitor(
                hb_dir,
                local_ranks,
                spec.heartbeat_timeout_s,
                attempt=spec.attempt,
                startup_grace_s=spec.startup_grace_s,
            )
            if spec.heartbeat_timeout_s
            else None
        )
        period = (
            0.2
            if monitor is None
            else max(0.02, min(0.25, spec.heartbeat_interval_s / 4, spec.heartbeat_timeout_s / 8))
        )

        failure: WorkerFailed | None = None
        owner = _OwnerWatch(spec.owner_beat, spec.owner_lost_after_s) if spec.owner_beat is not None else None
        try:
            while proc.poll() is None:
                time.sleep(period)
                if monitor is not None:
                    lost = monitor.poll()
                    if lost is not None and proc.poll() is None:
                        rank, silent = lost
                        beat_pids = [b.pid for r in local_ranks if (b := read_beat(hb_dir / f"rank_{r}.hb"))]
                        kill_tree(proc, beat_pids)
                        what = "heartbeat lost" if monitor.seen(rank) else "no first heartbeat"
                        failure = WorkerFailed(
                            rank,
                            f"{what} for {silent:.1f} s (timeout {spec.heartbeat_timeout_s:g} s, attempt {spec.attempt})",
                        )
                        break
                if spec.stop_file is not None and spec.stop_file.exists() and proc.poll() is None:
                    kill_tree(proc)
                    failure = WorkerFailed(None, f"stopped by the orchestrator ({spec.stop_file.read_text().strip()})")
                    break
                if owner is not None and owner.lost() and proc.poll() is None:
                    kill_tree(proc)
                    failure = WorkerFailed(None, f"stopped: the orchestrator went silent ({owner.lost()})")
                    break
                if interrupt.overdue() and proc.poll() is None:  # the ranks had their grace to stop on their own
                    kill_tree(proc)
                    break
                if spec.timeout_s is not None and time.monotonic() - t0 > spec.timeout_s and proc.poll() is None:
                    kill_tree(proc)
                    failure = WorkerFailed(
                        None, f"attempt {spec.attempt} exceeded its time limit of {spec.timeout_s:g} s"
                    )
                    break
        except BaseException:
            kill_tree(proc)
            raise
        finally:
            lifeline.close()
            for t in readers:
                t.join(timeout=5)
            launcher_log.close()
    interrupt.raise_if_requested()  # the ranks stopped (or were stopped) because this process was interrupted

    duration = time.monotonic() - t0
    if failure is not None:
        raise failure
    code = proc.returncode
    if code == 0:
        return LaunchResult(spec.attempt, 0, duration, attempt_dir, log_dir, hb_dir, endpoint, lines=counter[0])

    text = "\n".join(tail)
    info = _parse_root_cause(text)
    if info is None:
        last = next((ln for ln in reversed(tail) if ln.strip()), "")
        cause = f"torchrun exited with code {code} without a worker failure report; last output: {last[:300]}"
        raise WorkerFailed(None, cause, code)
    rank, wcode = info["rank"], info.get("exit_code", code)
    if rank_map is not None and rank is not None and 0 <= rank < len(rank_map):
        rank = rank_map[rank]  # torchrun reports its own rank; the job knows the mesh rank
    message = _error_file_message(info.get("error_file"))
    if wcode is not None and wcode < 0:
        cause = f"killed by {_signal_name(wcode)}"
        if message:
            cause += f": {message}"
    elif message:
        cause = message
    else:
        cause = f"exited with code {wcode}"
        if rank in last_by_rank:
            cause += f"; last output: {last_by_rank[rank][:300]}"
    raise WorkerFailed(rank, cause, wcode)
