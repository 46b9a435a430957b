"""The ``kuangchao-train`` flow: the whole job lifecycle as Prefect tasks, in three phases of the core
(:mod:`kuangchao_core.job`): prepare the run, run the attempts, finish.

    doctor → probe_topology → validate_data → [place_attempt] → issue_tokens → [restore_checkpoint] → launch
           → (recover → [restore_checkpoint] → [place_attempt] → launch)* → checkpoint

On a static or dynamic cluster the probe measures the links between the candidate nodes through their agents
(``probe_cluster_topology``, cached by the nodes' fingerprint) and every attempt is placed from that matrix
(``place_attempt``: which nodes, which mesh rank in which slot), recorded with the run (Slurm: inside the job).

``kc train`` runs this flow in-process (Prefect's ephemeral API unless ``PREFECT_API_URL`` is set), a deployment
(``deployments/prefect.yaml``) on a worker: its parameters stay JSON values. MLflow holds one run per flow run (config,
rank 0's metrics, restarts, checkpoint manifests). A task retries transient failures (``tasks.retry_policy``), a failed
attempt restarts at most ``cluster.max_restarts`` times; config, data and permission errors fail at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Cancelled, Completed

from blocks.resolve import load_job_config
from kuangchao_core.errors import ConfigError, KuangchaoError
from kuangchao_core.job.attempts import hold_job_lineage, run_attempts
from kuangchao_core.job.finish import finish_run, release_run, skipped_summary, summary_markdown
from kuangchao_core.job.interrupted import interrupted_line
from kuangchao_core.job.prepare import JobRun, open_job, prepare_run
from kuangchao_core.job.steps import JobSteps
from kuangchao_core.obs import phases, prefect_watch, tracking
from kuangchao_core.perm import guard_api
from kuangchao_core.perm.issuance import close_authority
from kuangchao_core.sched import interrupt
from tasks.checkpoint import checkpoint, restore_checkpoint
from tasks.doctor import doctor
from tasks.export_model import export_and_register
from tasks.issue_tokens import issue_tokens
from tasks.launch import launch
from tasks.place_attempt import place_attempt, start_cluster_probe
from tasks.prefect_hooks import PREFECT_HOOKS
from tasks.probe_topology import probe_topology
from tasks.recover import recover
from tasks.validate_data import validate_data

STEPS = JobSteps(
    restore_checkpoint=restore_checkpoint,
    doctor=doctor,
    probe_topology=probe_topology,
    start_cluster_probe=start_cluster_probe,
    validate_data=validate_data,
    place_attempt=place_attempt,
    issue_tokens=issue_tokens,
    launch=launch,
    recover=recover,
    checkpoint=checkpoint,
    export_and_register=export_and_register,
)


@flow(name="kuangchao-train", log_prints=True)
def train_flow(
    config_path: str, overrides: list[str] | None = None, resume: str | None = None, if_finished: str = "error"
) -> Any:
    """Run a training job end to end from a YAML config (plus ``--set`` style ``overrides``).

    ``resume``: ``auto`` (the newest lineage's newest intact checkpoint, local or S3), ``never`` (a new lineage) or
    a step directory; default ``checkpoint.resume``. The run's checkpoints go to one lineage
    (``<checkpoint.dir>/<task>/<lineage>/``), pinned for every attempt. ``if_finished``: what to do when the resume
    checkpoint is already at or past ``train.steps``: ``error`` (default; fails with the fix, before any worker
    starts), ``skip`` (trains nothing; the flow run ends in a Completed state named ``Skipped`` whose summary
    says ``trained_steps: 0``) or ``restart`` (a new lineage from the start, as ``resume: never``: a scheduled
    fine-tune resumes an interrupted run and otherwise trains anew). Returns the run summary (also a Prefect artifact
    and an MLflow artifact).
    """
    clock = phases.claim()  # kc train's, from its process start (issue 27 §2); else from now
    if if_finished not in ("error", "skip", "restart"):
        raise ConfigError([("if_finished", f"must be 'error', 'skip' or 'restart', got {if_finished!r}")])
    logger = get_run_logger()
    # The job's authority (it issues the tokens) moves checkpoints itself through the guard, trusted; the previous
    # guard comes back on the way out (`kc train` and tests share the process with other code).
    previous_guard = guard_api.install_guard(guard_api.AllowAll())
    opened: list[Path] = []  # the run whose authority this flow holds in memory, forgotten on the way out
    interrupt.rearm()  # kc train's Ctrl-C and SIGTERM, over the SIGTERM handler Prefect's engine installed (issue 45)
    try:
        with prefect_watch.watching(hooks=PREFECT_HOOKS) as watch:  # issue 26 §5: a lost API ends the run
            try:
                result = _run(logger, config_path, list(overrides or []), resume, if_finished, opened, clock)
            except interrupt.Interrupted:  # the ranks stopped (at a step boundary, or after the grace)
                line = interrupted_line(watch.record, config_path, list(overrides or []))
                logger.warning("kuangchao-train: %s", line)
                return Cancelled(message=line)
            if watch.cancelled:  # cancelled after the training: from Cancelling, Prefect accepts only Cancelled
                raise prefect_watch.FlowRunCancelled(watch.cancel_line())
            return result
    except prefect_watch.FlowRunCancelled as exc:  # issue 32 §3: cancelled in Prefect, every rank stopped
        logger.warning("kuangchao-train: %s", exc)
        return Cancelled(message=str(exc))
    except KuangchaoError as exc:  # the reason, in the flow run's own log (`prefect flow-run logs <id>`)
        logger.error("kuangchao-train failed: %s", exc)
        raise
    finally:
        guard_api.install_guard(previous_guard)
        for run_dir in opened:
            close_authority(run_dir)
        prefect_watch.body_ended()
        phases.release(clock)


def _nothing_to_train(job: JobRun) -> Any:
    """The Completed state named ``Skipped`` of a run that had nothing to train, with an honest summary."""
    summary, message = skipped_summary(job)
    create_markdown_artifact(
        summary_markdown(job.cfg, summary), key="kuangchao-run-summary", description="training run summary"
    )
    return Completed(name="Skipped", message=message, data=summary)


def _run(
    logger: Any,
    config_path: str,
    overrides: list[str],
    resume: str | None,
    if_finished: str,
    opened: list[Path],
    clock: phases.PhaseClock,
) -> Any:
    """The job's phases: prepare the run, run the attempts, finish (:mod:`kuangchao_core.job`)."""
    secrets: dict[str, Any] = {}
    cfg = load_job_config(config_path, overrides, secrets)
    job = prepare_run(cfg, secrets, flow_run.get_id(), resume, if_finished, STEPS, logger, opened)
    if job.nothing_to_train:
        return _nothing_to_train(job)
    interrupted = False
    try:
        open_job(job, STEPS, clock, logger)  # doctor, topology, the MLflow run, the Prometheus endpoint
        hold_job_lineage(job, STEPS, clock, logger)  # the data validated, the lineage held, the S3 mirror
        result = run_attempts(job, STEPS, clock, logger)
        return finish_run(job, result, STEPS, clock, logger)
    except BaseException as exc:
        killed = prefect_watch.current().cancelled or isinstance(exc, interrupt.Interrupted)
        if job.run_id:  # opened (a Ctrl-C may land between the run's start and the Prometheus endpoint's)
            tracking.close_failed_run(cfg, job.run_id, "KILLED" if killed else "FAILED", logger)
        interrupted = not isinstance(exc, Exception)  # Ctrl-C, a lost Prefect API: no grace period
        raise
    finally:
        release_run(job, interrupted, logger)
