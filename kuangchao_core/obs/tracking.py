"""MLflow runs of training jobs: open with params and tags, attach artifacts, close with a status.

All calls use ``MlflowClient`` (not the fluent API, which is not thread-safe) against ``tracking.uri``
(default ``sqlite:///mlflow.db`` in the working directory); the experiment is ``tracking.experiment`` or the task name.
Every call goes through :class:`~kuangchao_core.obs.tracking_store.StoreClient`: a locked store is waited for (at most
``tracking.store_wait_s``), a corrupt or unreachable one raises a one-line ``TrackingStoreError``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from kuangchao_core.obs.tracking_store import DEFAULT_WAIT_S, StoreClient

log = logging.getLogger("kuangchao.obs.tracking")

_PARAM_VALUE_LIMIT = 6000
_PARAMS_PER_BATCH = 100


#: MLflow's UI opens an experiment in the view its kind names; training runs belong in "Machine learning"
#: (without the tag, MLflow 3 opens a new experiment in its GenAI view of traces).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
#: MLflow 3.x's UI (3.17 checked in a browser, tests/test_mlflow_view_browser.py) opens an experiment in the view of
#: its sidebar's workflow switch ("GenAI" traces by default, kept in the browser); the experiment's ``runs`` tab opens
#: the runs table whatever the switch says — see :func:`experiment_ui_path`
RUNS_TAB = "runs"
#: the runs table's columns as a saved view of the experiment (MLflow has no server-side default columns: the UI
#: starts from Source, Models and Dataset and keeps a user's choice in the browser; a view stored as the tag
#: ``mlflow.sharedViewState.<key>`` opens with ``?viewStateShareKey=<key>`` — on the runs tab's own address only:
#: with any other query parameter, ``workflowType`` included, the UI ignores it)
RUNS_VIEW_KEY = "kuangchao-training"
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"
#: metric columns of that view: loss, eval loss, exact match, tokens/s (their latest values per run)
RUNS_VIEW_METRICS = ("loss", "eval_loss", "eval_exact_match", "heldout_accuracy", "tokens_per_s")


def runs_view_state() -> str:
    """The runs table's saved view (JSON, the UI's own state keys): MLflow's default attribute columns, then
    :data:`RUNS_VIEW_METRICS`, newest run first."""
    columns = [f"attributes.`{name}`" for name in ("Source", "Models", "Dataset")]
    columns += [f"metrics.`{name}`" for name in RUNS_VIEW_METRICS]
    return json.dumps({"selectedColumns": columns, "orderByKey": "attributes.start_time", "orderByAsc": False})


def experiment_ui_path(experiment_id: str) -> str:
    """The MLflow UI's path (after the server's address) of an experiment's runs table with the metric columns of
    :func:`runs_view_state`: ``/#/experiments/<id>/runs?viewStateShareKey=kuangchao-training``."""
    return f"/#/experiments/{experiment_id}/{RUNS_TAB}?viewStateShareKey={RUNS_VIEW_KEY}"


def experiment_tags() -> dict[str, str]:
    """The tags every experiment of a job gets: its kind (machine learning) and the runs table's saved view."""
    return {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, RUNS_VIEW_TAG: runs_view_state()}


def tracking_uri(cfg: Any) -> str:
    """The tracking URI of a job config."""
    return cfg.tracking.uri or "sqlite:///mlflow.db"


def experiment_name(cfg: Any) -> str:
    """The MLflow experiment of a job config."""
    return cfg.tracking.experiment or cfg.task.name


def store_wait_s(cfg: Any) -> float:
    """How long the job waits for a locked store (``tracking.store_wait_s``)."""
    return float(getattr(cfg.tracking, "store_wait_s", DEFAULT_WAIT_S))


def _client(uri: str) -> StoreClient:
    """A client of ``uri`` with the default wait for a locked store (the model registry's calls)."""
    return StoreClient(uri)


def store_client(cfg: Any) -> StoreClient:
    """The job's MLflow client: every call retried while the store is locked, any other store failure one line."""
    return StoreClient(tracking_uri(cfg), store_wait_s(cfg))


