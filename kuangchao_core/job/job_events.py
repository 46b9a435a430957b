"""What the orchestrator does with the ranks' events while a job runs: the Prometheus metrics of the job, each new
checkpoint to the S3 mirror, and for each anomaly an MLflow tag and a Prefect event (``kuangchao.anomaly.<kind>``,
so a Prefect automation can react).

The launch task adds a :class:`JobEvents` to its live view (``LiveView.listeners``); the flow owns the job's
:class:`~kuangchao_core.obs.prometheus.JobMetrics` and exporter across attempts.
"""

from __future__ import annotations

import logging
from typing import Any

from kuangchao_core.obs import tracking
from kuangchao_core.obs.run_hooks import NO_HOOKS, RunHooks

log = logging.getLogger("kuangchao.tasks.job_events")


def anomaly_event(job_id: str, task: str, event: dict[str, Any]) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The event ``kuangchao.anomaly.<kind>`` of the job for an anomaly: its name, resource and payload."""
    kind = str(event.get("kind", "unknown"))
    payload = {k: event.get(k) for k in ("kind", "step", "value", "threshold", "action", "message")}
    resource = {"prefect.resource.id": f"kuangchao.job.{job_id}", "prefect.resource.name": task}
    return f"kuangchao.anomaly.{kind}", resource, payload


class JobEvents:
    """Listener of one attempt's events: feeds ``metrics`` (or nothing) and reacts to anomalies."""

    def __init__(
        self,
        cfg: Any,
        job_id: str,
        mlflow_run_id: str | None,
        metrics: Any = None,
        prefect: bool | None = None,
        mirror: Any = None,
        hooks: RunHooks = NO_HOOKS,
    ):
        """``hooks``: the orchestrator's (:class:`~kuangchao_core.obs.run_hooks.RunHooks`), which sends the events.
        ``prefect``: send them; by default when built inside a flow or task run (``hooks.in_run()``; outside one a
        Prefect client would start a temporary server of its own just for the event). ``mirror``: the run's
        :class:`~kuangchao_core.job.ckpt_mirror.CheckpointMirror`, given every ``checkpoint`` event."""
        self.mirror = mirror
        self.hooks = hooks
        self.prefect = hooks.in_run() if prefect is None else prefect
        self.cfg = cfg
        self.job_id = job_id
        self.run_id = mlflow_run_id
        self.metrics = metrics
        self.anomalies: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.observe(event)
        if event.get("event") == "checkpoint" and self.mirror is not None:
            self.mirror.submit(int(event.get("step", 0)))
        if event.get("event") != "anomaly":
            return
        self.anomalies.append(event)
        kind = str(event.get("kind", "unknown"))
        if self.run_id:
            try:
                tracking.set_tags(self.cfg, self.run_id, {f"kuangchao.anomaly.{kind}": str(event.get("step"))})
            except Exception as exc:  # the run goes on without the tag
                log.warning("anomaly %s not tagged in MLflow: %s", kind, exc)
        if not self.prefect:
            return
        try:
            self.hooks.event(*anomaly_event(self.job_id, self.cfg.task.name, event))
        except Exception as exc:
            log.warning("anomaly %s not sent as a Prefect event: %s", kind, exc)
