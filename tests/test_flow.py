"""Issue 2 "Flow": a real flow run of the tiny config completes and MLflow holds its losses and manifest. The run's
workers keep NCCL's rules (issue 25): start to export on the stand-in device, no host tensor on a device group."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest_prefect import STEPS


def test_flow_run_completes_and_mlflow_holds_every_step(reference_run):
    from mlflow.tracking import MlflowClient

    summary = reference_run["summary"]
    assert summary["steps"] == STEPS and summary["attempts"] == 1 and summary["checkpoint_step"] == STEPS
    losses = reference_run["losses"]
    assert [s for s, _ in losses] == list(range(1, STEPS + 1)), "one loss per step, each once"
    assert losses[-1][1] < losses[0][1], "training must lower the loss"

    client = MlflowClient(reference_run["tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["prefect.flow_run_id"] == summary["flow_run_id"]
    assert tags["kuangchao.layout"] == "dp2-tp1-pp1-zero0"
    assert len(tags["kuangchao.config_hash"]) >= 8
    assert tags["kuangchao.attempts"] == "1"
    import socket

    node = socket.gethostname()  # MLflow's system metrics, one monitor per node, named after it
    assert f"system/{node}/cpu_utilization_percentage" in run.data.metrics, sorted(run.data.metrics)
    assert f"system/{node}/system_memory_usage_megabytes" in run.data.metrics
    assert "mlflow.source.git.commit" in tags
    assert run.data.params["train.steps"] == str(STEPS)

    step_dir = f"checkpoints/step_{STEPS:08d}"
    names = {a.path for a in client.list_artifacts(run.info.run_id, step_dir)}
    assert {f"{step_dir}/manifest.json", f"{step_dir}/checkpoint.json"} <= names
    local = client.download_artifacts(run.info.run_id, f"{step_dir}/manifest.json")
    with open(local, encoding="utf-8") as fh:
        manifest = json.load(fh)
    assert manifest["step"] == STEPS and manifest["files"]
    meta_path = client.download_artifacts(run.info.run_id, f"{step_dir}/checkpoint.json")
    with open(meta_path, encoding="utf-8") as fh:
        meta = json.load(fh)
    assert meta["step"] == STEPS and len(meta["manifest_sha256"]) == 64 and meta["size_bytes"] > 0


def test_flow_runs_summary_says_where_the_start_up_and_the_end_went(reference_run):
    """Issue 27 §2: the measured phases from the flow's start to the first step (here no kc train began the clock),
    and from the last step to the summary, each adding up to its total; both totals within the measured call."""
    summary = reference_run["summary"]
    startup, after = summary["startup_s"], summary["after_last_step_s"]
    assert {"doctor", "topology", "mlflow", "validation", "tokens", "workers", "other"} <= set(startup), startup
    assert min(startup[k] for k in ("doctor", "mlflow", "validation", "workers")) > 0, startup
    assert "imports" not in startup and startup["first_step"] >= 1  # the flow's clock starts with the flow
    for breakdown in (startup, after):
        parts = sum(v for k, v in breakdown.items() if k not in ("total", "first_step"))
        assert abs(parts - breakdown["total"]) <= 0.05, breakdown  # rounding only
    assert after["workers_exit"] > 0 and after["checkpoint"] > 0, after
    wall = reference_run["ended"] - reference_run["started"]
    assert 0 < startup["total"] and 0 < after["total"] and startup["total"] + after["total"] < wall, (startup, after)
    summary_json = json.loads((Path(summary["run_dir"]) / "summary.json").read_text())
    assert summary_json["startup_s"] == startup  # the same figures in the run directory


def test_flow_run_exports_logs_and_registers_its_model(reference_run):
    import hashlib
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from tests.conftest_prefect import override_value

    summary = reference_run["summary"]
    model_dir = Path(summary["model_dir"])
    record = json.loads((model_dir / "export.json").read_text())
    step_manifest = Path(summary["checkpoint_path"]) / "manifest.json"
    assert record["manifest_sha256"] == hashlib.sha256(step_manifest.read_bytes()).hexdigest()
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(record["files"])
    name = override_value(reference_run["overrides"], "tracking.register_model")
    client = MlflowClient(reference_run["tracking_uri"])
    version = client.get_model_version_by_alias(name, "newest")
    assert int(version.version) == summary["model_version"] and version.run_id == summary["mlflow_run_id"]
    assert version.tags["kuangchao.manifest_sha256"] == record["manifest_sha256"]
    logged = {a.path for a in client.list_artifacts(summary["mlflow_run_id"], "model")}
    assert {f"model/{f}" for f in record["files"]} == logged


def test_flow_run_leaves_no_secret_pins_its_audit_and_reads_metrics_as_the_monitor(reference_run):
    """The keys-off-disk and pinned-trust parts of issue 16 on a real flow run: no token or private key anywhere
    in the run directory, `kc audit --verify --run` passes against the pins the orchestrator recorded outside the run
    (issue 26: with no --tracking-uri it reads them from the Prefect API this session's server configures; the
    config's MLflow store, which --tracking-uri reads, holds the same sealed pin), the log ends with the job's seal,
    and the summary's metric read-back ran under the monitor's own token."""
    from pathlib import Path

    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from kuangchao.cli.main import app
    from kuangchao_core.perm.audit_pins import load_pins
    from kuangchao_core.perm.audit_verify import read_records

    summary = reference_run["summary"]
    run_dir = Path(summary["run_dir"])
    texts = [p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file()]
    assert not any("kc1.cap." in t for t in texts), "a capability token was written into the run directory"
    assert not any('"private' in t for t in texts)
    assert {"audit_pins.json", "policy.json", "trust_store.json"} <= {p.name for p in (run_dir / "authority").iterdir()}
    res = CliRunner().invoke(app, ["audit", "--verify", "--run", str(run_dir)])
    assert res.exit_code == 0, res.output
    from kuangchao.cli.prefect_artifacts import PREFECT_ARTIFACTS
    from kuangchao_core.perm.audit_external import collect_external_pins

    in_mlflow = collect_external_pins(reference_run["tracking_uri"]).for_run(run_dir)
    in_prefect = collect_external_pins(f"sqlite:///{run_dir}/no-store.db", prefect=PREFECT_ARTIFACTS).for_run(run_dir)
    assert any(p.sealed for p, _ in in_mlflow) and any(p.sealed for p, _ in in_prefect), (in_mlflow, in_prefect)
    nowhere = f"sqlite:///{run_dir}/no-store.db"  # issue 38: permission.pin_store holds the start and sealed pins
    in_store = collect_external_pins(nowhere, pin_store=reference_run["pin_store"]).for_run(run_dir)
    assert [p.sealed for p, _ in in_store][-1] and len(in_store) >= 2, in_store
    res = CliRunner().invoke(
        app,
        [
            "audit",
            "--verify",
            "--run",
            str(run_dir),
            "--tracking-uri",
            nowhere,
            "--pin-store",
            reference_run["pin_store"],
        ],
    )
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(
        app, ["audit", "--verify", "--run", str(run_dir), "--tracking-uri", reference_run["tracking_uri"]]
    )
    assert res.exit_code == 0, res.output
    tags = MlflowClient(reference_run["tracking_uri"]).get_run(summary["mlflow_run_id"]).data.tags
    assert "kuangchao.audit_pin" in tags
    assert _artifacts("kc-audit-pin", summary["flow_run_id"]), "the pin is also a Prefect artifact of the flow run"
    assert summary["loss_points_in_mlflow"] == len(reference_run["losses"])
    job_id = (run_dir / "job_id").read_text().strip()
    pins = load_pins(run_dir / "authority")
    assert pins and {p.job_id for p in pins} == {job_id}
    records = list(read_records(pins[-1].log_path))
    assert records[-1]["action"] == "audit_seal" and pins[-1].sealed, "the job sealed its log as its last act"
    reads = [r for r in records if r["action"] == "metrics_read" and r["decision"] == "allow"]
    assert reads and {r["actor"] for r in reads} == {"monitor"}
    datasets = [r for r in records if r["action"] == "dataset_read"]
    assert datasets and {r["actor"] for r in datasets} == {"data_loader-0", "data_loader-1"}  # never worker-N
    assert {r["decision"] for r in datasets} == {"allow"}


def _artifacts(key: str, flow_run_id: str) -> list:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read():
        async with get_client() as c:
            return await c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    return [a for a in asyncio.run(read()) if str(a.flow_run_id) == str(flow_run_id)]


def test_flow_run_workers_kept_nccl_rules_on_the_stand_in_device(reference_run):
    from pathlib import Path

    logs = sorted(Path(reference_run["workdir"], "runs").rglob("worker-*.jsonl"))
    ready = [json.loads(line) for f in logs for line in f.read_text().splitlines() if '"worker ready"' in line]
    assert len(ready) == 2 and {r["device"] for r in ready} == {"cpu:0"}, ready  # the stand-in, not the plain CPU
    assert reference_run["summary"]["steps"] == STEPS  # ... and the whole job ran under the rules to its export
