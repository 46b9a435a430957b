"""One attempt of the job's workers (the work of the Prefect task ``launch``, ``tasks/launch.py``): start them with
torch.distributed.run (or on the node agents) and supervise them to the end.

A worker's death or hang becomes an ordinary ``WorkerFailed`` exception (Prefect retries failures, not crashed
subprocesses), which the flow answers with ``recover`` and a new attempt.
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from kuangchao_core.config.unused import UNUSED_REPORTED_ENV
from kuangchao_core.engine.traffic import group_traffic
from kuangchao_core.errors import WorkerFailed
from kuangchao_core.job.ckpt_mirror import mirror_for
from kuangchao_core.job.flow_log import ProgressLog
from kuangchao_core.job.job_events import JobEvents
from kuangchao_core.job.slurm_nodes import log_slurm_nodes, record_slurm_placement
from kuangchao_core.obs import phases
from kuangchao_core.obs.console import LiveView
from kuangchao_core.obs.prometheus import exporter_for
from kuangchao_core.obs.run_hooks import NO_HOOKS, RunHooks
from kuangchao_core.obs.tracking import tracking_uri
from kuangchao_core.perm import guard_api
from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.audit_pins import record_audit_pin_or_log
from kuangchao_core.perm.audit_seal import register_seal
from kuangchao_core.perm.global_config import GlobalConfig
from kuangchao_core.perm.issuance import (
    audit_log_path,
    authority_for,
    issue_tokens_for_run,
    node_token_env,
    token_env,
)
from kuangchao_core.perm.pin_store import checked_pin_store
from kuangchao_core.perm.runtime import RenewalServer
from kuangchao_core.perm.tokens import public_raw
from kuangchao_core.sched import interrupt
from kuangchao_core.sched.launch_spec import LaunchSpec
from kuangchao_core.sched.launcher import run_workers
from kuangchao_core.sched.multinode import launch_cluster_attempt, place_cluster_attempt
from kuangchao_core.sched.nodes import route_address
from kuangchao_core.sched.placement import NodeAssignment
from kuangchao_core.sched.rank_placement import RankPlacement
from kuangchao_core.sched.slurm.job import launch_slurm_attempt
from kuangchao_core.sched.slurm.job import reach_address as slurm_reach_address
from kuangchao_core.sched.slurm.time_limit import ENV_STOP_FILE


@dataclass
class LaunchSummary:
    """What one successful launch reported."""

    attempt: int
    steps: int | None
    final_loss: float | None
    tokens_per_s: float | None  # the last logged step's
    tokens_per_s_mean: float | None  # over every step this attempt trained
    heldout_accuracy: float | None
    loss_floor: float | None
    checkpoints: list[int] = field(default_factory=list)
    #: over the whole training loop, evaluations and checkpoints included (issue 39 item 1)
    tokens_per_s_loop: float | None = None
    #: the latest held-out loss: step, eval_loss, eval_tokens, and per character and byte where known (issue 39)
    heldout: dict[str, Any] | None = None
    anomalies: list[dict[str, Any]] = field(default_factory=list)  # the ranks' anomaly events, in order

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for artifacts and JSON output."""
        return asdict(self)


