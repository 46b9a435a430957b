"""The orchestrator's side of a Slurm attempt (issue 32): write it, submit it, follow it, end with its state.

1. ``attempt_<n>/slurm/``: ``share.json`` (the workers' settings, nothing secret), ``job.sbatch`` (the batch
   script, :mod:`.script`), ``submit.json`` (the resolved ``sbatch`` line, or the step inside an allocation, and the
   job id).
2. ``sbatch --parsable`` — or, when ``kc train`` runs inside an allocation (``SLURM_JOB_ID`` set), the same script
   run with ``bash`` there, its ``srun`` step on the allocation's nodes. A job Slurm refuses (a bad partition, too
   many nodes) fails at once with Slurm's words (:class:`~.commands.SlurmRefused`, not retried).
3. Follow the job (``scontrol show job``): every change of state is said and kept in ``states.log`` (pending with
   its reason, running on which nodes). A pending reason that never resolves cancels the job and fails at once.
   Once it runs, its nodes' facts (CPUs, GPUs, state, leaf switch: :mod:`.facts`) go to ``nodes.json`` and one line
   each to the log, and each node's ``launcher.log`` is tailed into the live view (steps, MLflow metrics). Once the
   job placed its ranks (its probe and ``placement.json``, :mod:`.placement`) the placement is said and each node's
   tokens are written for it alone (0600, ``perm.issuance.node_token_env``; the ranks the placement gives it).
4. The end: ``COMPLETED`` with every node ``ok`` returns; a failed rank or node raises ``WorkerFailed`` (retried);
   a job cancelled or timed out in Slurm raises ``SlurmRefused`` with that reason. If the orchestrator stops
   first, the job is cancelled (``scancel``), and its ranks stop with the orchestrator's beat in any case.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kuangchao_core.errors import WorkerFailed
from kuangchao_core.obs.run_hooks import NO_HOOKS, RunHooks
from kuangchao_core.sched.multinode import OWNER_LOST_AFTER_S, RDZV_PORTS, LogTail
from kuangchao_core.sched.node_share import ENV_TOKEN_BUNDLE, ENV_TOKENS, RESULT, Beat, node_dir, owner_beat_path
from kuangchao_core.sched.node_watch import AttemptWatch
from kuangchao_core.sched.slurm import commands, facts, placement, script, time_limit
from kuangchao_core.sched.slurm.commands import SlurmRefused
from kuangchao_core.sched.store_key import drop_attempt_key, write_attempt_key

#: states a job ends in that are Slurm's (or a user's) decision, not a failure to retry
ENDED_BY_SLURM = {"CANCELLED", "TIMEOUT", "DEADLINE", "PREEMPTED", "REVOKED"}
#: how long the nodes' launchers may take to start beating once the job runs
NODE_START_TIMEOUT_S = 180.0
#: kept out of ``share.json`` whatever the caller passed (tokens travel only in their nodes' 0600 files)
_SECRET_KEYS = (ENV_TOKENS, ENV_TOKEN_BUNDLE)


def write_attempt(cfg: Any, run_dir: Path, attempt: int, args: list[str], worker_env: dict[str, str],
                  tokens: bool, exclude: list[str] | tuple[str, ...] = (),
                  traffic: dict[str, float] | None = None) -> tuple[Path, str]:  # fmt: skip
    """``share.json`` and ``job.sbatch`` of the attempt; returns the script's path and its text. With ``traffic``
    (bytes per step of each group kind) the job probes its nodes and places its ranks first (:mod:`.placement`)."""
    out = script.slurm_dir(run_dir, attempt)
    out.mkdir(parents=True, exist_ok=True)
    share = {
        "run_dir": str(run_dir),
        "attempt": attempt,
        "nproc": cfg.cluster.slurm.tasks_per_node,
        "port": random.randint(*RDZV_PORTS),
        "env": {k: v for k, v in worker_env.items() if k not in _SECRET_KEYS}
        | time_limit.worker_env(cfg.cluster.slurm, out),
        "tokens": tokens,
        "heartbeat_timeout_s": cfg.cluster.heartbeat_timeout_s,
        "heartbeat_interval_s": cfg.cluster.heartbeat_interval_s,
        "owner_lost_after_s": OWNER_LOST_AFTER_S,
    }
    if traffic is not None:
        probe_port = random.choice([p for p in range(RDZV_PORTS[0], RDZV_PORTS[1] + 1) if p != share["port"]])
        share["placement"] = placement.request(cfg, traffic, probe_port)
    (out / "share.json").write_text(json.dumps(share, indent=1), encoding="utf-8")
    text = script.render_script(cfg, run_dir, attempt, args, share["port"], exclude=exclude,
                                placement=share.get("placement"))  # fmt: skip
    path = out / "job.sbatch"
    path.write_text(text, encoding="utf-8")
    return path, text


def _artifact(hooks: RunHooks, text: str, argv: list[str], job_id: str, attempt: int) -> None:
    try:
        hooks.artifact(
            f"Slurm job `{job_id}`, attempt {attempt}\n\n```\n{' '.join(argv)}\n```\n\n```bash\n{text}```\n",
            f"kc-slurm-attempt-{attempt}",
            "the batch script and the sbatch line of this attempt",
        )
    except Exception:  # noqa: BLE001 - outside a flow run there is no artifact to make; the files are kept
        pass


class _Follow:
    """The job's state as Slurm reports it, each change said once (``say``) and kept in ``states.log``."""

    def __init__(self, job_id: str, env: dict[str, str], out: Path, say: Callable[[str], None]):
        self.job_id, self.env, self.log, self.say = job_id, env, out / "states.log", say
        self.last: tuple[str, str, str] | None = None
        self.info: dict[str, str] = {}

    def poll(self) -> dict[str, str]:
        info = commands.show_job(self.job_id, self.env) or {"JobState": "COMPLETED?", "Reason": "forgotten"}
        self.info = info
        key = (info.get("JobState", "?"), info.get("Reason", ""), info.get("NodeList", ""))
        if key != self.last:
            self.last = key
            state, reason, nodes = key
            line = f"Slurm job {self.job_id}: {state}"
            line += f" ({reason})" if reason and reason != "None" else ""
            line += f" on {nodes}" if nodes and nodes != "(null)" else ""
            self.note(line)
        return info

    def note(self, line: str) -> None:
        """Say ``line`` and keep it in ``states.log``."""
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {line}\n")
        self.say(line)

    @property
    def state(self) -> str:
        return self.info.get("JobState", "?").split()[0]


