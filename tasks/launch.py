"""Prefect task ``launch``: start the workers with torch.distributed.run and supervise them to the end
(:func:`kuangchao_core.job.launch_attempt.launch_workers`).

A worker's death or hang becomes an ordinary ``WorkerFailed`` exception (Prefect retries failures, not crashed
subprocesses), which the flow answers with ``recover`` and a new attempt. The task itself retries (issue 44 item 4)
only a transient failure before any worker started (a port in use as the token renewal server or the rendezvous is
set up): once the attempt's directory ``run_dir/attempt_<n>`` exists (every launch path makes it before it starts a
worker) workers may have trained and written checkpoints, and a retry would start the same attempt over them; from
then on every failure is permanent here and the flow's recovery owns it (a new attempt, from the resume point).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from kuangchao_core.job.launch_attempt import launch_workers
from kuangchao_core.sched.transient import permanent_once_exists
from tasks.prefect_hooks import PREFECT_HOOKS
from tasks.prefect_logs import name_task_runs_in_api_logs
from tasks.retry_policy import TRANSIENT_RETRIES

name_task_runs_in_api_logs()  # every task run's state line in the flow run's log names its task run


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
    """Prefect task: one attempt of the workers (see :func:`launch_workers`); not retried once they started."""
    with permanent_once_exists(Path(run_dir) / f"attempt_{int(attempt)}", "the workers' start"):
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
            hooks=PREFECT_HOOKS,  # the run's events, artifacts and log
        ).to_dict()