def note_fault(view: LiveView, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
    """(An exit callback.) Give a :class:`WorkerFailed` the fault its rank reported itself — the last ``fault``
    event of that rank: ``"at step N: Type: message"`` — so that recovery can tell a fault that repeats identically
    (whichever rank the next attempt reports first); a rank killed, hung or lost reported none."""
    if not isinstance(exc, WorkerFailed) or exc.fault is not None:
        return
    faults = [e for e in view.events if e.get("event") == "fault" and e.get("rank") == exc.rank]
    if faults:
        last = faults[-1]
        exc.fault = f"at step {last.get('step')}: {last.get('error')}"


def ensure_global_config(cfg: Any, run_dir: str | Path, worker_env: dict[str, str]) -> Path:
    """``<run_dir>/global_config.json``, created with the job's initial values if absent (kept across attempts,
    so an operator's ``kc config set`` survives a restart). The job's authority signs the initial values (an
    enforcing job's workers apply only signed versions), each recorded in the job's audit log like any later
    change; in trusted mode they are written unsigned."""
    path = Path(run_dir) / "global_config.json"
    if path.exists():
        return path
    job_id = worker_env.get("KC_JOB_ID", cfg.task.name)
    audit = AuditLog(worker_env.get("KC_AUDIT_LOG") or audit_log_path(cfg, job_id), job_id)
    initial: dict[str, Any] = {"lr_scale": 1.0, "log_interval": max(1, int(cfg.train.log_interval))}
    if cfg.checkpoint.interval:
        initial["checkpoint_interval"] = int(cfg.checkpoint.interval)
    enforcing = "KC_TRUST_ROOT" in worker_env
    signer = authority_for(cfg, run_dir) if enforcing else None
    gc = GlobalConfig(path, cfg.task.name, audit=audit, job_id=job_id if enforcing else None)
    previous = guard_api.install_guard(guard_api.AllowAll()) if not enforcing else None
    try:
        for key, value in initial.items():
            gc.set(key, value, signer=signer)
    finally:
        if previous is not None:
            guard_api.install_guard(previous)
        audit.close()
    return path


def _slurm_placed(
    cfg: Any, run_id: str | None, run_dir: Path, attempt: int, say, enforcing: bool, placed: dict, hooks=NO_HOOKS
) -> None:
    """A Slurm job placed its ranks (``placed``: its ``placement.json``): recorded as on the other paths, and, in an
    enforcing job, the attempt's tokens issued again for that placement (the device and the node-local groups each
    token names follow where its rank runs) before any node's token file is written."""
    record_slurm_placement(cfg, run_id, run_dir, attempt, placed, say, hooks)
    if enforcing:
        issue_tokens_for_run(cfg, run_dir, attempt, placed["placement"])


def launch_workers(
    cfg: Any,
    config_path: str | Path,
    run_dir: str | Path,
    attempt: int = 0,
    resume: str | None = None,
    mlflow_run_id: str | None = None,
    env: dict[str, str] | None = None,
    view: LiveView | None = None,
    exclude_nodes: list[str] | None = None,
    assignments: list[dict[str, Any]] | None = None,
    placement: dict[str, Any] | None = None,
    hooks: RunHooks = NO_HOOKS,
) -> LaunchSummary:
    """Run one attempt of the job's workers; raises WorkerFailed naming the rank (or the lost node) on failure.

    ``cluster.mode`` local starts every rank here; slurm submits a Slurm job (:mod:`kuangchao_core.sched.slurm`);
    static and dynamic clusters run on node agents
    (:func:`kuangchao_core.sched.multinode.launch_cluster_attempt`): on ``assignments`` (``NodeAssignment``
    fields) with ``placement`` (``RankPlacement.to_dict()``) when the flow placed the attempt, else on nodes
    chosen here, leaving out ``exclude_nodes``. ``hooks``: the orchestrator's (the launch task's Prefect run: its
    events, artifacts and log); none by default.
    """
    run_dir = Path(run_dir)
    view = view or LiveView(task=cfg.task.name, quiet=not cfg.logging.console)
    exporter = exporter_for(str(run_dir))
    events = JobEvents(
        cfg,
        (env or {}).get("KC_JOB_ID", cfg.task.name),
        mlflow_run_id,
        exporter.metrics if exporter else None,
        mirror=mirror_for(str(run_dir)),
        hooks=hooks,
    )
    view.listeners.append(events)
    clock, started = phases.active(), time.time()
    first_attempt_to_step = clock is not None and clock.first_step is None
    if clock is not None:  # the run summary's start-up and after-the-last-step phases (issue 27 §2)
        view.listeners.append(clock.on_event)
    view.listeners.append(interrupt.note_event)  # the last step, for the line of an interrupted run
    run_logger = hooks.run_logger()
    if run_logger is not None:  # the progress in the flow run's own log (prefect flow-run logs), at log_interval
        view.listeners.append(ProgressLog(run_logger))
    worker_env = {
        "KC_RUN_DIR": str(run_dir),
        "KC_ATTEMPT": str(attempt),
        "KC_JOB_ID": cfg.task.name,
        "KC_TRACKING_URI": cfg.tracking.uri,
        "KC_TRACKING_WAIT_S": str(cfg.tracking.store_wait_s),  # rank 0's metric writes wait this for a locked store
        "PYTHONUNBUFFERED": "1",
        UNUSED_REPORTED_ENV: "1",  # the flow said them at start, from the user's own config
    }
    if mlflow_run_id:
        worker_env["KC_MLFLOW_RUN_ID"] = mlflow_run_id
    worker_env.update(env or {})
    worker_env["KC_GLOBAL_CONFIG"] = str(ensure_global_config(cfg, run_dir, worker_env).resolve())
    args = ["--config", str(config_path)]
    if resume:
        args += ["--resume", resume]
    recovery = cfg.cluster
    multinode = cfg.cluster.mode in ("static", "dynamic")
    on_slurm = cfg.cluster.mode == "slurm"
    if multinode and assignments is None:
        nodes, placed = place_cluster_attempt(cfg, exclude_nodes or [], traffic=group_traffic(cfg))
        placement = placed.to_dict()
    else:
        nodes = [NodeAssignment(**a) for a in assignments or []]
    placed = RankPlacement.from_dict(placement) if placement else None
    with ExitStack() as stack:
        stack.push(partial(note_fault, view))  # a failure gets the error and step its rank reported, if it did
        if "KC_TRUST_ROOT" in worker_env:
            # the authority stays in this process; workers renew their tokens through this endpoint, which
            # listens on the address the nodes reach this machine at
            authority = authority_for(cfg, run_dir)
            server = RenewalServer(
                authority,
                worker_env["KC_JOB_ID"],
                attempt,
                audit_log=worker_env.get("KC_AUDIT_LOG"),
                ttl_s=float(cfg.permission.token_ttl_seconds),
                host=route_address(nodes[0].address)
                if nodes
                else slurm_reach_address(cfg)
                if on_slurm
                else "127.0.0.1",
            )
            if worker_env.get("KC_AUDIT_LOG"):  # the audit key and the chain's head, kept outside the log's dir
                audit_kid, audit_key = authority.audit_signing_key()
                store = checked_pin_store(cfg.permission.pin_store)
                pin = partial(
                    record_audit_pin_or_log,
                    run_dir,
                    worker_env["KC_AUDIT_LOG"],
                    worker_env["KC_JOB_ID"],
                    audit_kid,
                    public_raw(audit_key),
                    mlflow_run_id=mlflow_run_id,
                    tracking_uri=tracking_uri(cfg),
                    mode=str(cfg.permission.mode),
                    pin_store=store,
                    hooks=hooks,
                )
                pin()  # before the workers start: this process's audit key
                register_seal(run_dir, pin)  # issue 26: the job's end (close_authority) seals the log with it
                stack.callback(pin)  # runs after the server's stop (entered below) and its final checkpoint
            worker_env["KC_AUTHORITY_ADDR"] = stack.enter_context(server).address
        stack.callback(view.close)
        stack.callback(interrupt.on_request(lambda: setattr(view, "quiet", True)))  # Ctrl-C: the one line only
        if multinode:

            def env_for(node) -> dict[str, str]:  # each node gets only its own ranks' tokens
                base = {**worker_env, **(placed.env() if placed else {})}
                if "KC_TRUST_ROOT" not in worker_env:
                    return base
                ranks = placed.ranks_of_node(node.node_rank) if placed else node.ranks
                return node_token_env(base, run_dir, attempt, node.name, ranks)

            launch_cluster_attempt(cfg, nodes, run_dir, attempt, args, env_for, view)
        elif on_slurm:  # each node's tokens in a 0600 file of its own, never in the job Slurm stores
            tokens_for = (lambda node, ranks: node_token_env({}, run_dir, attempt, node, ranks)) if (
                "KC_TRUST_ROOT" in worker_env) else None  # fmt: skip
            say = partial(_say_slurm, run_logger, view)  # the job's states on the console too (issue 45 §3)
            stack.callback(log_slurm_nodes, cfg, mlflow_run_id, run_dir, attempt, say)  # also after a failure
            placed_cb = partial(
                _slurm_placed, cfg, mlflow_run_id, run_dir, attempt, say, "KC_TRUST_ROOT" in worker_env, hooks=hooks
            )
            launch_slurm_attempt(
                cfg,
                run_dir,
                attempt,
                args,
                worker_env,
                tokens_for,
                view,
                say=say,
                exclude=list(exclude_nodes or []),
                traffic=group_traffic(cfg),  # the job probes its nodes and places its ranks (issue 32 §5)
                on_placement=placed_cb,
                hooks=hooks,
            )
        else:
            tokens = token_env(run_dir, attempt) if "KC_TRUST_ROOT" in worker_env else {}
            # Ctrl-C of kc train creates it: the ranks stop together at their next check, checkpointed (issue 45)
            stop = {ENV_STOP_FILE: str(run_dir / f"attempt_{attempt}" / interrupt.STOP_FILE)}
            run_workers(
                LaunchSpec(
                    "kuangchao_core.engine.worker",
                    args,
                    nproc=cfg.parallel.world_size,
                    env={**os.environ, **worker_env, **tokens, **stop},
                    run_dir=run_dir,
                    heartbeat_timeout_s=recovery.heartbeat_timeout_s,
                    heartbeat_interval_s=recovery.heartbeat_interval_s,
                    log_sink=view,
                    attempt=attempt,
                )
            )
        exited = time.time()
    if clock is not None and clock.first_step is not None:
        if first_attempt_to_step:  # workers started, imported, built the model and the data up to their first step
            clock.add("workers", clock.first_step[1] - started)
        clock.add("workers_exit", exited - clock.last_step[1])  # eval, final checkpoint, the ranks' and torchrun's exit
        clock.since("launch_close", exited)  # the token renewal server's stop, the audit log's pin
    last = view.last_step or {}
    evals = [e for e in view.events if e.get("event") == "eval"]
    done = [e for e in view.events if e.get("event") == "done"]
    return LaunchSummary(
        attempt=attempt,
        steps=(done[-1].get("step") if done else last.get("step")),
        final_loss=(done[-1].get("final_loss") if done else last.get("loss")),
        tokens_per_s=last.get("tokens_per_s"),
        tokens_per_s_mean=done[-1].get("tokens_per_s_mean") if done else None,
        tokens_per_s_loop=done[-1].get("tokens_per_s_loop") if done else None,
        heldout=done[-1].get("heldout") if done else None,
        heldout_accuracy=evals[-1].get("heldout_accuracy") if evals else None,
        loss_floor=evals[-1].get("loss_floor") if evals else None,
        checkpoints=[int(e["step"]) for e in view.events if e.get("event") == "checkpoint"],
        anomalies=[{k: a.get(k) for k in ("kind", "step", "action", "message")} for a in events.anomalies],
    )


def _say_slurm(run_logger: Any, view: LiveView, line: str) -> None:
    """A line of the Slurm job's (its states: ``Slurm job 42: PENDING (Resources)``, its nodes, its placement) in
    the flow run's log (``prefect flow-run logs``) and on ``kc train``'s console, as the README says."""
    if run_logger is not None:
        run_logger.info(line)
    view.note(line, source="slurm")