def git_commit(cwd: str | Path | None = None) -> str | None:
    """The current git commit of ``cwd``, if it is a git work tree."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def layout_tag(cfg: Any) -> str:
    """A short parallel-layout string such as ``dp2-tp1-pp1-zero0``."""
    p = cfg.parallel
    return f"dp{p.data_parallel_size}-tp{p.tensor_parallel_size}-pp{p.pipeline_parallel_size}-zero{p.zero_stage}"


def open_run(cfg: Any, flow_run_id: str | None = None, extra_tags: dict[str, str] | None = None) -> str:
    """Create the MLflow run of a job: params = flattened config, tags = layout, flow run, config hash, git commit."""
    from mlflow.entities import Param, RunTag

    client = store_client(cfg)
    name = experiment_name(cfg)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        exp_id = client.create_experiment(name, tags=experiment_tags())
    else:
        exp_id = exp.experiment_id
        for key, value in experiment_tags().items():  # an experiment made before, or by hand
            if key not in exp.tags:
                client.set_experiment_tag(exp_id, key, value)
    tags = {
        "kuangchao.layout": layout_tag(cfg),
        "kuangchao.config_hash": cfg.config_hash(),
        "kuangchao.task": cfg.task.name,
        "mlflow.runName": f"{cfg.task.name}-{(flow_run_id or 'local')[:8]}",
    }
    if flow_run_id:
        tags["prefect.flow_run_id"] = flow_run_id
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    tags.update(extra_tags or {})
    run = client.create_run(exp_id, tags=tags)
    run_id = run.info.run_id
    params = [Param(k, str(v)[:_PARAM_VALUE_LIMIT]) for k, v in sorted(cfg.flat().items())]
    for i in range(0, len(params), _PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[i : i + _PARAMS_PER_BATCH])
    client.log_batch(run_id, tags=[RunTag("kuangchao.attempt", "0")])
    return run_id


def set_tags(cfg: Any, run_id: str, tags: dict[str, str]) -> None:
    """Set tags on a run."""
    client = store_client(cfg)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)


def log_json_artifact(cfg: Any, run_id: str, obj: Any, artifact_path: str, filename: str) -> None:
    """Store ``obj`` as a JSON file artifact of the run."""
    client = store_client(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, filename)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=2, sort_keys=True, default=str)
        client.log_artifact(run_id, path, artifact_path=artifact_path)


def log_file_artifact(cfg: Any, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
    """Store a local file as an artifact of the run."""
    store_client(cfg).log_artifact(run_id, str(path), artifact_path=artifact_path)


def log_metrics(cfg: Any, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    """Log a few metrics at ``step`` (not for per-step training metrics: those go through the worker's sink)."""
    client = store_client(cfg)
    for key, value in metrics.items():
        client.log_metric(run_id, key, float(value), step=step)


def close_run(cfg: Any, run_id: str, status: str = "FINISHED") -> None:
    """Mark the run FINISHED, FAILED or KILLED. MLflow's own "View experiment at" line, which opens a tracking
    server's experiment in its GenAI view, is not printed: :func:`run_links` are the job's links instead."""
    os.environ.setdefault(SUPPRESS_URL_ENV, "true")
    store_client(cfg).set_terminated(run_id, status=status)


#: MLflow prints a run's and its experiment's address when a run on a tracking server ends, unless this is set
SUPPRESS_URL_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"


def run_links(cfg: Any, run_id: str) -> list[str]:
    """The run's page and its experiment's runs table (:func:`experiment_ui_path`) on a tracking server; none for a
    local store (``mlflow ui --backend-store-uri …`` serves it at an address this job does not know)."""
    uri = tracking_uri(cfg).rstrip("/")
    if not uri.startswith(("http://", "https://")):
        return []
    experiment_id = store_client(cfg).get_run(run_id).info.experiment_id
    return [
        f"MLflow run: {uri}/#/experiments/{experiment_id}/runs/{run_id}",
        f"MLflow runs table: {uri}{experiment_ui_path(experiment_id)}",
    ]


def close_failed_run(cfg: Any, run_id: str, status: str, logger: Any) -> None:
    """Mark a failed job's run ``status`` (FAILED or KILLED); a store gone bad meanwhile costs a warning, so the
    job's own error stays what the user sees."""
    try:
        close_run(cfg, run_id, status)
    except Exception as exc:
        logger.warning("MLflow run %s not marked %s: %s", run_id, status.lower(), exc)


def metric_history(cfg: Any, run_id: str, key: str = "loss") -> list[tuple[int, float]]:
    """(step, value) pairs of a metric, sorted by step."""
    hist = store_client(cfg).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in hist)
