"""Prefect task ``doctor``: run the environment checks first. A failure stops the flow, after retries only when
every failed check is one a later try may pass (a service or node that did not answer: ``Check.transient``)."""

from __future__ import annotations

from typing import Any

from prefect import task

from kuangchao_core.errors import KuangchaoError
from kuangchao_core.sched.doctor import FLOW_REUSE_GLOO_S, DoctorReport, run_doctor
from kuangchao_core.sched.transient import mark_failure
from tasks.prefect_hooks import PREFECT_HOOKS
from tasks.retry_policy import TRANSIENT_RETRIES


class DoctorFailed(KuangchaoError):
    """One or more doctor checks failed; ``report`` holds them all (retried only if each is ``Check.transient``)."""

    def __init__(self, report: DoctorReport):
        self.report = report
        lines = [f"  {c.name}: {c.detail}\n    fix: {c.fix}" for c in report.failed]
        names = ", ".join(c.name for c in report.failed)
        super().__init__(f"kc doctor failed ({names}):\n" + "\n".join(lines))
        mark_failure(self, *report.failure_kind())


def _publish(report: DoctorReport) -> None:
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is not None:  # a flow run's report, as its artifact
        PREFECT_HOOKS.artifact(report.to_markdown(), "kc-doctor", "kc doctor: environment checks")


@task(name="doctor", **TRANSIENT_RETRIES)
def doctor(
    cfg: Any = None,
    gloo_timeout_s: float = 60.0,
    skip: tuple[str, ...] = ("slurm",),
    reuse_gloo_s: float = FLOW_REUSE_GLOO_S,
) -> dict:
    """Run ``run_doctor(cfg)``; publish the report as a markdown artifact; raise ``DoctorFailed`` on any failure.

    ``skip`` names check groups to leave out (``versions``, ``cuda``, ``gloo``, ``nodes``, ``checkpoint_storage``,
    ``mlflow``, ``prefect``, ``slurm``). A Gloo check passed on this machine within ``reuse_gloo_s`` is not run again.
    The Slurm checks are ``kc doctor``'s by default: in a flow the launch's ``sbatch`` fails at once with Slurm's own
    reason, and inside an allocation its nodes are busy by design.
    """
    report = run_doctor(cfg, gloo_timeout_s=gloo_timeout_s, skip=skip, reuse_gloo_s=reuse_gloo_s, hooks=PREFECT_HOOKS)
    _publish(report)
    if not report.ok:
        raise DoctorFailed(report)
    return report.to_dict()


doctor_task = doctor
