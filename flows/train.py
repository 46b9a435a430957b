"""The ``kuangchao-train`` flow: the whole job lifecycle as Prefect tasks.

    doctor → probe_topology → validate_data → [place_attempt] → issue_tokens → [restore_checkpoint] → launch
           → (recover → [restore_checkpoint] → [place_attempt] → launch)* → checkpoint

On a static or dynamic cluster the probe measures the links between the candidate nodes through their agents
(``probe_cluster_topology``, cached by the nodes' fingerprint) and every attempt is placed from that matrix
(``place_attempt``: which nodes, which mesh rank in which slot), recorded with the run.

``kc train`` runs this flow in-process (Prefect's ephemeral API unless ``PREFECT_API_URL`` is set); a Prefect
deployment (``deployments/prefect.yaml``) runs the same flow on a worker, so its parameters stay JSON values.
MLflow holds one run per flow run: params = flattened config, per-step metrics from rank 0, restarts and their
causes, checkpoint metadata and manifests as artifacts. Only worker failures (``WorkerFailed``) are retried, at most
``cluster.max_restarts`` times; config, data and permission errors fail at once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Completed

from kuangchao_core.ckpt.lineage import ResumePlan, create_lineage, plan_training
from kuangchao_core.ckpt.lineage_lease import ENV_GENERATION, LeaseKeeper, hold_lineage
from kuangchao_core.config import load_config
from kuangchao_core.config.unused import unused_settings
from kuangchao_core.engine.plan import raise_for_plan
from kuangchao_core.errors import ConfigError, KuangchaoError, WorkerFailed
from kuangchao_core.obs import phases, prefect_watch, tracking
from kuangchao_core.obs.console import for_people
from kuangchao_core.obs.model_registry import MODEL_URI_PREFIX, resolve_model_uri
from kuangchao_core.obs.prometheus import register_exporter
from kuangchao_core.perm import guard_api
from kuangchao_core.perm.issuance import close_authority, open_authority
from kuangchao_core.sched.elastic import config_for_attempt
from kuangchao_core.sched.recovery import RestartPolicy, supervise
from tasks.checkpoint import checkpoint, restore_checkpoint, s3_settings_for
from tasks.ckpt_mirror import CheckpointMirror, register_mirror
from tasks.doctor import doctor
from tasks.export_model import export_and_register
from tasks.issue_tokens import issue_tokens
from tasks.launch import launch
from tasks.place_attempt import finish_cluster_probe, place_attempt, start_cluster_probe
from tasks.probe_topology import probe_topology
from tasks.recover import recover
from tasks.validate_data import validate_data


def make_run_dir(cfg: Any, flow_run_id: str | None) -> Path:
    """``runs/<task>/<UTC time>-<flow run id>/``: resolved config, launcher logs, tokens, reports."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    run_dir = Path(os.environ.get("KC_RUNS_DIR", "runs")) / cfg.task.name / f"{stamp}-{(flow_run_id or 'local')[:8]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def load_job_config(config_path: str, overrides: list[str], secrets: dict[str, Any] | None = None):
    """``load_config`` plus Prefect block references (``checkpoint.storage_block`` …, see ``blocks.resolve``).

    Block references are resolved on the merged mapping before validation; secrets (S3 credentials, also those
    written into ``checkpoint.endpoint_url`` as ``user:password@``) go into ``secrets``, never into the config that
    is written to disk, logged to MLflow and handed to the workers.
    """
    from blocks.resolve import resolve_blocks
    from kuangchao_core.config.secrets import take_checkpoint_credentials

    def resolve(data: dict[str, Any]) -> dict[str, Any]:
        return take_checkpoint_credentials(resolve_blocks(data, secrets), secrets)

    return load_config(config_path, overrides, resolve=resolve)


def _summary_markdown(cfg: Any, summary: dict[str, Any]) -> str:
    rows = "\n".join(f"| {k} | {for_people(v)} |" for k, v in summary.items())
    return f"# Kuangchao run summary: {cfg.task.name}\n\n| field | value |\n|---|---|\n{rows}\n"


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
    # This process is the job's authority (it issues the tokens); it verifies, downloads and uploads checkpoints
    # itself, and those calls pass the permission guard, so it runs them trusted. The previous guard is restored
    # on the way out: `kc train` and tests share the process with other code.
    previous_guard = guard_api.install_guard(guard_api.AllowAll())
    opened: list[Path] = []  # the run whose authority this flow holds in memory, forgotten on the way out
    try:
        with prefect_watch.watching():  # issue 26 §5: a lost Prefect API ends the run, its summary on disk
            return _run(logger, config_path, list(overrides or []), resume, if_finished, opened, clock)
    except KuangchaoError as exc:  # the reason, in the flow run's own log (`prefect flow-run logs <id>`)
        logger.error("kuangchao-train failed: %s", exc)
        raise
    finally:
        guard_api.install_guard(previous_guard)
        for run_dir in opened:
            close_authority(run_dir)
        prefect_watch.body_ended()
        phases.release(clock)


def _logged_loss_points(cfg: Any, run_dir: Path, attempt: int, run_id: str, logger: Any) -> int | None:
    """How many loss values the job's MLflow run holds, read back as the job's ``monitor`` module (its own token,
    ``metrics_read`` on ``metrics:<task>``; trusted mode reads without one). None, with a warning, if unreadable."""
    from kuangchao_core.obs.metrics_reader import read_metrics
    from kuangchao_core.perm.issuance import monitor_guard

    try:
        guard = monitor_guard(cfg, run_dir, attempt) if cfg.permission.mode == "enforcing" else guard_api.AllowAll()
        with guard_api.thread_guard(guard):
            return len(read_metrics(tracking.tracking_uri(cfg), run_id, "loss", task=cfg.task.name))
    except Exception as exc:  # the summary says it could not check; the run itself succeeded
        logger.warning("could not read the run's metrics back from MLflow: %s", exc)
        return None


def _start_exporter(cfg: Any, run_dir: Path, run_id: str, logger: Any):
    """The job's Prometheus endpoint for all its attempts (``tracking.prometheus_port``, or the first free port of
    the span after it; None when off). Each scrape is a ``metrics_read`` of the job's ``monitor`` module, under that
    role's rules (trusted mode: unchecked)."""
    from kuangchao_core.config.schema import PROMETHEUS_PORT_SPAN
    from kuangchao_core.obs.prometheus import JobMetrics, MetricsExporter

    if cfg.tracking.prometheus_port is None:
        return None
    held: dict[str, Any] = {}

    def authorize() -> None:
        if cfg.permission.mode != "enforcing":
            return
        from kuangchao_core.perm.issuance import latest_attempt, monitor_guard

        guard = held.get("guard")
        if guard is None or guard.expires_in < 5 or guard.claims.attempt != latest_attempt(run_dir):
            guard = held["guard"] = monitor_guard(cfg, run_dir, latest_attempt(run_dir))
        guard.check("metrics_read", f"metrics:{cfg.task.name}")

    port = int(cfg.tracking.prometheus_port)
    try:
        exporter = MetricsExporter(
            JobMetrics(cfg.task.name, run_id), cfg.tracking.prometheus_host, port, authorize, PROMETHEUS_PORT_SPAN
        )
    except OSError as exc:
        where = f"{cfg.tracking.prometheus_host}:{port}"
        raise ConfigError([("tracking.prometheus_port", f"cannot serve the metrics on {where}: {exc}")]) from exc
    address = exporter.start()
    register_exporter(str(run_dir), exporter)
    logger.info("Prometheus metrics of the job at %s", address)
    return exporter


def _last_scrape(cfg: Any, exporter: Any, logger: Any) -> None:
    """The job's last values for whoever reads them: pushed to ``tracking.prometheus_pushgateway`` when set, and the
    endpoint stays up until one more scrape has read them (at most ``tracking.prometheus_grace_s``; not at all when
    nothing scraped it during the job). Neither once the Prefect API is lost (the run must end now)."""
    grace = float(cfg.tracking.prometheus_grace_s)
    if prefect_watch.current().lost:  # the run must end now (issue 26 §5)
        return
    gateway = cfg.tracking.prometheus_pushgateway
    if gateway:
        from kuangchao_core.obs.prometheus import push_final

        try:
            push_final(exporter.metrics, gateway, cfg.task.name, exporter.metrics.run)
            logger.info("final metrics pushed to the Pushgateway %s", gateway)
        except Exception as exc:  # the run's outcome does not depend on its metrics' last copy
            logger.warning("could not push the final metrics to the Pushgateway %s: %s", gateway, exc)
    if grace > 0 and exporter.scrapes:
        logger.info("waiting up to %.0f s for Prometheus to scrape the final metrics at %s", grace, exporter.address)
        waited = exporter.linger(grace)
        if waited >= grace:
            logger.warning("no scrape of %s in the %.0f s after the last step", exporter.address, grace)


def _nothing_to_train(cfg: Any, plan: ResumePlan, run_dir: Path) -> Any:
    """The Completed state named ``Skipped`` of a run that had nothing to train, with an honest summary."""
    summary = {
        "task": cfg.task.name,
        "outcome": "nothing to train",
        "trained_steps": 0,
        "steps": plan.step,
        "train_steps": cfg.train.steps,
        "lineage": plan.lineage,
        "checkpoint_path": plan.step_dir,
        "run_dir": str(run_dir),
    }
    message = f"0 steps trained: {plan.step_dir} is already at step {plan.step} of {cfg.train.steps}"
    create_markdown_artifact(
        _summary_markdown(cfg, summary), key="kuangchao-run-summary", description="training run summary"
    )
    return Completed(name="Skipped", message=message, data=summary)


def _resolve_base_model(cfg: Any, logger: Any) -> dict[str, str]:
    """``model.checkpoint: models:/NAME@ALIAS`` (or ``/VERSION``): the registered model version's files as a local
    directory, written into the config every attempt reads; returns the MLflow run tags naming it."""
    uri = cfg.model.checkpoint
    if not uri or not str(uri).startswith(MODEL_URI_PREFIX):
        return {}
    local, info = resolve_model_uri(str(uri), tracking.tracking_uri(cfg), Path(cfg.checkpoint.dir) / ".base-models")
    cfg.model.checkpoint = str(local)
    logger.info("model.checkpoint %s is %s version %d at %s", uri, info["name"], info["version"], local)
    return {"kuangchao.base_model": f"{info['name']} v{info['version']}", "kuangchao.base_model_uri": str(uri)}


def _run(
    logger: Any,
    config_path: str,
    overrides: list[str],
    resume: str | None,
    if_finished: str,
    opened: list[Path],
    clock: phases.PhaseClock,
) -> Any:
    secrets: dict[str, Any] = {}
    cfg = load_job_config(config_path, overrides, secrets)
    for path, why in unused_settings(cfg):  # from the user's config: the resolved one names every field
        logger.warning("%s: %s", path, why)
    base_model = _resolve_base_model(cfg, logger)
    raise_for_plan(cfg)  # a plan that cannot run is refused with its numbers before anything starts
    s3_settings = s3_settings_for(cfg, secrets) if cfg.checkpoint.uri else None
    fr_id = flow_run.get_id()
    run_dir = make_run_dir(cfg, fr_id)
    if cfg.permission.mode == "enforcing":  # keys in this process's memory only, from the block when configured
        open_authority(cfg, run_dir, secrets.get("signing_key_pem"))
        opened.append(run_dir)
    prefect_watch.note(task=cfg.task.name, run_dir=str(run_dir), flow_run_id=fr_id)
    resolved = run_dir / "config.yaml"
    resolved.write_text(cfg.to_yaml(), encoding="utf-8")
    logger.info("resolved config written to %s", resolved)

    resume_arg = resume or cfg.checkpoint.resume
    if resume_arg == "auto" and cfg.checkpoint.uri:
        restored = restore_checkpoint(cfg, None, s3_settings)
        for skip in restored["skipped"]:
            logger.warning("skipped corrupt checkpoint %s (step %s): %s", skip["uri"], skip["step"], skip["reason"])
    plan = plan_training(cfg, resume_arg, if_finished, logger.info)  # NothingToTrain: kc train's early refusal too
    if plan.step >= cfg.train.steps:  # if_finished: skip
        logger.warning("0 steps trained: %s is already at step %d of %d", plan.step_dir, plan.step, cfg.train.steps)
        return _nothing_to_train(cfg, plan, run_dir)
    worker_resume = plan.step_dir or "never"  # with the pinned lineage, later attempts prefer its newest step
    if plan.step_dir:  # another model's checkpoint fails here, naming both shapes, before anything starts
        from kuangchao_core.ckpt.integrity import read_manifest
        from kuangchao_core.engine.checkpointing import model_mismatch
        from kuangchao_core.models.llama import config_from_model_section

        mismatch = model_mismatch(read_manifest(plan.step_dir), config_from_model_section(cfg.model))
        if mismatch:
            raise ConfigError([("checkpoint.resume", f"{plan.step_dir}: {mismatch}")])

    with clock.phase("doctor"):
        doctor(cfg)
    multinode = cfg.cluster.mode != "local"
    topology = probing = None
    if not multinode:
        with clock.phase("topology"):
            probe_topology(cfg)
    else:  # the node agents measure every pair of candidate nodes while the data is validated
        probing = start_cluster_probe(cfg, run_dir, logger)
    with clock.phase("mlflow"):
        run_id = tracking.open_run(
            cfg,
            fr_id,
            extra_tags={"kuangchao.run_dir": str(run_dir), "kuangchao.lineage": plan.lineage, **base_model},
        )
    prefect_watch.note(mlflow_run_id=run_id)
    logger.info("MLflow run %s (experiment %s, store %s)", run_id, tracking.experiment_name(cfg), cfg.tracking.uri)
    exporter = _start_exporter(cfg, run_dir, run_id, logger)
    mirror = keeper = None
    t0 = time.time()
    attempts = 0
    interrupted = False
    causes: list[str] = []
    lost_nodes: list[str] = []  # machines lost in earlier attempts; the next attempts run without them
    try:
        try:
            with clock.phase("validation"):
                validate_data(cfg, mlflow_run_id=run_id)
        finally:
            topology = finish_cluster_probe(probing, logger) if probing is not None else None
        if topology is not None:  # placement reads the matrix
            tracking.log_json_artifact(cfg, run_id, topology.to_dict(), "topology", "topology.json")
        if plan.new:  # only once the data passed: a refused job leaves no checkpoint directory behind
            create_lineage(cfg, plan.lineage, started_from=plan.step_dir)
        lineage_before = plan.lineage
        plan, lease = hold_lineage(cfg, plan, str(fr_id), logger.warning)  # one writer per lineage
        keeper = LeaseKeeper(lease)
        keeper.start()
        prefect_watch.note(
            lineage=plan.lineage, lineage_dir=str(Path(cfg.checkpoint.dir) / cfg.task.name / plan.lineage)
        )
        if plan.lineage != lineage_before:
            tracking.set_tags(cfg, run_id, {"kuangchao.lineage": plan.lineage})
        if cfg.checkpoint.uri:  # every checkpoint to S3 while the job runs (the orchestrator holds the credentials)
            mirror = CheckpointMirror(cfg, plan.lineage, s3_settings)
            register_mirror(str(run_dir), mirror)

        def one_attempt(attempt: int) -> dict[str, Any]:
            nonlocal attempts
            attempts = attempt + 1
            job, job_file = config_for_attempt(cfg, lost_nodes), resolved
            if job is not cfg:  # a lost node left too few: the elastic re-plan, written beside the resolved config
                job_file = run_dir / f"config.attempt_{attempt}.yaml"
                job_file.write_text(job.to_yaml(), encoding="utf-8")
                logger.warning(
                    "elastic re-plan for attempt %d: data_parallel_size %d -> %d, gradient_accumulation_steps %d -> %d",
                    attempt,
                    cfg.parallel.data_parallel_size,
                    job.parallel.data_parallel_size,
                    cfg.parallel.gradient_accumulation_steps,
                    job.parallel.gradient_accumulation_steps,
                )
            placed: dict[str, Any] = {}
            if multinode:
                placed = place_attempt(
                    job, list(lost_nodes), topology.to_dict() if topology else None, str(run_dir), attempt
                )
                tracking.log_json_artifact(cfg, run_id, placed, "placement", f"attempt_{attempt}.json")
                logger.info(
                    "attempt %d placed (%s): %s",
                    attempt,
                    placed["placement"]["mode"],
                    "; ".join(f"{row['node']}: ranks {row['ranks']}" for row in placed["links"]),
                )
            with clock.phase("tokens" if clock.first_step is None else "restart_tokens"):
                tokens = issue_tokens(job, str(run_dir), attempt, placed.get("placement"))
            env = {**tokens, "KC_CKPT_LINEAGE": plan.lineage, ENV_GENERATION: str(lease.generation)}
            return launch(
                job,
                str(job_file),
                str(run_dir),
                attempt,
                worker_resume,
                run_id,
                env,
                lost_nodes,
                assignments=placed.get("assignments"),
                placement=placed.get("placement"),
            )

        def before_restart(next_attempt: int, exc: BaseException) -> None:
            failed = next_attempt - 1
            if exporter is not None:
                exporter.metrics.restart()
            node = getattr(exc, "node", None)
            if node is not None and getattr(exc, "rank", None) is None:
                lost_nodes.append(node)
                cause = f"node {node}: {getattr(exc, 'cause', exc)}"
            else:
                cause = f"rank {getattr(exc, 'rank', None)}: {getattr(exc, 'cause', exc)}"
            causes.append(f"attempt {failed}: {cause}")
            recover(cfg, failed, cause, run_id, plan.lineage, plan.step_dir)  # says the cause and the resume point once

        policy = RestartPolicy(max_restarts=cfg.cluster.max_restarts, setting="cluster.max_restarts")
        try:
            with prefect_watch.current().interruptible():  # a lost Prefect API stops the training here
                result = supervise(one_attempt, policy, on_restart=before_restart).result
        except WorkerFailed:
            tracking.set_tags(cfg, run_id, {"kuangchao.attempts": str(attempts)})
            raise
        if mirror is not None:
            mirror.close()  # the uploads in flight finish before the final check uploads what is left
        with clock.phase("checkpoint"):
            ckpt = checkpoint(cfg, run_id, s3_settings, plan.lineage)
        exported = aliases_before = None
        if cfg.tracking.log_model and ckpt["path"]:
            aliases_before = prefect_watch.before_registration(cfg)  # a lost API registers nothing
            with clock.phase("export"):
                exported = export_and_register(cfg, run_id, ckpt["path"], str(run_dir), result["final_loss"])
            registered = exported["registered"]
            logger.info(
                "model exported to %s (%s, manifest sha256 %s)%s",
                exported["dir"],
                exported["format"],
                exported["manifest_sha256"][:12],
                f"; registered {registered['name']} version {registered['version']} ({', '.join(registered['aliases'])})"
                if registered
                else "",
            )
        summary = {
            "task": cfg.task.name,
            "layout": tracking.layout_tag(cfg),
            "lineage": plan.lineage,
            "resumed_from": plan.step_dir,
            "steps": result["steps"],
            "trained_steps": (result["steps"] or plan.step) - plan.step,
            "final_loss": result["final_loss"],
            "tokens_per_s_mean": result["tokens_per_s_mean"],
            "tokens_per_s_last": result["tokens_per_s"],
            "heldout_accuracy": result["heldout_accuracy"],
            "loss_floor": result["loss_floor"],
            "attempts": attempts,
            "restarts": attempts - 1,
            "restart_causes": causes,
            "checkpoints": ckpt["steps"],
            "checkpoint_step": ckpt["step"],
            "checkpoint_path": ckpt["path"],
            "checkpoint_uri": ckpt["uri"],
            "model_dir": exported["dir"] if exported else None,
            "model_version": exported["registered"]["version"] if exported and exported["registered"] else None,
            "registry": exported["registry"] if exported else None,  # which alias moved, and why
            "mlflow_run_id": run_id,
            "flow_run_id": fr_id,
            "wall_s": round(time.time() - t0, 1),
            "run_dir": str(run_dir),
            "anomalies": result.get("anomalies", []),
            "prometheus": exporter.address if exporter is not None else None,
        }
        with clock.phase("summary"):
            summary["loss_points_in_mlflow"] = _logged_loss_points(cfg, run_dir, attempts - 1, run_id, logger)
        summary["startup_s"] = clock.startup()  # the measured phases before the first and after the last step
        summary["after_last_step_s"] = clock.after_last_step()
        # summary.json first; the artifact's call is bounded; when it fails the registration is undone
        prefect_watch.publish_summary(cfg, summary, run_dir, _summary_markdown(cfg, summary), exported, aliases_before)
        tracking.set_tags(cfg, run_id, {"kuangchao.attempts": str(attempts)})
        tracking.log_metrics(cfg, run_id, {"restarts": attempts - 1}, step=attempts)
        tracking.log_json_artifact(cfg, run_id, summary, "summary", "summary.json")
        tracking.close_run(cfg, run_id, "FINISHED")
        return summary
    except BaseException as exc:
        tracking.close_run(cfg, run_id, "FAILED")
        interrupted = not isinstance(exc, Exception)  # Ctrl-C, a lost Prefect API: no grace period
        raise
    finally:
        if keeper is not None:
            keeper.stop()
        if exporter is not None:
            if not interrupted:
                _last_scrape(cfg, exporter, logger)
            register_exporter(str(run_dir), None)
            exporter.stop()
        if mirror is not None:  # a failed job keeps every checkpoint it saved in S3
            register_mirror(str(run_dir), None)
            mirror.close()
