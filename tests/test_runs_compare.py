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
