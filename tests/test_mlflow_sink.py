"""The workers' MLflow metric sink (obs/mlflow_sink.py): the store is opened on the sink's thread, so steps queued
before it is open are kept, and a resumed attempt still logs each step once."""

from __future__ import annotations

import pytest

from kuangchao_core.obs.mlflow_sink import MlflowMetricSink
from kuangchao_core.perm import guard_api


@pytest.fixture(autouse=True)
def allow_all():
    prev = guard_api.current_guard()
    guard_api.install_guard(guard_api.AllowAll())
    yield
    guard_api.install_guard(prev)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One MLflow store for the module (making one costs seconds); each test makes its own experiment in it."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{path / 'mlflow.db'}"
    return uri, MlflowClient(tracking_uri=uri), path


def _history(client, run_id: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))


def test_a_resumed_sink_logs_each_step_once_and_keeps_steps_queued_before_its_store_opened(store, tmp_path):
    uri, client, _ = store
    run_id = client.create_run(client.create_experiment("sink", artifact_location=str(tmp_path / "a"))).info.run_id
    first = MlflowMetricSink(uri, run_id, task="sink", flush_every_s=0.05)
    for step in range(1, 6):  # queued at once: the thread may not have opened the store yet
        first.log_step(step, {"loss": float(step)})
    first.close()
    assert _history(client, run_id) == [(s, float(s)) for s in range(1, 6)]

    # a later attempt resumed from step 3 trains steps 4.. again: only steps past the run's last one are logged
    second = MlflowMetricSink(uri, run_id, task="sink", flush_every_s=0.05)
    for step in range(4, 9):
        second.log_step(step, {"loss": 100.0 + step})
    second.log_final({"loss": 7.5}, 8)  # end-of-run values are logged whatever came before
    second.close()
    assert second.last_logged_step == 5
    expected = [(s, float(s)) for s in range(1, 6)] + [(s, 100.0 + s) for s in range(6, 9)] + [(8, 7.5)]
    assert _history(client, run_id) == sorted(expected)


def test_every_step_reaches_the_run_in_few_calls_of_at_most_max_metrics(store, tmp_path, monkeypatch):
    """Issue 39: the sink writes whole steps in calls of at most ``max_metrics`` values (default 1000, MLflow's
    limit a call: 150 steps of 9 metrics, the old batch, would have been refused), and every step arrives."""
    from mlflow.tracking import MlflowClient

    sizes: list[int] = []
    real = MlflowClient.log_batch

    def counted(self, run_id, metrics=(), **kwargs):
        sizes.append(len(metrics))
        return real(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", counted)  # the real store writes them; only the sizes are noted
    uri, client, _ = store
    run_id = client.create_run(client.create_experiment("batches", artifact_location=str(tmp_path / "a"))).info.run_id
    keys = [f"m{i}" for i in range(9)]
    sink = MlflowMetricSink(uri, run_id, task="sink", flush_every_s=60.0, max_metrics=100)
    for step in range(1, 31):
        sink.log_step(step, {k: step + i / 10 for i, k in enumerate(keys)})
    sink.close()  # the one flush: everything queued
    assert sizes == [99, 99, 72], sizes  # 11 whole steps a call; never a step cut in two
    for i, k in enumerate(keys):
        assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) == [
            (s, s + i / 10) for s in range(1, 31)
        ]
