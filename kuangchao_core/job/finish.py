"""Phase three of a job: finish — the final checkpoint verified and mirrored, the model exported and registered,
the run summary published (``summary.json``, a Prefect artifact, MLflow) — and, whatever happened, the run's
services released: the lineage lease, the Prometheus endpoint (after its last scrape), the S3 mirror."""

from __future__ import annotations

import time
from typing import Any

from kuangchao_core.job.ckpt_mirror import register_mirror
from kuangchao_core.job.metrics_endpoint import last_scrape, logged_loss_points
from kuangchao_core.job.prepare import JobRun
from kuangchao_core.job.steps import JobSteps
from kuangchao_core.obs import phases, prefect_watch, tracking
from kuangchao_core.obs.console import for_people
from kuangchao_core.obs.prometheus import register_exporter


def summary_markdown(cfg: Any, summary: dict[str, Any]) -> str:
    """The run summary as the markdown of the ``kuangchao-run-summary`` artifact."""
    rows = "\n".join(f"| {k} | {for_people(v)} |" for k, v in summary.items())
    return f"# Kuangchao run summary: {cfg.task.name}\n\n| field | value |\n|---|---|\n{rows}\n"


def skipped_summary(job: JobRun) -> tuple[dict[str, Any], str]:
    """The honest summary of a run that had nothing to train, and the message of its ``Skipped`` state."""
    cfg, plan = job.cfg, job.plan
    summary = {
        "task": cfg.task.name,
        "outcome": "nothing to train",
        "trained_steps": 0,
        "steps": plan.step,
        "train_steps": cfg.train.steps,
        "lineage": plan.lineage,
        "checkpoint_path": plan.step_dir,
        "run_dir": str(job.run_dir),
    }
    return summary, f"0 steps trained: {plan.step_dir} is already at step {plan.step} of {cfg.train.steps}"


def _export(job: JobRun, steps: JobSteps, clock: phases.PhaseClock, logger: Any, ckpt: dict, result: dict):
    """The model exported and registered (``tracking.log_model``); ``(export record, aliases before)``."""
    cfg = job.cfg
    if not (cfg.tracking.log_model and ckpt["path"]):
        return None, None
    if cfg.model.moe is not None:  # config.moe_schema refuses log_model given with it; the default lands here
        logger.warning("model not exported: a MoE model has no Hugging Face export yet; it is in %s", ckpt["path"])
        return None, None
    aliases_before = prefect_watch.before_registration(cfg)  # a lost API registers nothing
    with clock.phase("export"):
        exported = steps.export_and_register(cfg, job.run_id, ckpt["path"], str(job.run_dir), result["final_loss"])
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
    return exported, aliases_before


def finish_run(
    job: JobRun, result: dict[str, Any], steps: JobSteps, clock: phases.PhaseClock, logger: Any
) -> dict[str, Any]:
    """The final checkpoint, the export, the run summary (returned), published and the MLflow run closed."""
    cfg, plan, attempts = job.cfg, job.plan, job.attempts
    if job.mirror is not None:
        job.mirror.close()  # the uploads in flight finish before the final check uploads what is left
    with clock.phase("checkpoint"):
        ckpt = steps.checkpoint(cfg, job.run_id, job.s3_settings, plan.lineage)
    exported, aliases_before = _export(job, steps, clock, logger, ckpt, result)
    summary = {
        "task": cfg.task.name,
        "layout": tracking.layout_tag(cfg),
        "lineage": plan.lineage,
        "resumed_from": plan.step_dir,
        "steps": result["steps"],
        "trained_steps": (result["steps"] or plan.step) - plan.step,
        "final_loss": result["final_loss"],
        "tokens_per_s_mean": result["tokens_per_s_mean"],  # step time only
        "tokens_per_s_loop": result.get("tokens_per_s_loop"),  # the whole loop, evaluations included
        "tokens_per_s_last": result["tokens_per_s"],
        "heldout_accuracy": result["heldout_accuracy"],
        "heldout": result.get("heldout"),  # the latest held-out loss: per token, and per character and byte
        "loss_floor": result["loss_floor"],
        "attempts": attempts,
        "restarts": attempts - 1,
        "restart_causes": job.causes,
        "checkpoints": ckpt["steps"],
        "checkpoint_step": ckpt["step"],
        "checkpoint_path": ckpt["path"],
        "checkpoint_uri": ckpt["uri"],
        "model_dir": exported["dir"] if exported else None,
        "model_version": exported["registered"]["version"] if exported and exported["registered"] else None,
        "registry": exported["registry"] if exported else None,  # which alias moved, and why
        "mlflow_run_id": job.run_id,
        "flow_run_id": job.flow_run_id,
        "wall_s": round(time.time() - job.t0, 1),
        "run_dir": str(job.run_dir),
        "anomalies": result.get("anomalies", []),
        "prometheus": job.exporter.address if job.exporter is not None else None,
    }
    with clock.phase("summary"):
        summary["loss_points_in_mlflow"] = logged_loss_points(cfg, job.run_dir, attempts - 1, job.run_id, logger)
    summary["startup_s"] = clock.startup()  # the measured phases before the first and after the last step
    summary["after_last_step_s"] = clock.after_last_step()
    # summary.json first; the artifact's call is bounded; when it fails the registration is undone
    markdown = summary_markdown(cfg, summary)
    prefect_watch.publish_summary(cfg, summary, job.run_dir, markdown, exported, aliases_before)
    tracking.set_tags(cfg, job.run_id, {"kuangchao.attempts": str(attempts)})
    tracking.log_metrics(cfg, job.run_id, {"restarts": attempts - 1}, step=attempts)
    tracking.log_json_artifact(cfg, job.run_id, summary, "summary", "summary.json")
    tracking.close_run(cfg, job.run_id, "FINISHED")
    for line in tracking.run_links(cfg, job.run_id):
        logger.info(line)
    return summary


def release_run(job: JobRun, interrupted: bool, logger: Any) -> None:
    """Whatever happened: the lineage lease let go, the Prometheus endpoint's last scrape (not when ``interrupted``:
    Ctrl-C, a lost Prefect API) and stop, the S3 mirror drained (a failed job keeps every checkpoint it saved)."""
    if job.keeper is not None:
        job.keeper.stop()
    if job.exporter is not None:
        if not interrupted:
            last_scrape(job.cfg, job.exporter, logger)
        register_exporter(str(job.run_dir), None)
        job.exporter.stop()
    if job.mirror is not None:
        register_mirror(str(job.run_dir), None)
        job.mirror.close()
