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


def test_a_moe_runs_routing_reaches_the_run_every_step_with_the_plot_of_its_load(store, tmp_path):
    """Rank 0's StepReport (engine/metrics.py) with a MoE step's tokens per expert (issue 40 item 5): each step's
    counts and imbalance in the run's metric history, the expert-load plot among its artifacts at the end."""
    from types import SimpleNamespace

    import torch

    from kuangchao_core.engine.metrics import StepReport

    uri, client, _ = store  # the module's store; an experiment of this test's own
    run_id = client.create_run(client.create_experiment("moe", artifact_location=str(tmp_path / "a"))).info.run_id
    sink = MlflowMetricSink(uri, run_id, task="moe", flush_every_s=0.05)
    report = StepReport(0, torch.device("cpu"), sink, total=4, start_step=0, stop_at=4, run_dir=str(tmp_path / "run"))
    loads = {s: {0: [s, 4, 2, 0], 2: [3, 3, 3, 3]} for s in range(1, 5)}
    for s, load in loads.items():
        result = SimpleNamespace(step=s, step_time_s=0.01, expert_load=load, metrics=lambda s=s: {"loss": 1.0 / s})
        report.after_step(result, result.metrics(), log_interval=2)
    report.close()
    sink.close()
    history = {m.step: m.value for m in client.get_metric_history(run_id, "moe_tokens.l0.e0")}
    assert history == {s: float(s) for s in loads}  # every step, the global count of expert 0 in layer 0
    worst = {m.step: m.value for m in client.get_metric_history(run_id, "moe_imbalance")}
    assert worst == {s: max(s, 4) * 4 / (s + 6) for s in loads}  # layer 0's max / mean; layer 2 is balanced
    assert {m.value for m in client.get_metric_history(run_id, "moe_imbalance.l2")} == {1.0}
    plots = [f.path for f in client.list_artifacts(run_id, "moe")]
    assert plots == ["moe/expert_load_steps_1-4.png"]
    from PIL import Image

    with Image.open(client.download_artifacts(run_id, plots[0], str(tmp_path / "dl"))) as image:
        assert image.size[0] == 800 and image.size[1] > 300  # 10 in wide at 80 dpi, three panels high


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
