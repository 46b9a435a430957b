"""The guard at the last entry points (issue 4, L5.2/L5.4): global-config changes and metrics read/write.

Real tokens from a real Authority, real TokenGuards installed through ``guard_api``, a real AuditLog, a real MLflow
sqlite store and a real second process reading the shared global-config file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kuangchao_core.errors import ConfigError, PermissionDenied
from kuangchao_core.perm import guard_api
from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.audit_verify import read_records, verify_log
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.global_config import GlobalConfig
from kuangchao_core.perm.guard import TokenGuard
from kuangchao_core.perm.roles import Policy

JOB = "task-e@run1"
TASK = "task-e"
ROOT = Path(__file__).resolve().parent.parent

ROLE_SCOPES = {
    # each token names more than its role allows where that matters: the role must still cut it down
    "trainer": dict(interfaces=["metrics_write", "config_write"], objects=[f"metrics:{TASK}", f"config:{TASK}"]),
    "admin": dict(interfaces=["config_write", "metrics_read"], objects=[f"config:{TASK}", f"metrics:{TASK}"]),
    "monitor": dict(interfaces=["metrics_read"], objects=[f"metrics:{TASK}"]),
    "data_loader": dict(
        interfaces=["dataset_read", "metrics_read", "metrics_write"], objects=["dataset:synthetic", f"metrics:{TASK}"]
    ),
}


@pytest.fixture(scope="module")
def auth(tmp_path_factory):
    return Authority(tmp_path_factory.mktemp("auth") / "authority")


@pytest.fixture
def audit_path(tmp_path):
    return tmp_path / "audit" / "audit.jsonl"


@pytest.fixture(autouse=True)
def restore_guard():
    prev = guard_api.current_guard()
    yield
    guard_api.install_guard(prev)


def issue(auth, role, module):
    return auth.issue(module, role, JOB, 0, ttl_s=600, **ROLE_SCOPES[role])


def install(auth, role, module, audit):
    """Verify a freshly issued token and install its guard in this process."""
    claims = auth.verifier(JOB).verify(issue(auth, role, module), subject=module)
    guard = TokenGuard(claims, Policy(), audit=audit)
    guard_api.install_guard(guard)
    return guard


def records(path, **match):
    return [r for r in read_records(path) if all(r.get(k) == v for k, v in match.items())]


# ----------------------------------------------------------------------------------------- global configuration


def test_trainer_is_denied_a_global_config_change_and_it_is_audited(auth, tmp_path, audit_path):
    audit = AuditLog(audit_path, JOB)
    guard = install(auth, "trainer", "worker-0", audit)
    cfg = GlobalConfig(tmp_path / "global_config.json", TASK)
    with pytest.raises(PermissionDenied) as ei:
        cfg.set("log_level", "DEBUG")
    assert ei.value.code == R.ROLE_DENIED and ei.value.module_id == "worker-0"
    assert not cfg.path.exists()  # nothing was written
    [rec] = records(audit_path, decision="deny")
    assert (rec["action"], rec["resource"], rec["reason"], rec["jti"]) == (
        "config_write",
        f"config:{TASK}",
        R.ROLE_DENIED,
        guard.claims.jti,
    )
    assert not records(audit_path, action="config_change")
    # the trainer may still read the settings it runs under
    assert cfg.get("log_level", "INFO") == "INFO" and cfg.version == 0


def test_no_token_cannot_read_or_write(tmp_path, audit_path):
    from kuangchao_core.perm.guard import AuditedDenyAll

    guard_api.install_guard(AuditedDenyAll("worker-9", AuditLog(audit_path, JOB)))
    cfg = GlobalConfig(tmp_path / "g.json", TASK)
    for call in (lambda: cfg.get("lr_scale"), lambda: cfg.set("lr_scale", 0.5)):
        with pytest.raises(PermissionDenied) as ei:
            call()
        assert ei.value.code == R.NO_TOKEN
    assert [(r["action"], r["reason"]) for r in records(audit_path, decision="deny")] == [
        ("config_read", R.NO_TOKEN),
        ("config_write", R.NO_TOKEN),
    ]


_CHILD = textwrap.dedent(
    """
    import json, sys
    from kuangchao_core.perm import guard_api
    from kuangchao_core.perm.audit import AuditLog
    from kuangchao_core.perm.global_config import GlobalConfig
    from kuangchao_core.perm.guard import TokenGuard
    from kuangchao_core.perm.roles import Policy
    from kuangchao_core.perm.tokens import TrustStore, Verifier

    path, task, job, module, token_file, trust, audit_path, new_scale = sys.argv[1:9]
    claims = Verifier(TrustStore.load(trust), job_id=job).verify(open(token_file).read(), subject=module)
    guard_api.install_guard(TokenGuard(claims, Policy(), audit=AuditLog(audit_path, job)))
    cfg = GlobalConfig(path, task)
    out = {"log_level": cfg.get("log_level"), "version": cfg.version, "jti": claims.jti}
    if new_scale != "-":
        try:
            out["set_version"] = cfg.set("lr_scale", float(new_scale))
        except Exception as exc:
            out["set_error"] = [type(exc).__name__, getattr(exc, "code", None)]
    print(json.dumps(out))
    """
)


def _child(tmp_path, auth, role, module, audit_path, new_scale="-"):
    token_file = tmp_path / f"{module}.token"
    token_file.write_text(issue(auth, role, module))
    trust = auth.export_trust_store(tmp_path / "trust_store.json")
    args = [str(tmp_path / "global_config.json"), TASK, JOB, module, str(token_file), str(trust), str(audit_path)]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *args, new_scale],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_admin_change_is_applied_shared_and_audited_with_its_token_id(auth, tmp_path, audit_path):
    audit = AuditLog(audit_path, JOB, signer=auth.audit_signing_key(), checkpoint_every=4)
    admin = install(auth, "admin", "admin-cli", audit)
    cfg = GlobalConfig(tmp_path / "global_config.json", TASK)

    assert cfg.set("log_level", "debug") == 1
    assert cfg.set("checkpoint_interval", 50) == 2
    assert cfg.set("checkpoint_interval", 50) == 2  # same value: no new version, no record
    assert cfg.get("log_level") == "DEBUG" and cfg.get("checkpoint_interval") == 50
    snap = cfg.snapshot()
    assert snap.version == 2 and snap.updated["jti"] == admin.claims.jti

    # another process, holding only a trainer token, sees the change and still cannot make one
    seen = _child(tmp_path, auth, "trainer", "worker-1", audit_path, new_scale="0.5")
    assert (seen["log_level"], seen["version"]) == ("DEBUG", 2)
    assert seen["set_error"] == ["GuardDenied", R.ROLE_DENIED]
    # a second admin process changes a key; this process sees the new version
    other = _child(tmp_path, auth, "admin", "admin-2", audit_path, new_scale="0.25")
    assert other["set_version"] == 3
    assert cfg.get("lr_scale") == 0.25 and cfg.version == 3

    changes = records(audit_path, action="config_change")
    assert [(r["key"], r["old"], r["new"], r["version"], r["jti"], r["actor"]) for r in changes] == [
        ("log_level", None, "DEBUG", 1, admin.claims.jti, "admin-cli"),
        ("checkpoint_interval", None, 50, 2, admin.claims.jti, "admin-cli"),
        ("lr_scale", None, 0.25, 3, other["jti"], "admin-2"),
    ]
    denied = records(audit_path, decision="deny", actor="worker-1")
    assert [(r["action"], r["jti"]) for r in denied] == [("config_write", seen["jti"])]
    audit.checkpoint()
    report = verify_log(audit_path, log_id=JOB, trust_store=auth.trust)
    assert report.ok and report.checkpoints >= 1, report.to_json()


def test_values_are_validated_against_the_allow_list(auth, tmp_path, audit_path):
    install(auth, "admin", "admin-cli", AuditLog(audit_path, JOB))
    cfg = GlobalConfig(tmp_path / "g.json", TASK, extra_keys={"note": str.strip})
    for key, value in (("lr_scale", -1.0), ("lr_scale", float("nan")), ("log_level", "LOUD"), ("no_such", 1)):
        with pytest.raises(ConfigError):
            cfg.set(key, value)
    assert cfg.set("note", "  warmup done ") == 1 and cfg.get("note") == "warmup done"
    assert [r["key"] for r in records(audit_path, action="config_change")] == ["note"]


def test_change_is_rolled_back_when_it_cannot_be_audited(auth, tmp_path, audit_path):
    audit = AuditLog(audit_path, JOB)
    install(auth, "admin", "admin-cli", audit)
    cfg = GlobalConfig(tmp_path / "g.json", TASK)
    assert cfg.set("lr_scale", 2.0) == 1
    audit.close()  # the audit file descriptor is gone: the next record cannot be written
    with pytest.raises(Exception):  # noqa: B017 (whatever the log raises, the change must not stay)
        cfg.set("lr_scale", 3.0)
    assert cfg.get("lr_scale") == 2.0 and cfg.version == 1


# ----------------------------------------------------------------------------------------------------- metrics


@pytest.fixture(scope="module")
def mlflow_run(tmp_path_factory):
    """A real MLflow sqlite store with one run of TASK (metrics logged by the worker sink) and one of another task."""
    from mlflow.tracking import MlflowClient

    from kuangchao_core.obs.mlflow_sink import MlflowMetricSink

    d = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{d / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment(TASK, artifact_location=str(d / "artifacts"))
    run_id = client.create_run(exp, tags={"kuangchao.task": TASK}).info.run_id
    other = client.create_run(exp, tags={"kuangchao.task": "task-other"}).info.run_id
    prev = guard_api.current_guard()
    auth = Authority(d / "authority")
    claims = auth.verifier(JOB).verify(issue(auth, "trainer", "worker-0"))
    guard_api.install_guard(TokenGuard(claims, Policy()))
    try:
        sink = MlflowMetricSink(uri, run_id, task=TASK, flush_every_s=0.05)
        losses = [3.0 - 0.25 * s for s in range(6)]
        for step, loss in enumerate(losses):
            sink.log_step(step, {"loss": loss, "lr": 1e-3})
        sink.close()
    finally:
        guard_api.install_guard(prev)
    client.log_metric(other, "loss", 9.0, step=0)
    return uri, run_id, other, losses


def test_monitor_reads_metrics(auth, mlflow_run, audit_path):
    from kuangchao_core.obs.metrics_reader import read_metrics, read_run_summary

    uri, run_id, _, losses = mlflow_run
    install(auth, "monitor", "monitor", AuditLog(audit_path, JOB))
    assert read_metrics(uri, run_id, "loss", task=TASK) == list(enumerate(losses))
    summary = read_run_summary(uri, run_id, task=TASK)
    assert summary["task"] == TASK and summary["metrics"]["loss"] == losses[-1]
    [first] = records(audit_path, decision="allow", action="metrics_read")
    assert first["resource"] == f"metrics:{TASK}" and first["actor"] == "monitor"


def test_monitor_cannot_read_another_tasks_run_by_id(auth, mlflow_run, audit_path):
    from kuangchao_core.obs.metrics_reader import read_metrics

    uri, _, other, _ = mlflow_run
    install(auth, "monitor", "monitor", AuditLog(audit_path, JOB))
    with pytest.raises(PermissionDenied) as ei:
        read_metrics(uri, other, "loss", task=TASK)
    assert ei.value.code == R.OUT_OF_SCOPE
    assert [r["resource"] for r in records(audit_path, decision="deny")] == ["metrics:task-other"]


def test_data_loader_is_denied_metrics_read_before_mlflow_is_touched(auth, tmp_path, audit_path):
    from kuangchao_core.obs.metrics_reader import read_metrics, read_run_summary

    guard = install(auth, "data_loader", "data_loader-0", AuditLog(audit_path, JOB))
    db = tmp_path / "untouched.db"
    for call in (read_metrics, read_run_summary):
        kwargs = {"key": "loss"} if call is read_metrics else {}
        with pytest.raises(PermissionDenied) as ei:
            call(f"sqlite:///{db}", "0" * 32, task=TASK, **kwargs)
        assert ei.value.code == R.ROLE_DENIED
    assert not db.exists()
    denied = records(audit_path, decision="deny")
    assert [(r["action"], r["reason"], r["jti"]) for r in denied] == [
        ("metrics_read", R.ROLE_DENIED, guard.claims.jti)
    ] * 2


def test_mlflow_sink_refuses_to_start_under_a_data_loader(auth, tmp_path, audit_path):
    from kuangchao_core.obs.mlflow_sink import MlflowMetricSink

    install(auth, "data_loader", "data_loader-0", AuditLog(audit_path, JOB))
    db = tmp_path / "sink.db"
    with pytest.raises(PermissionDenied) as ei:
        MlflowMetricSink(f"sqlite:///{db}", "0" * 32, task=TASK)
    assert ei.value.code == R.ROLE_DENIED
    assert not db.exists()
    [rec] = records(audit_path, decision="deny")
    assert (rec["action"], rec["resource"]) == ("metrics_write", f"metrics:{TASK}")
