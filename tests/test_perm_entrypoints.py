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
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kuangchao_core.errors import ConfigError, PermissionDenied
from kuangchao_core.perm import guard_api
from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.audit_verify import read_records, verify_log
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.global_config import GLOBAL_CONFIG_TYP, ConfigRefused, GlobalConfig
from kuangchao_core.perm.guard import TokenGuard
from kuangchao_core.perm.operator import OperatorKey
from kuangchao_core.perm.roles import Policy
from kuangchao_core.perm.signed_doc import read_document

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


@pytest.fixture(scope="module")
def alice(auth):
    """An operator key the job trusts."""
    key = OperatorKey("alice", Ed25519PrivateKey.generate())
    auth.trust_operators([key.public])
    return key


def test_a_worker_without_an_operator_signature_is_denied_a_change_and_it_is_audited(auth, tmp_path, audit_path):
    audit = AuditLog(audit_path, JOB)
    guard = install(auth, "trainer", "worker-0", audit)
    cfg = GlobalConfig(tmp_path / "global_config.json", TASK)
    with pytest.raises(PermissionDenied) as ei:
        cfg.set("log_level", "DEBUG")
    assert "signed by an operator" in str(ei.value)
    assert not cfg.path.exists()  # nothing was written
    [rec] = records(audit_path, decision="deny")
    assert (rec["action"], rec["resource"], rec["reason"], rec["jti"]) == (
        "config_write",
        f"config:{TASK}",
        "unsigned",
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
        with pytest.raises(PermissionDenied):
            call()
    assert [(r["action"], r["reason"]) for r in records(audit_path, decision="deny")] == [
        ("config_read", R.NO_TOKEN),
        ("config_write", "unsigned"),
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
    store = TrustStore.load(trust)
    claims = Verifier(store, job_id=job).verify(open(token_file).read(), subject=module)
    guard_api.install_guard(TokenGuard(claims, Policy(), audit=AuditLog(audit_path, job)))
    cfg = GlobalConfig(path, task, trust=store, job_id=job)  # a worker applies only verified versions
    out = {"log_level": cfg.get("log_level"), "version": cfg.version, "jti": claims.jti}
    if new_scale != "-":
        try:
            out["set_version"] = cfg.set("lr_scale", float(new_scale))
        except Exception as exc:
            out["set_error"] = type(exc).__name__
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


def test_operator_change_is_signed_applied_shared_and_audited_with_its_signer(auth, alice, tmp_path, audit_path):
    audit = AuditLog(audit_path, JOB, signer=auth.audit_signing_key(), checkpoint_every=4)
    install(auth, "trainer", "worker-0", audit)
    cfg = GlobalConfig(tmp_path / "global_config.json", TASK, trust=auth.trust, job_id=JOB)

    assert cfg.set("log_level", "debug", signer=alice) == 1
    assert cfg.set("checkpoint_interval", 50, signer=alice) == 2
    assert cfg.set("checkpoint_interval", 50, signer=alice) == 2  # same value: no new version, no record
    assert cfg.get("log_level") == "DEBUG" and cfg.get("checkpoint_interval") == 50
    snap = cfg.snapshot()
    assert snap.version == 2 and snap.updated["signer"] == alice.kid
    assert read_document(cfg.path)["kid"] == alice.kid  # the version on disk is a signed document

    # another process, holding only a trainer token, verifies and sees the change and still cannot make one
    seen = _child(tmp_path, auth, "trainer", "worker-1", audit_path, new_scale="0.5")
    assert (seen["log_level"], seen["version"]) == ("DEBUG", 2)
    assert seen["set_error"] == "PermissionDenied"
    assert cfg.set("lr_scale", 0.25, signer=auth) == 3  # the job's own authority may sign too (initial values)
    assert cfg.get("lr_scale") == 0.25 and cfg.version == 3

    changes = records(audit_path, action="config_change")
    assert [(r["key"], r["old"], r["new"], r["version"], r["signer"], r["actor"]) for r in changes] == [
        ("log_level", None, "DEBUG", 1, alice.kid, "operator:alice"),
        ("checkpoint_interval", None, 50, 2, alice.kid, "operator:alice"),
        ("lr_scale", None, 0.25, 3, auth.active_kid, "orchestrator"),
    ]
    denied = records(audit_path, decision="deny", actor="worker-1")
    assert [(r["action"], r["jti"]) for r in denied] == [("config_write", seen["jti"])]
    audit.checkpoint()
    report = verify_log(audit_path, log_id=JOB, trust_store=auth.trust)
    assert report.ok and report.checkpoints >= 1, report.to_json()


def test_direct_writes_and_untrusted_or_stale_versions_are_refused_and_audited(auth, alice, tmp_path, audit_path):
    """The attack of issue 16: ``global_config.json`` written without a token. The trainer's reader keeps its
    settings and records the refusal once per version of the file."""
    audit = AuditLog(audit_path, JOB)
    install(auth, "trainer", "worker-0", audit)
    path = tmp_path / "global_config.json"
    writer = GlobalConfig(path, TASK, trust=auth.trust, job_id=JOB)
    reader = GlobalConfig(path, TASK, trust=auth.trust, job_id=JOB)
    assert writer.set("lr_scale", 0.5, signer=alice) == 1
    assert reader.get("lr_scale") == 0.5  # control: a signed version is applied
    good = path.read_text()
    body = {"format": 2, "task": TASK, "job_id": JOB, "version": 9, "values": {"lr_scale": 1e12}, "updated": {}}
    mallory = OperatorKey("mallory", Ed25519PrivateKey.generate())  # a key the job does not trust
    attacks = {
        "unsigned": json.dumps(body),
        "untrusted signer": json.dumps(mallory.sign(GLOBAL_CONFIG_TYP, body)),
        "signed value out of bounds": json.dumps(alice.sign(GLOBAL_CONFIG_TYP, body)),
        "another job's version": json.dumps(
            alice.sign(GLOBAL_CONFIG_TYP, {**body, "job_id": "other@run", "values": {"lr_scale": 2.0}})
        ),
        "altered after signing": good.replace("0.5", "50.0"),
    }
    for name, text in attacks.items():
        path.write_text(text)
        with pytest.raises(ConfigRefused):
            reader.snapshot()
            pytest.fail(f"{name}: applied")
        with pytest.raises(ConfigRefused):  # asked again: refused again, recorded once
            reader.snapshot()
    refusals = records(audit_path, action="config_change", decision="deny")
    assert len(refusals) == len(attacks), [r["reason"] for r in refusals]
    assert "unsigned" in refusals[0]["reason"] and "not trusted" in refusals[1]["reason"]
    assert "lr_scale" in refusals[2]["reason"] and "other@run" in refusals[3]["reason"]
    # a replay of an older signed version after a newer one was applied
    path.write_text(good)
    older = good
    assert writer.set("lr_scale", 0.25, signer=alice) == 2 and reader.get("lr_scale") == 0.25
    path.write_text(older)
    with pytest.raises(ConfigRefused, match="older"):
        reader.snapshot()


def test_values_are_validated_against_the_allow_list(auth, alice, tmp_path, audit_path):
    install(auth, "trainer", "worker-0", AuditLog(audit_path, JOB))
    cfg = GlobalConfig(tmp_path / "g.json", TASK, extra_keys={"note": str.strip})
    for key, value in (("lr_scale", -1.0), ("lr_scale", float("nan")), ("log_level", "LOUD"), ("no_such", 1)):
        with pytest.raises(ConfigError):
            cfg.set(key, value, signer=alice)
    assert cfg.set("note", "  warmup done ", signer=alice) == 1 and cfg.get("note") == "warmup done"
    assert [r["key"] for r in records(audit_path, action="config_change")] == ["note"]


def test_change_is_rolled_back_when_it_cannot_be_audited(auth, alice, tmp_path, audit_path):
    audit = AuditLog(audit_path, JOB)
    install(auth, "trainer", "worker-0", audit)
    cfg = GlobalConfig(tmp_path / "g.json", TASK)
    assert cfg.set("lr_scale", 2.0, signer=alice) == 1
    audit.close()  # the audit file descriptor is gone: the next record cannot be written
    with pytest.raises(Exception):  # noqa: B017 (whatever the log raises, the change must not stay)
        cfg.set("lr_scale", 3.0, signer=alice)
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
