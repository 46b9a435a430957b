"""The job-global configuration in real jobs: `kc config set` reaches running Gloo workers at one common step.

The job is started the way the flow starts it (``issue_tokens_for_run`` then ``launch_workers``, permission mode
enforcing); the operator command runs while it trains. The applied change is read back from the workers' JSON logs
and the audit log.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.config import load_config
from kuangchao_core.engine.schedule import lr_at
from kuangchao_core.perm import guard_api
from kuangchao_core.perm.audit_verify import read_records, verify_log
from kuangchao_core.perm.issuance import audit_log_path, issue_tokens_for_run, job_id_for

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
RUN = CliRunner()


def _job(tmp_path: Path, steps: int, **extra) -> tuple:
    overrides = {
        "task.name": f"kc-gc-{uuid.uuid4().hex[:6]}",
        "train.steps": steps,
        "train.warmup_steps": 2,
        "train.log_interval": 1,
        "checkpoint.interval": 100000,
        "checkpoint.dir": str(tmp_path / "ckpt"),
        "data.synthetic.num_train": 512,
        "parallel.micro_batch_size": 2,
        "permission.audit_log": str(tmp_path / "audit"),
        "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        **extra,
    }
    cfg = load_config(TINY, [f"{k}={v}" for k, v in overrides.items()])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    return cfg, run_dir


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")]


def test_config_set_reaches_running_job_at_one_step(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    from prometheus_client.parser import text_string_to_metric_families

    from kuangchao_core.job.launch_attempt import launch_workers
    from kuangchao_core.obs.prometheus import JobMetrics, MetricsExporter, register_exporter

    steps = 400
    # every step's communication share counts as too high: the comm_share anomaly is raised in a real job
    cfg, run_dir = _job(
        tmp_path,
        steps,
        **{
            "train.anomaly.comm_share": 0.0001,
            "train.anomaly.comm_share_steps": 1,
            "train.anomaly.comm_baseline_factor": 0,
        },
    )
    env = issue_tokens_for_run(cfg, run_dir, 0)
    outcome: dict = {}
    exporter = MetricsExporter(JobMetrics(cfg.task.name, "r"))
    url = exporter.start()
    register_exporter(str(run_dir), exporter)

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                out[sample.name + (f"{{{sample.labels['kind']}}}" if "kind" in sample.labels else "")] = sample.value
        return out

    def job():
        try:
            outcome["summary"] = launch_workers(cfg, run_dir / "config.yaml", run_dir, 0, "never", None, env)
        except BaseException as exc:  # handed to the test thread
            outcome["error"] = exc

    t0 = time.time()
    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    log0, log1 = run_dir / "logs" / "worker-0.jsonl", run_dir / "logs" / "worker-1.jsonl"
    deadline = time.time() + 45
    while time.time() < deadline and thread.is_alive():
        if any(r.get("msg") == "step" and r["step"] >= 3 for r in _records(log0)):
            break
        time.sleep(0.2)
    assert thread.is_alive(), f"the job ended before the change could be made: {outcome}"
    # the exporter follows the ranks' event stream, which can trail their log files by a few steps
    during = scrape()  # a scrape while the job runs
    while during.get("kuangchao_train_step", 0) < 3 and time.time() < deadline and thread.is_alive():
        time.sleep(0.1)
        during = scrape()
    t_set = time.time()
    res = RUN.invoke(app, ["config", "set", "--run", str(run_dir), "lr_scale=0.5"])
    assert res.exit_code == 0, res.output
    version = int(res.output.split("version ")[1].split()[0])
    signer = res.output.split(", key ")[1].split(")")[0]
    thread.join(timeout=90)
    assert not thread.is_alive(), "the job did not finish"
    assert "error" not in outcome, outcome.get("error")
    assert outcome["summary"].steps == steps
    t_end = time.time()
    after = scrape()
    register_exporter(str(run_dir), None)
    exporter.stop()
    scraped_step = int(during["kuangchao_train_step"])
    logged = {r["step"]: r["loss"] for r in _records(log0) if r.get("msg") == "step"}
    assert scraped_step >= 3 and during["kuangchao_train_loss"] == logged[scraped_step]  # the latest step's loss
    assert after["kuangchao_train_step"] == steps and after["kuangchao_train_step_seconds_count"] == steps
    assert after["kuangchao_train_anomalies_total{comm_share}"] >= 1
    assert [a["kind"] for a in outcome["summary"].anomalies][:1] == ["comm_share"]

    applied = {}
    for rank, path in ((0, log0), (1, log1)):
        hits = [r for r in _records(path) if r.get("msg") == "global config applied" and r["key"] == "lr_scale"]
        assert len(hits) == 1, f"rank {rank}: {hits}"
        assert hits[0]["value"] == 0.5 and hits[0]["version"] == version
        applied[rank] = hits[0]["step"]
    assert applied[0] == applied[1], f"ranks applied the change at different steps: {applied}"
    at = applied[0]
    assert 3 <= at < steps, "the change must land while the job runs"

    base = float(cfg.optimizer.lr)
    lrs = {r["step"]: r["lr"] for r in _records(log0) if r.get("msg") == "step"}
    assert len(lrs) == steps
    for step, lr in lrs.items():
        scheduled = lr_at(step - 1, base, steps, cfg.train.warmup_steps, cfg.train.lr_schedule, cfg.train.min_lr_ratio)
        expected = scheduled * (0.5 if step > at else 1.0)
        assert lr == pytest.approx(expected, rel=1e-9), f"step {step}: lr {lr}, expected {expected} (applied at {at})"

    job_id = job_id_for(cfg, run_dir)
    audit = audit_log_path(cfg, job_id)
    changes = [r for r in read_records(audit) if r.get("action") == "config_change" and r.get("key") == "lr_scale"]
    admin = [r for r in changes if r.get("signer") == signer]
    assert len(admin) == 1, changes
    assert admin[0]["actor"].startswith("operator:") and admin[0]["new"] == 0.5 and admin[0]["old"] == 1.0
    assert admin[0]["version"] == version
    report = verify_log(audit, log_id=job_id)
    assert report.ok, report.to_json()
    print(f"\njob {t_end - t0:.1f}s, set at +{t_set - t0:.1f}s, applied after step {at}")


def test_config_set_rejects_bad_values_and_refuses_an_operator_the_job_does_not_trust(tmp_path):
    from kuangchao_core.perm.issuance import close_authority
    from kuangchao_core.perm.operator import create_operator_key

    cfg, run_dir = _job(tmp_path, 10)
    issue_tokens_for_run(cfg, run_dir, 0)
    close_authority(run_dir)
    previous = guard_api.current_guard()
    res = RUN.invoke(app, ["config", "set", "--run", str(run_dir), "lr_scale=-1"])
    assert res.exit_code == 2 and "lr_scale" in res.output
    res = RUN.invoke(app, ["config", "set", "--run", str(run_dir), "no_such_key=1"])
    assert res.exit_code == 2 and "no_such_key" in res.output
    assert not (run_dir / "global_config.json").exists(), "nothing may be written for a bad pair"
    # an operator key the job does not trust: refused, audited, nothing written
    create_operator_key(tmp_path / "eve.key", "eve")
    res = RUN.invoke(
        app, ["config", "set", "--run", str(run_dir), "lr_scale=0.5", "--operator-key", str(tmp_path / "eve.key")]
    )
    assert res.exit_code == 1 and "does not trust" in res.output
    assert not (run_dir / "global_config.json").exists()
    audit = audit_log_path(cfg, job_id_for(cfg, run_dir))
    denials = [r for r in read_records(audit) if r.get("decision") == "deny" and r.get("actor") == "operator:eve"]
    assert denials and denials[0]["resource"] == f"config:{cfg.task.name}"
    # control: the key of the operator who started the job is trusted
    res = RUN.invoke(app, ["config", "set", "--run", str(run_dir), "lr_scale=0.5"])
    assert res.exit_code == 0 and "version 1" in res.output, res.output
    assert guard_api.current_guard() is previous, "the command must restore the caller's guard"