def _results(run_dir: Path, attempt: int, nodes: list[str]) -> dict[str, dict[str, Any] | None]:
    out = {}
    for n in nodes:
        try:
            out[n] = json.loads((node_dir(run_dir, attempt, n) / RESULT).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            out[n] = None
    return out


def _raise_for_end(state: str, info: dict[str, str], job_id: str, results: dict[str, Any]) -> None:
    failed = [(n, r) for n, r in results.items() if r is not None and not r.get("ok")]
    real = [(n, r) for n, r in failed if not str(r.get("cause", "")).startswith("stopped")]
    if state == "COMPLETED" and results and not failed and all(results.values()):
        return
    reason = info.get("Reason", "")
    said = f"Slurm job {job_id} ended {state}" + (f" ({reason})" if reason and reason != "None" else "")
    if state in ENDED_BY_SLURM:
        raise SlurmRefused(said)
    missing = [n for n, r in results.items() if r is None]
    if state == "NODE_FAIL" and missing:  # Slurm found a node dead: the others' failures are its victims
        raise WorkerFailed(None, f"{said}; no result from node {missing[0]}", node=missing[0])
    if real or failed:
        name, res = (real or failed)[0]
        raise WorkerFailed(res.get("rank"), f"on node {name}: {res.get('cause')} [{said}]", res.get("exit_code"))
    raise WorkerFailed(None, f"{said}; no result from node(s) {', '.join(missing) or '-'}")


def launch_slurm_attempt(
    cfg: Any,
    run_dir: str | Path,
    attempt: int,
    args: list[str],
    worker_env: dict[str, str],
    tokens_for: Callable[[str, list[int]], None] | None,
    log_sink: Callable[[str], None] | None = None,
    say: Callable[[str], None] = print,
    poll_s: float = 0.5,
    exclude: list[str] | tuple[str, ...] = (),
    traffic: dict[str, float] | None = None,
    on_placement: Callable[[dict[str, Any]], None] | None = None,
    hooks: RunHooks = NO_HOOKS,
) -> str:
    """Run attempt ``attempt`` as a Slurm job (or a step of the allocation ``kc train`` runs in) and return the job
    id once it completed; ``tokens_for(node, ranks)`` writes a node's token file (None: no tokens, trusted mode).
    ``exclude``: nodes lost in earlier attempts, left out of the job (``--exclude``). With ``traffic`` the job
    places its ranks from its own probe (:mod:`.placement`): once ``placement.json`` appears it is said, given to
    ``on_placement`` (the orchestrator's record and tokens) and each node's tokens name the ranks it hosts. The batch
    script and the sbatch line become an artifact of the run through ``hooks`` (the orchestrator's)."""
    run_dir = Path(run_dir).absolute()
    env = commands.slurm_env(cfg.cluster.slurm)
    inside = os.environ.get("SLURM_JOB_ID")
    if inside and exclude:  # the allocation's nodes are the job's: a lost one cannot be left out of it
        raise SlurmRefused(f"node(s) {', '.join(exclude)} of allocation {inside} lost; run kc train in a new one")
    if int(cfg.cluster.slurm.nodes or 1) > 1:  # the store gate's key, in a 0600 file the nodes read
        worker_env = {**worker_env, **write_attempt_key(run_dir, attempt)}
    path, text = write_attempt(cfg, run_dir, attempt, args, worker_env, tokens_for is not None, exclude, traffic)
    for warning in script.secret_warnings(cfg.cluster.slurm):
        say(warning)
    placing = traffic is not None
    out = script.slurm_dir(run_dir, attempt)
    proc = None
    owner = Beat(owner_beat_path(run_dir, attempt), 0.5)  # the nodes stop their ranks when this goes silent
    owner.start()
    tails: list[LogTail] = []
    job_id = None
    try:
        if inside:
            argv = ["bash", str(path)]
            with open(out / "step.out", "ab") as log:
                proc = subprocess.Popen(argv, env=script.step_env(cfg, env), cwd=run_dir, stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            job_id = inside
        else:
            argv = script.sbatch_argv(cfg, path, env)
            job_id = commands.submit(argv, env)
        (out / "submit.json").write_text(
            json.dumps({"argv": argv, "job_id": job_id, "inside_allocation": bool(inside)})
        )
        _artifact(hooks, text, argv, job_id, attempt)
        follow = _Follow(job_id, env, out, say)
        nodes: list[str] = []
        watch: AttemptWatch | None = None
        placed: dict[str, Any] | None = None
        while True:
            info = follow.poll()
            state = follow.state
            if state == "PENDING" and info.get("Reason", "") in commands.HOPELESS:
                commands.cancel(job_id, env)
                raise SlurmRefused(f"Slurm cannot run job {job_id}: pending ({info['Reason']})")
            if not nodes and (state == "RUNNING" or inside) and info.get("NodeList", "(null)") != "(null)":
                nodes = _start_nodes(cfg, info["NodeList"], env, run_dir, attempt, None if placing else tokens_for,
                                     log_sink, tails)  # fmt: skip
                facts.record_attempt_nodes(out, nodes, env, follow.note)  # nodes.json: their facts and switches
                watch = _watch_nodes(cfg, run_dir, attempt, nodes, placing)
            if nodes and placing and placed is None:
                placed = _take_placement(run_dir, attempt, follow, tokens_for, on_placement)
            if watch is not None and state not in ENDED_BY_SLURM:
                _check_nodes(watch, follow, poll_s)
            if proc is not None and proc.poll() is not None:
                state = "COMPLETED" if proc.returncode == 0 else "FAILED"
                follow.note(f"srun step of job {job_id} ended: exit code {proc.returncode}")
                break
            if proc is None and (state in commands.TERMINAL or state == "COMPLETED?"):  # ? : forgotten
                state = state.rstrip("?")
                break
            time.sleep(poll_s)
        time.sleep(0.3)  # the last lines of the nodes' logs
        time_limit.raise_if_stopped(out, job_id, cfg.cluster.slurm)  # checkpointed before the time limit
        if placing and placed is None and state not in ENDED_BY_SLURM:
            raise WorkerFailed(None, f"Slurm job {job_id} ended {state} before it placed its ranks: {_said(out)}")
        _raise_for_end(state, info, job_id, _results(run_dir, attempt, nodes))
        return job_id
    except BaseException:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        elif proc is None and job_id is not None:
            commands.cancel(job_id, env)
        raise
    finally:
        drop_attempt_key(run_dir, attempt)
        owner.halt.set()
        for tail in tails:
            tail.halt.set()
        for tail in tails:
            tail.join(timeout=5)


def _watch_nodes(cfg: Any, run_dir: Path, attempt: int, nodes: list[str], placing: bool = False) -> AttemptWatch:
    """The watch of the job's nodes (their launchers' beats and results), as on the node-agent path; their
    launchers start after the probe and the placement step when the job places its ranks."""
    lost_after = max(3.0, float(cfg.cluster.heartbeat_timeout_s or 10.0))
    start = NODE_START_TIMEOUT_S + (placement.PROBE_TIMEOUT_S if placing else 0.0)
    return AttemptWatch(run_dir, attempt, nodes, lost_after=lost_after, start_timeout=start)


def _take_placement(run_dir: Path, attempt: int, follow: _Follow, tokens_for, on_placement) -> dict[str, Any] | None:
    """The job's ``placement.json`` once its placement step wrote it (None before): said (which node hosts which
    ranks; a failed probe's warning), handed to ``on_placement``, and each node's tokens written for its ranks."""
    path = placement.placement_path(run_dir, attempt)
    if not path.exists():
        return None
    record = placement.read_placement(path)
    if record.get("warning"):
        follow.note(f"attempt {attempt}: warning: {record['warning']}")
    follow.note(placement.describe(record))
    if on_placement is not None:
        on_placement(record)
    for node in record["nodes"]:
        if tokens_for is not None:
            tokens_for(node["name"], list(node["ranks"]))
    return record


def _said(out: Path) -> str:
    """The job's last ``kuangchao:`` line (its batch output, or the step's inside an allocation)."""
    lines = [
        line
        for f in sorted(out.glob("batch-*.out")) + [out / "step.out"]
        if f.is_file()
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines()
        if line.startswith("kuangchao:")
    ]
    return lines[-1] if lines else f"no output in {out}"


def _check_nodes(watch: AttemptWatch, follow: _Follow, poll_s: float) -> None:
    """Raise the nodes' verdict once one failed or was lost — unless Slurm itself ended the job meanwhile (a
    ``scancel`` kills the ranks too: its reason, not theirs)."""
    try:
        watch.check(poll_s)
    except WorkerFailed as exc:
        follow.poll()
        if follow.state in ENDED_BY_SLURM:
            return
        follow.note(f"attempt {watch.attempt}: " + (f"node {exc.node} lost" if exc.node else f"rank {exc.rank} failed"))
        raise


def _start_nodes(cfg, nodelist: str, env, run_dir: Path, attempt: int, tokens_for, log_sink, tails) -> list[str]:
    """The job runs on ``nodelist``: each node's tokens written for it alone (its ranks in the rendezvous' node
    order; None: written once the job placed its ranks), its ``launcher.log`` tailed into ``log_sink``."""
    order = commands.node_order(commands.hostnames(nodelist, env), env)
    nproc = cfg.cluster.slurm.tasks_per_node
    for rank, (node, _addr) in enumerate(order):
        if tokens_for is not None:
            tokens_for(node, list(range(rank * nproc, (rank + 1) * nproc)))
        where = node_dir(run_dir, attempt, node)
        where.mkdir(parents=True, exist_ok=True)
        tail = LogTail(where / "launcher.log", log_sink)
        tail.start()
        tails.append(tail)
    return [n for n, _ in order]


def reach_address(cfg: Any) -> str:
    """The address of this machine that the nodes of ``cluster.slurm.partition`` reach (the token renewal
    endpoint listens there): the route towards one of the partition's nodes."""
    from kuangchao_core.sched.nodes import route_address

    env = commands.slurm_env(cfg.cluster.slurm)
    addr = commands.partition_address(cfg.cluster.slurm.partition, env)
    return route_address(addr) if addr else "127.0.0.1"
