"""Phase one of a job: prepare the run — check the config, make the run directory, plan the resume, run the
doctor and the topology probe, open the MLflow run and the Prometheus endpoint (``flows/train.py``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kuangchao_core.ckpt.lineage import ResumePlan, plan_training
from kuangchao_core.config.paths import make_paths_absolute
from kuangchao_core.config.settings import lineage_key
from kuangchao_core.config.unused import unused_settings
from kuangchao_core.engine.plan import raise_for_plan
from kuangchao_core.engine.vlm_model import pretrained_vision
from kuangchao_core.errors import ConfigError
from kuangchao_core.job.checkpoints import s3_settings_for
from kuangchao_core.job.metrics_endpoint import start_exporter
from kuangchao_core.job.steps import JobSteps
from kuangchao_core.obs import phases, prefect_watch, tracking, tracking_store
from kuangchao_core.obs.model_registry import MODEL_URI_PREFIX, resolve_model_uri
from kuangchao_core.perm.issuance import open_authority


@dataclass
class JobRun:
    """One flow run's job as its phases share it: the config, where the run lives, its resume plan and, as the
    phases go, its MLflow run, metrics endpoint, lineage lease, S3 mirror and attempts."""

    cfg: Any
    run_dir: Path
    resolved: Path  # the resolved config every attempt reads (unless an elastic re-plan writes its own)
    flow_run_id: str | None
    plan: ResumePlan
    worker_resume: str  # the workers' --resume, from the first plan: later attempts prefer the lineage's newest step
    s3_settings: Any = None
    base_model: dict[str, str] = field(default_factory=dict)
    run_id: str | None = None
    exporter: Any = None
    probing: Any = None  # a multi-node job's topology probe, running while the data is validated
    topology: Any = None
    mirror: Any = None
    keeper: Any = None
    lease: Any = None
    t0: float = 0.0
    attempts: int = 0
    causes: list[str] = field(default_factory=list)
    lost_nodes: list[str] = field(default_factory=list)  # machines lost in earlier attempts; later ones run without

    @property
    def nothing_to_train(self) -> bool:
        """The resume checkpoint is already at ``train.steps`` (``if_finished: skip``)."""
        return self.plan.step >= self.cfg.train.steps


def make_run_dir(cfg: Any, flow_run_id: str | None) -> Path:
    """``runs/<task>/<UTC time>-<flow run id>/``: resolved config, launcher logs, tokens, reports."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    runs = Path(os.environ.get("KC_RUNS_DIR", "runs")).absolute()  # the nodes use this path, not their own cwd's
    run_dir = runs / cfg.task.name / f"{stamp}-{(flow_run_id or 'local')[:8]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def resolve_base_model(cfg: Any, logger: Any) -> dict[str, str]:
    """``model.checkpoint: models:/NAME@ALIAS`` (or ``/VERSION``): the registered model version's files as a local
    directory, written into the config every attempt reads; returns the MLflow run tags naming it."""
    uri = cfg.model.checkpoint
    if not uri or not str(uri).startswith(MODEL_URI_PREFIX):
        return {}
    local, info = resolve_model_uri(str(uri), tracking.tracking_uri(cfg), Path(cfg.checkpoint.dir) / ".base-models")
    cfg.model.checkpoint = str(local)
    logger.info("model.checkpoint %s is %s version %d at %s", uri, info["name"], info["version"], local)
    return {"kuangchao.base_model": f"{info['name']} v{info['version']}", "kuangchao.base_model_uri": str(uri)}


