"""Prefect task ``launch``: start the workers with torch.distributed.run and supervise them to the end
(:func:`kuangchao_core.job.launch_attempt.launch_workers`).

A worker's death or hang becomes an ordinary ``WorkerFailed`` exception (Prefect retries failures, not crashed
subprocesses), which the flow answers with ``recover`` and a new attempt.

Retries (issue 44 item 4) cover only a transient failure before any worker started — a port in use when the token
renewal server or the rendezvous is set up, a store locked while the audit key is pinned. Once the launcher has
created the attempt's directory (``run_dir/attempt_<n>``, made by every launch path before it starts a worker),
workers may have run, trained and written checkpoints: a retry of the task would start the same attempt again over
them, so every failure from then on is permanent for this task and the flow's recovery loop owns it (``recover``
picks the resume point, a new attempt gets its own number and directory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from kuangchao_core.job.flow_log import name_task_runs_in_api_logs
from kuangchao_core.job.launch_attempt import launch_workers
from kuangchao_core.sched.transient import mark_failure
from tasks.retry_policy import TRANSIENT_RETRIES

name_task_runs_in_api_logs()  # every task run's state line in the flow run's log names its task run


def attempt_dir(run_dir: str | Path, attempt: int) -> Path:
    """The directory the launcher makes for ``attempt`` before starting any of its workers."""
    return Path(run_dir) / f"attempt_{int(attempt)}"


@task(name="launch", log_prints=True, **TRANSIENT_RETRIES)
def launch(
    cfg: Any,
    config_path: str,
    run_dir: str,
    attempt: int = 0,
    resume: str | None = None,
    mlflow_run_id: str | None = None,
    env: dict[str, str] | None = None,
    exclude_nodes: list[str] | None = None,
    assignments: list[dict[str, Any]] | None = None,
    placement: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Prefect task: one attempt of the workers (see :func:`launch_workers`); a failure after the attempt's
    directory exists is marked permanent (not retried here: the flow's recovery answers it)."""
    try:
        return launch_workers(
            cfg,
            config_path,
            run_dir,
            attempt,
            resume,
            mlflow_run_id,
            env,
            exclude_nodes=exclude_nodes,
            assignments=assignments,
            placement=placement,
        ).to_dict()
    except Exception as exc:
        started = attempt_dir(run_dir, attempt)
        if started.exists():
            why = f"{type(exc).__name__} after the workers' start ({started.name} exists): for the flow's recovery"
            mark_failure(exc, False, why)
        raise
