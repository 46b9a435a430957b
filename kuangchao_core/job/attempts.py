"""Phase two of a job: run the attempts — the data validated and the lineage held first, then each attempt
(elastic re-plan, placement, tokens, launch) until one succeeds or ``cluster.max_restarts`` restarts are spent;
before each restart ``recover`` says the cause and the resume point (``flows/train.py``)."""

from __future__ import annotations

from typing import Any

from kuangchao_core.ckpt.lineage import create_lineage, lineage_dir
from kuangchao_core.ckpt.lineage_hold import hold_lineage
from kuangchao_core.ckpt.lineage_lease import ENV_GENERATION, LeaseKeeper
from kuangchao_core.config.settings import lineage_key
from kuangchao_core.errors import WorkerFailed
from kuangchao_core.job.ckpt_mirror import CheckpointMirror, register_mirror
from kuangchao_core.job.placement_record import finish_cluster_probe
from kuangchao_core.job.prepare import JobRun
from kuangchao_core.job.steps import JobSteps
from kuangchao_core.obs import phases, prefect_watch, tracking
from kuangchao_core.sched.elastic import config_for_attempt
from kuangchao_core.sched.recovery import RestartPolicy, supervise


def hold_job_lineage(job: JobRun, steps: JobSteps, clock: phases.PhaseClock, logger: Any) -> None:
    """The data validated (a multi-node job's topology probe finishes meanwhile), the lineage created (only once the
    data passed: a refused job leaves no checkpoint directory behind) and held by this run alone (its lease kept
    alive), and the S3 mirror of its checkpoints started when ``checkpoint.uri`` is set."""
    cfg = job.cfg
    try:
        with clock.phase("validation"):
            steps.validate_data(cfg, mlflow_run_id=job.run_id)
    finally:
        job.topology = finish_cluster_probe(job.probing, logger) if job.probing is not None else None
    if job.topology is not None:  # placement reads the matrix
        tracking.log_json_artifact(cfg, job.run_id, job.topology.to_dict(), "topology", "topology.json")
    if job.plan.new:
        create_lineage(lineage_key(cfg), job.plan.lineage, started_from=job.plan.step_dir)
    lineage_before = job.plan.lineage
    job.plan, job.lease = hold_lineage(
        lineage_key(cfg), job.plan, str(job.flow_run_id), logger.warning
    )  # one writer per lineage; the resume step re-chosen once the lease is decided (a fork pins its own copy)
    if job.plan.step_dir:
        job.worker_resume = job.plan.step_dir
    job.keeper = LeaseKeeper(job.lease)
    job.keeper.start()
    prefect_watch.note(lineage=job.plan.lineage, lineage_dir=str(lineage_dir(lineage_key(cfg), job.plan.lineage)))
    if job.plan.lineage != lineage_before:
        tracking.set_tags(cfg, job.run_id, {"kuangchao.lineage": job.plan.lineage})
    if cfg.checkpoint.uri:  # every checkpoint to S3 while the job runs (the orchestrator holds the credentials)
        job.mirror = CheckpointMirror(cfg, job.plan.lineage, job.s3_settings)
        register_mirror(str(job.run_dir), job.mirror)


def _one_attempt(job: JobRun, steps: JobSteps, clock: phases.PhaseClock, logger: Any, attempt: int) -> dict:
    """Attempt ``attempt``: its config (an elastic re-plan when lost nodes left too few), placement, tokens, launch."""
    cfg = job.cfg
    job.attempts = attempt + 1
    work, job_file = config_for_attempt(cfg, job.lost_nodes), job.resolved
    if work is not cfg:  # a lost node left too few: the elastic re-plan, written beside the resolved config
        job_file = job.run_dir / f"config.attempt_{attempt}.yaml"
        job_file.write_text(work.to_yaml(), encoding="utf-8")
        logger.warning(
            "elastic re-plan for attempt %d: data_parallel_size %d -> %d, gradient_accumulation_steps %d -> %d",
            attempt,
            cfg.parallel.data_parallel_size,
            work.parallel.data_parallel_size,
            cfg.parallel.gradient_accumulation_steps,
            work.parallel.gradient_accumulation_steps,
        )
    placed: dict[str, Any] = {}
    if cfg.cluster.mode in ("static", "dynamic"):  # Slurm grants its nodes itself
        topology = job.topology.to_dict() if job.topology else None
        placed = steps.place_attempt(work, list(job.lost_nodes), topology, str(job.run_dir), attempt)
        tracking.log_json_artifact(cfg, job.run_id, placed, "placement", f"attempt_{attempt}.json")
        logger.info(
            "attempt %d placed (%s): %s",
            attempt,
            placed["placement"]["mode"],
            "; ".join(f"{row['node']}: ranks {row['ranks']}" for row in placed["links"]),
        )
    with clock.phase("tokens" if clock.first_step is None else "restart_tokens"):
        tokens = steps.issue_tokens(work, str(job.run_dir), attempt, placed.get("placement"))
    env = {**tokens, "KC_CKPT_LINEAGE": job.plan.lineage, ENV_GENERATION: str(job.lease.generation)}
    return steps.launch(
        work,
        str(job_file),
        str(job.run_dir),
        attempt,
        job.worker_resume,
        job.run_id,
        env,
        job.lost_nodes,
        assignments=placed.get("assignments"),
        placement=placed.get("placement"),
    )


def _before_restart(job: JobRun, steps: JobSteps, next_attempt: int, exc: BaseException) -> None:
    """A failed attempt: the restart counted, a lost node left out from now on, the cause recorded and recovered."""
    failed = next_attempt - 1
    if job.exporter is not None:
        job.exporter.metrics.restart()
    node = getattr(exc, "node", None)
    if node is not None and getattr(exc, "rank", None) is None:
        job.lost_nodes.append(node)
        cause = f"node {node}: {getattr(exc, 'cause', exc)}"
    else:
        cause = f"rank {getattr(exc, 'rank', None)}: {getattr(exc, 'cause', exc)}"
    job.causes.append(f"attempt {failed}: {cause}")
    # says the cause and the resume point once
    steps.recover(job.cfg, failed, cause, job.run_id, job.plan.lineage, job.plan.step_dir)


def run_attempts(job: JobRun, steps: JobSteps, clock: phases.PhaseClock, logger: Any) -> dict[str, Any]:
    """Attempts until one succeeds (its launch summary) or the restarts allowed by ``cluster.max_restarts`` are spent
    (``WorkerFailed``, the attempts tagged on the MLflow run); a lost Prefect API stops the training here."""
    cfg = job.cfg
    policy = RestartPolicy(max_restarts=cfg.cluster.max_restarts, setting="cluster.max_restarts")
    try:
        with prefect_watch.current().interruptible():
            return supervise(
                lambda attempt: _one_attempt(job, steps, clock, logger, attempt),
                policy,
                on_restart=lambda nxt, exc: _before_restart(job, steps, nxt, exc),
            ).result
    except WorkerFailed:
        tracking.set_tags(cfg, job.run_id, {"kuangchao.attempts": str(job.attempts)})
        raise