def prepare_run(
    cfg: Any,
    secrets: dict[str, Any],
    flow_run_id: str | None,
    resume: str | None,
    if_finished: str,
    steps: JobSteps,
    logger: Any,
    opened: list[Path],
) -> JobRun:
    """Everything before any check that costs time: unused settings warned about, a registered base model resolved,
    the plan checked, the run directory with the resolved config, the job's authority (enforcing mode; its run
    directory appended to ``opened``), the resume plan (``NothingToTrain`` for ``if_finished: error``). A resume
    checkpoint of another model fails here, naming both shapes."""
    for path, why in unused_settings(cfg):  # from the user's config: the resolved one names every field
        logger.warning("%s: %s", path, why)
    base_model = resolve_base_model(cfg, logger)
    make_paths_absolute(cfg)  # issue 32 §8: from where `kc train` ran, once; the nodes and ranks use exactly these
    cfg.model.vision = pretrained_vision(cfg.model)  # a LLaVA checkpoint's tower, in the config every rank reads
    raise_for_plan(cfg)  # a plan that cannot run is refused with its numbers before anything starts
    s3_settings = s3_settings_for(cfg, secrets) if cfg.checkpoint.uri else None
    run_dir = make_run_dir(cfg, flow_run_id)
    if cfg.permission.mode == "enforcing":  # keys in this process's memory only, from the block when configured
        open_authority(cfg, run_dir, secrets.get("signing_key_pem"))
        opened.append(run_dir)
    prefect_watch.note(task=cfg.task.name, run_dir=str(run_dir), flow_run_id=flow_run_id)
    resolved = run_dir / "config.yaml"
    resolved.write_text(cfg.to_yaml(), encoding="utf-8")
    logger.info("resolved config written to %s", resolved)

    resume_arg = resume or cfg.checkpoint.resume
    if resume_arg == "auto" and cfg.checkpoint.uri:
        restored = steps.restore_checkpoint(cfg, None, s3_settings)
        for skip in restored["skipped"]:
            logger.warning("skipped corrupt checkpoint %s (step %s): %s", skip["uri"], skip["step"], skip["reason"])
    plan = plan_training(
        lineage_key(cfg), resume_arg, if_finished, logger.info
    )  # NothingToTrain: kc train's early refusal too
    prefect_watch.note(resume_step=plan.step if plan.step_dir else None)  # for the line of an interrupted run
    job = JobRun(cfg, run_dir, resolved, flow_run_id, plan, plan.step_dir or "never", s3_settings, base_model)
    if job.nothing_to_train:  # if_finished: skip
        logger.warning("0 steps trained: %s is already at step %d of %d", plan.step_dir, plan.step, cfg.train.steps)
        return job
    if plan.step_dir:  # another model's checkpoint fails here, naming both shapes, before anything starts
        from kuangchao_core.ckpt.integrity import read_manifest
        from kuangchao_core.engine.checkpointing import model_mismatch
        from kuangchao_core.models.llama import config_from_model_section

        mismatch = model_mismatch(read_manifest(plan.step_dir), config_from_model_section(cfg.model))
        if mismatch:
            raise ConfigError([("checkpoint.resume", f"{plan.step_dir}: {mismatch}")])
    return job


def open_job(job: JobRun, steps: JobSteps, clock: phases.PhaseClock, logger: Any) -> None:
    """The doctor, the topology probe (one machine: measured now; several: started, finished by
    :func:`~kuangchao_core.ckpt.lineage_hold.hold_lineage`), the job's MLflow run — its store opened first
    (:func:`~kuangchao_core.obs.tracking_store.preflight`: ``TrackingStoreError`` before any compute) — and its
    Prometheus endpoint."""
    cfg = job.cfg
    with clock.phase("doctor"):
        steps.doctor(cfg)
    if cfg.cluster.mode == "local":
        with clock.phase("topology"):
            steps.probe_topology(cfg)
    elif cfg.cluster.mode == "slurm":
        logger.info("cluster.mode slurm: Slurm grants the nodes; the job probes them and places its ranks itself")
    else:  # the node agents measure every pair of candidate nodes while the data is validated
        job.probing = steps.start_cluster_probe(cfg, job.run_dir, logger)
    with clock.phase("mlflow"):  # a locked store waited for (bounded); a corrupt or unreachable one: one line, now
        tracking_store.preflight(tracking.tracking_uri(cfg), tracking.store_wait_s(cfg), logger.warning)
        tags = {"kuangchao.run_dir": str(job.run_dir), "kuangchao.lineage": job.plan.lineage, **job.base_model}
        job.run_id = tracking.open_run(cfg, job.flow_run_id, extra_tags=tags)
    prefect_watch.note(mlflow_run_id=job.run_id)
    logger.info("MLflow run %s (experiment %s, store %s)", job.run_id, tracking.experiment_name(cfg), cfg.tracking.uri)
    job.exporter = start_exporter(cfg, job.run_dir, job.run_id, logger)
    job.t0 = time.time()
