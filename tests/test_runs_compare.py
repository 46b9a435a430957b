"""``kc runs compare``: runs side by side from a real MLflow sqlite store, and the loss plot."""

from __future__ import annotations

import json

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner


def _fake_run(client, exp_id, name, layout, losses):
    run = client.create_run(
        exp_id, tags={"mlflow.runName": name, "kuangchao.layout": layout, "kuangchao.attempts": "1"}
    )
    ms = [Metric("loss", v, 0, i + 1) for i, v in enumerate(losses)]
    ms += [Metric("tokens_per_s", 1000.0 + i, 0, i + 1) for i in range(len(losses))]
    client.log_batch(run.info.run_id, metrics=ms)
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def test_compare_lists_runs_and_writes_plot(tmp_path):
    from kuangchao.cli.main import app

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("cmp")
    _fake_run(client, exp, "a", "dp2-tp1-pp1-zero0", [3.0, 2.5, 2.0])
    b = _fake_run(client, exp, "b", "dp1-tp2-pp1-zero0", [3.0, 2.8, 2.6, 2.4])
    client.log_metric(b, "tokens_per_s_mean", 1234.5, step=4)  # what the engine logs at the final step
    png = tmp_path / "loss.png"
    res = CliRunner().invoke(app, ["runs", "compare", "cmp", "--tracking-uri", uri, "--json", "--plot", str(png)])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.output)}
    assert rows["a"]["final_loss"] == 2.0 and rows["a"]["steps"] == 3 and rows["a"]["layout"] == "dp2-tp1-pp1-zero0"
    assert rows["b"]["final_loss"] == 2.4 and rows["b"]["steps"] == 4 and rows["b"]["status"] == "FINISHED"
    # tokens/s: the run's mean where it was logged (as the run summary reports it), else the per-step median
    assert rows["b"]["tokens_per_s"] == 1234.5 and rows["a"]["tokens_per_s"] == 1001.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000

    table = CliRunner().invoke(app, ["runs", "compare", "cmp", "--tracking-uri", uri])
    assert table.exit_code == 0 and "2.4000" in table.output and "2.0000" in table.output
    missing = CliRunner().invoke(app, ["runs", "compare", "nope", "--tracking-uri", uri])
    assert missing.exit_code == 2


def test_compare_has_the_exact_match_column_and_the_experiment_opens_in_the_ml_view(tmp_path):
    """The held-out exact match (run-level ``heldout_accuracy``, else the last ``eval_exact_match``) is a column;
    an experiment made by a job carries MLflow's kind tag and the runs table's saved view (real sqlite store)."""
    from kuangchao.cli.main import app
    from kuangchao_core.config import config_from_dict
    from kuangchao_core.obs import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config_from_dict({"task": {"name": "cmp-view"}, "tracking": {"uri": uri}})
    run_a = tracking.open_run(cfg, "flowrun-a")
    run_b = tracking.open_run(cfg, "flowrun-b")
    client = MlflowClient(uri)
    client.log_batch(run_a, metrics=[Metric("loss", 1.0, 0, 1), Metric("eval_exact_match", 0.25, 0, 1)])
    client.log_batch(run_b, metrics=[Metric("loss", 0.5, 0, 1), Metric("eval_exact_match", 0.5, 0, 1)])
    client.log_metric(run_b, "heldout_accuracy", 0.973, step=1)
    exp = client.get_experiment_by_name("cmp-view")
    assert exp.tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    view = json.loads(exp.tags[tracking.RUNS_VIEW_TAG])
    assert {"metrics.`loss`", "metrics.`eval_loss`", "metrics.`eval_exact_match`", "metrics.`tokens_per_s`"} <= set(
        view["selectedColumns"]
    )
    path = tracking.experiment_ui_path(exp.experiment_id)
    assert path == f"/#/experiments/{exp.experiment_id}/runs?viewStateShareKey={tracking.RUNS_VIEW_KEY}"
    res = CliRunner().invoke(app, ["runs", "compare", "cmp-view", "--tracking-uri", uri])
    assert res.exit_code == 0 and "exact match" in res.output and "97.3 %" in res.output and "25.0 %" in res.output
    assert path in res.output
    rows = {
        r["run_id"]: r
        for r in json.loads(
            CliRunner().invoke(app, ["runs", "compare", "cmp-view", "--tracking-uri", uri, "--json"]).output
        )
    }
    assert rows[run_b]["exact_match"] == 0.973 and rows[run_a]["exact_match"] == 0.25
    # the control: an experiment made by hand gets the tags the next time a job opens a run in it
    bare = client.create_experiment("by-hand")
    assert tracking.EXPERIMENT_KIND_TAG not in client.get_experiment(bare).tags
    tracking.open_run(config_from_dict({"task": {"name": "by-hand"}, "tracking": {"uri": uri}}))
    assert tracking.RUNS_VIEW_TAG in client.get_experiment(bare).tags
