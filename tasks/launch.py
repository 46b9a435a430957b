"""Prefect task ``launch``: start the workers with torch.distributed.run and supervise them to the end
(:func:`kuangchao_core.job.launch_attempt.launch_workers`).

A worker's death or hang becomes an ordinary ``WorkerFailed`` exception (Prefect retries failures, not crashed
subprocesses), which the flow answers with ``recover`` and a new attempt.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from kuangchao_core.job.flow_log import name_task_runs_in_api_logs
from kuangchao_core.job.launch_attempt import launch_workers

name_task_runs_in_api_logs()  # every task run's state line in the flow run's log names its task run


@task(name="launch", retries=0, log_prints=True)
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
    """Prefect task: one attempt of the workers (see :func:`launch_workers`)."""
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
