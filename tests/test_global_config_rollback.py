"""A global config rolled back across attempts is refused (issue 26 §5/§6).

Attack: between two attempts of an enforcing job, someone who can write the run directory copies back an older
``global_config.json`` — correctly signed by a trusted operator (``lr_scale 0.5``), but superseded by a newer change
(``lr_scale 0.25``) that the job's audit log records. A worker that already runs refuses it (it has seen the newer
version); a freshly started worker of the next attempt used to start from nothing and applied it. Now every worker
starts from the newest version the job's audit log records and refuses anything older, keeping its settings.

Real pieces: the job's tokens and authority as the flow issues them, ``kc config set`` with the operator's key, the
workers started by ``launch_workers`` under torchrun for attempt 1. Control: the newest file is applied.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.config.settings import run_settings
from kuangchao_core.engine.schedule import lr_at
from kuangchao_core.perm import guard_api
from kuangchao_core.perm.audit_verify import read_records
from kuangchao_core.perm.global_config import ConfigRefused, newest_recorded_version
from kuangchao_core.perm.issuance import audit_log_path, issue_tokens_for_run, job_id_for
from tests.test_global_config_job import _job, _records

RUN = CliRunner()


def _set(run_dir, pair: str) -> int:
    res = RUN.invoke(app, ["config", "set", "--run", str(run_dir), pair])
    assert res.exit_code == 0, res.output
    return int(res.output.split("version ")[1].split()[0])


@pytest.fixture
def rolled_back(tmp_path, monkeypatch):
    """An enforcing job whose operator set lr_scale 0.5 then 0.25, and whose file was then put back to 0.5."""
    from kuangchao_core.job.launch_attempt import ensure_global_config

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg, run_dir = _job(tmp_path, 3)
    env0 = issue_tokens_for_run(cfg, run_dir, 0)
    path = ensure_global_config(cfg, run_dir, env0)  # the job's initial values, signed by its authority
    old_version = _set(run_dir, "lr_scale=0.5")
    old_bytes = path.read_bytes()
    new_version = _set(run_dir, "lr_scale=0.25")
    new_bytes = path.read_bytes()
    assert new_version == old_version + 1
    path.write_bytes(old_bytes)  # the rollback: a genuine, operator-signed, older version
    audit = audit_log_path(cfg, job_id_for(cfg, run_dir))
    assert newest_recorded_version(audit, cfg.task.name) == new_version
    return {
        "cfg": cfg,
        "run_dir": run_dir,
        "path": path,
        "old": old_version,
        "new": new_version,
        "new_bytes": new_bytes,
        "rolled_bytes": old_bytes,
    }


def test_a_fresh_worker_reader_refuses_an_older_signed_version(rolled_back):
    from kuangchao_core.engine.live_config import worker_global_config

    cfg, run_dir, path = rolled_back["cfg"], rolled_back["run_dir"], rolled_back["path"]
    env1 = issue_tokens_for_run(cfg, run_dir, 1)  # a new attempt's worker environment
    previous = guard_api.install_guard(guard_api.AllowAll())  # reading needs a token; the check under test is trust
    try:
        gc = worker_global_config(run_settings(cfg).process, str(path), env1)
        with pytest.raises(ConfigRefused, match=f"version {rolled_back['old']} is older than {rolled_back['new']}"):
            gc.snapshot()
        path.write_bytes(rolled_back["new_bytes"])  # control: the newest version is accepted
        assert worker_global_config(run_settings(cfg).process, str(path), env1).snapshot().values["lr_scale"] == 0.25
    finally:
        guard_api.install_guard(previous)
    # `kc config set` never builds on a rolled-back file either (it would reuse a recorded version number)
    path.write_bytes(rolled_back["rolled_bytes"])
    res = RUN.invoke(app, ["config", "set", "--run", str(run_dir), "lr_scale=0.3"])
    assert res.exit_code == 1 and f"older than {rolled_back['new']}" in res.output, res.output
    assert path.read_bytes() == rolled_back["rolled_bytes"]


def test_the_next_attempts_workers_keep_their_settings_on_a_rolled_back_file(rolled_back):
    from kuangchao_core.job.launch_attempt import launch_workers

    cfg, run_dir = rolled_back["cfg"], rolled_back["run_dir"]
    env1 = issue_tokens_for_run(cfg, run_dir, 1)
    summary = launch_workers(cfg, run_dir / "config.yaml", run_dir, 1, "never", None, env1)
    assert summary.steps == 3
    log0 = run_dir / "logs" / "worker-0.jsonl"
    records = _records(log0)
    applied = [r for r in records if r.get("msg") == "global config applied" and r.get("key") == "lr_scale"]
    assert applied == [], f"a rolled-back version was applied: {applied}"
    refused = [r for r in records if "older than" in json.dumps(r)]
    assert refused, "the refusal is said in the worker's log"
    lrs = {r["step"]: r["lr"] for r in records if r.get("msg") == "step"}
    base = float(cfg.optimizer.lr)
    for step, lr in lrs.items():  # the job's own schedule, unscaled
        want = lr_at(step - 1, base, 3, cfg.train.warmup_steps, cfg.train.lr_schedule, cfg.train.min_lr_ratio)
        assert lr == pytest.approx(want, rel=1e-9), step
    audit = audit_log_path(cfg, job_id_for(cfg, run_dir))
    denials = [
        r
        for r in read_records(audit)
        if r.get("action") == "config_change" and r.get("decision") == "deny" and "older than" in r.get("reason", "")
    ]
    assert denials, "the refusal is audited"
