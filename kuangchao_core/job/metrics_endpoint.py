"""The job's metrics as others read them: its Prometheus endpoint across all attempts, the last values once the job
ends, and the loss points its MLflow run holds (read back for the run summary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kuangchao_core.errors import ConfigError
from kuangchao_core.obs import prefect_watch, tracking
from kuangchao_core.obs.prometheus import register_exporter
from kuangchao_core.perm import guard_api


def start_exporter(cfg: Any, run_dir: Path, run_id: str, logger: Any):
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


def last_scrape(cfg: Any, exporter: Any, logger: Any) -> None:
    """The job's last values for whoever reads them: pushed to ``tracking.prometheus_pushgateway`` when set, and the
    endpoint stays up until one more scrape has read them (at most ``tracking.prometheus_grace_s``; not at all when
    no scraper is at work: nothing scraped it, or one read by hand). Neither once the Prefect API is lost (the run must end now)."""
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
    if grace > 0 and exporter.scraper_at_work():
        logger.info("waiting up to %.0f s for Prometheus to scrape the final metrics at %s", grace, exporter.address)
        waited = exporter.linger(grace)
        if waited >= grace:
            logger.warning("no scrape of %s in the %.0f s after the last step", exporter.address, grace)


def logged_loss_points(cfg: Any, run_dir: Path, attempt: int, run_id: str, logger: Any) -> int | None:
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
