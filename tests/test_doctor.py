"""``kc doctor``: real Gloo processes, real TCP agents, a moto S3 server over HTTP, a real Prefect server."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import yaml

from kuangchao_core.config import config_from_dict
from kuangchao_core.sched import doctor as D
from tests.fixtures import free_port

NO_GLOO = ("gloo",)


def _cfg_dict(tmp_path, **sections):
    d = {
        "task": {"name": "doc"},
        "model": {"preset": "tiny"},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    d.update(sections)
    return d


def _cfg(tmp_path, **sections):
    return config_from_dict(_cfg_dict(tmp_path, **sections))


@pytest.fixture(autouse=True)
def _no_prefect_api(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


def test_all_checks_pass_on_a_good_local_setup(tmp_path):
    rep = D.run_doctor(_cfg(tmp_path))
    assert rep.ok, rep.to_markdown()
    names = [c.name for c in rep.checks]
    for name in ("versions", "cuda", "gloo", "version_agreement", "checkpoint_storage", "mlflow", "prefect"):
        assert name in names
    assert "all_reduce ok" in rep.check("gloo").detail  # the probe really ran (sum checked in the subprocesses)
    assert not (tmp_path / "ckpt").exists()  # the probe leaves no directories behind
    assert list(tmp_path.iterdir()) == []


def test_gloo_failure_is_reported_with_a_fix(monkeypatch):
    monkeypatch.setattr(D, "_GLOO_PROBE", "import sys; sys.exit('gloo: no usable interface')")
    c = D.check_gloo(timeout_s=30)
    assert not c.ok and "rank 0" in c.detail and "no usable interface" in c.detail and c.fix


def test_unwritable_checkpoint_dir_fails_with_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rep = D.run_doctor(_cfg(tmp_path, checkpoint={"dir": str(blocker / "ckpt")}), skip=NO_GLOO)
    assert not rep.ok
    assert [c.name for c in rep.failed] == ["checkpoint_storage"]
    assert "checkpoint.dir" in rep.check("checkpoint_storage").fix


def test_cuda_check_fails_only_when_cuda_is_required_and_absent(tmp_path):
    import torch

    c = D.check_cuda(_cfg(tmp_path, train={"device": "cuda"}))
    if torch.cuda.is_available():
        assert c.ok
    else:
        assert not c.ok and "train.device: cpu" in c.fix
    assert D.check_cuda(_cfg(tmp_path)).ok


def test_s3_checkpoint_storage(tmp_path, s3_endpoint, monkeypatch):
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="kc-ckpt")
    ok = D.check_checkpoint_storage(
        _cfg(tmp_path, checkpoint={"uri": "s3://kc-ckpt/runs/a", "endpoint_url": s3_endpoint})
    )
    assert ok.ok, ok.detail
    assert s3.list_objects_v2(Bucket="kc-ckpt").get("KeyCount", 0) == 0  # probe object deleted
    missing = D.check_checkpoint_storage(
        _cfg(tmp_path, checkpoint={"uri": "s3://no-such-bucket/x", "endpoint_url": s3_endpoint})
    )
    assert not missing.ok and "no-such-bucket" in missing.detail and "bucket exists" in missing.fix


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server naming)
        code = 200 if self.path.endswith("/health") else 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"OK" if code == 200 else b"")

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_mlflow_and_prefect_http_endpoints(tmp_path, health_server, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    assert D.check_mlflow(_cfg(tmp_path, tracking={"uri": health_server})).ok
    bad = D.check_mlflow(_cfg(tmp_path, tracking={"uri": dead}))
    assert not bad.ok and "mlflow server" in bad.fix
    missing_dir = D.check_mlflow(_cfg(tmp_path, tracking={"uri": f"sqlite:///{tmp_path}/nope/m.db"}))
    assert not missing_dir.ok and "does not exist" in missing_dir.detail

    assert D.check_prefect().ok  # no API URL: ephemeral
    monkeypatch.setenv("PREFECT_API_URL", f"{health_server}/api")
    assert D.check_prefect().ok
    monkeypatch.setenv("PREFECT_API_URL", f"{dead}/api")
    c = D.check_prefect()
    assert not c.ok and "prefect server start" in c.fix


@pytest.fixture
def agents():
    started = []

    def start(host="127.0.0.2", versions=None):
        ready = threading.Event()
        threading.Thread(target=D.serve_versions, args=(host, 0, versions, ready), daemon=True).start()
        assert ready.wait(10)
        started.append(ready.sock)
        return f"{host}:{ready.port}"

    yield start
    for s in started:
        s.close()


def test_nodes_reachability_and_version_agreement(tmp_path, agents):
    same = agents()
    other = agents("127.0.0.3", versions={**D.local_versions(), "torch": "1.0.0", "hostname": "old-node"})
    dead = f"127.0.0.4:{free_port()}"

    def cluster(*hosts):
        return _cfg(
            tmp_path,
            cluster={"mode": "static", "nodes": [{"host": h, "gpus": 1} for h in hosts]},
            parallel={"data_parallel_size": len(hosts)},
        )

    checks, agree = D.check_nodes(cluster("localhost", same))
    assert all(c.ok for c in checks) and agree.ok and "2 nodes agree" in agree.detail

    checks, agree = D.check_nodes(cluster(same, other))
    assert all(c.ok for c in checks)
    assert not agree.ok and f"{other}=1.0.0" in agree.detail and "same" in agree.fix

    rep = D.run_doctor(cluster(same, dead), skip=NO_GLOO)
    assert [c.name for c in rep.failed] == [f"node:{dead}"]
    assert "kc doctor --serve" in rep.check(f"node:{dead}").fix
    assert "unreachable" in rep.check("version_agreement").detail and dead in rep.check("version_agreement").detail

    with socket.create_server(("127.0.0.5", 0)) as not_agent:  # a port that answers but is no doctor agent
        not_agent.settimeout(5)
        spec = f"127.0.0.5:{not_agent.getsockname()[1]}"
        threading.Thread(target=lambda: not_agent.accept()[0].close(), daemon=True).start()
        checks, _ = D.check_nodes(cluster(spec), timeout=2)
        assert not checks[0].ok and "not a kc doctor agent" in checks[0].detail


def test_gpu_versions_of_every_node_are_compared_over_the_agents(tmp_path, agents):
    """Issue 44 item 5 over real TCP agents: each node's driver/CUDA/NCCL line, the odd node named, the smoke
    skipped with its reason on CPU and not run through TCP agents on GPU nodes."""
    gpu = {"cuda": "12.4", "nccl": "2.21.5", "driver": "550.54.15", "gpus": ["NVIDIA H100"], "cuda_available": True}
    mine = D.local_versions()
    only_versions = ("gloo", "checkpoint_storage", "mlflow", "prefect")

    def cluster(*hosts):
        nodes = [{"host": h, "gpus": 1} for h in hosts]
        return _cfg(tmp_path, cluster={"mode": "static", "nodes": nodes}, parallel={"data_parallel_size": len(hosts)})

    rep = D.run_doctor(cluster(agents(), agents("127.0.0.3")), skip=only_versions)
    assert rep.ok, rep.to_markdown()
    for name in ("gpu_cuda", "gpu_nccl", "gpu_driver", "gpu_model"):
        assert "compared" in rep.check(name).detail  # one line per field across the nodes
    if mine["gpu"]["cuda"] == "none":
        assert rep.check("gpu_cuda").detail.startswith("CUDA none (torch ")
        assert rep.check("nccl_smoke").detail.startswith("skipped: no CUDA with NCCL on ")

    a = agents("127.0.0.6", versions={**mine, "gpu": gpu})
    b = agents("127.0.0.7", versions={**mine, "gpu": {**gpu, "cuda": "12.1", "driver": "535.104.05"}})
    c = agents("127.0.0.8", versions={**mine, "gpu": gpu})
    rep = D.run_doctor(cluster(a, b, c), skip=only_versions)
    assert [x.name for x in rep.failed] == ["gpu_cuda"], rep.to_markdown()
    assert f"{b}: 12.1" in rep.check("gpu_cuda").detail
    assert rep.check("gpu_driver").warn and f"{b}: 535.104.05" in rep.check("gpu_driver").detail
    assert rep.check("nccl_smoke").detail == "skipped: the nodes' gpu_cuda disagree (see those checks)"
    rep = D.run_doctor(cluster(a, c), skip=only_versions)  # the negative control: the same nodes without b agree
    assert rep.ok and [w.name for w in rep.warnings] == ["nccl_smoke"]
    assert rep.check("nccl_smoke").detail.startswith("not run: the TCP doctor agents")


def test_cli_json_and_table_and_exit_codes(tmp_path):
    import typer
    from typer.testing import CliRunner

    from kuangchao.cli.doctor import register

    app = typer.Typer()
    register(app)

    @app.command("noop")  # a second command so typer keeps sub-command dispatch
    def _noop() -> None:
        pass

    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(_cfg_dict(tmp_path)))
    runner = CliRunner()
    res = runner.invoke(app, ["doctor", "--config", str(good), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ok"] is True and any(c["name"] == "gloo" and c["ok"] for c in data["checks"])

    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_cfg_dict(tmp_path, checkpoint={"dir": str(blocker / "c")})))
    res = runner.invoke(app, ["doctor", "--config", str(bad)])
    assert res.exit_code == 1
    assert "checkpoint_storage" in res.output and "fix:" in res.output

    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump({**_cfg_dict(tmp_path), "wrld_size": 3}))
    res = runner.invoke(app, ["doctor", "--config", str(wrong)])
    assert res.exit_code == 2


def test_doctor_task_fails_fast_with_artifact(prefect_api, tmp_path):
    import asyncio

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    from kuangchao_core.errors import KuangchaoError
    from tasks.doctor import doctor as doctor_task

    blocker = tmp_path / "file"
    blocker.write_text("x")
    calls = []
    mine: set[str] = set()  # this test's flow runs: the session's server holds other tests' runs too

    @flow
    def check(cfg):
        mine.add(str(flow_run.get_id()))
        out = doctor_task(cfg, skip=NO_GLOO)
        calls.append(1)
        return out

    out = check(_cfg(tmp_path))
    assert out["ok"] is True
    assert any(c["name"] == "prefect" and "healthy" in c["detail"] for c in out["checks"])  # the harness server
    with pytest.raises(KuangchaoError, match="checkpoint_storage") as err:
        check(_cfg(tmp_path, checkpoint={"dir": str(blocker / "c")}))
    assert "fix:" in str(err.value)
    assert calls == [1]

    async def runs_and_artifacts():
        async with get_client() as c:
            runs = await c.read_task_runs()
            arts = await c.read_artifacts()
            return runs, arts

    runs, arts = asyncio.run(runs_and_artifacts())
    runs = [r for r in runs if str(r.flow_run_id) in mine]
    failed = [r for r in runs if r.name.startswith("doctor") and r.state.is_failed()]
    assert len(failed) == 1 and failed[0].run_count == 1  # no retries
    docs = [a for a in arts if a.key == "kc-doctor" and str(a.flow_run_id) in mine]
    assert len(docs) == 2 and any("checkpoint_storage | **FAIL**" in a.data for a in docs)


def test_flow_doctor_reuses_a_recent_gloo_pass_and_kc_doctor_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv("KC_CACHE_DIR", str(tmp_path))
    assert D.recent_gloo_pass(600) is None  # nothing remembered yet
    fresh = D.run_doctor(None, skip=("nodes", "checkpoint_storage", "mlflow", "prefect"), reuse_gloo_s=600)
    assert fresh.check("gloo").ok and "all_reduce ok" in fresh.check("gloo").detail
    reused = D.run_doctor(None, skip=("nodes", "checkpoint_storage", "mlflow", "prefect"), reuse_gloo_s=600)
    assert "not rerun" in reused.check("gloo").detail
    again = D.run_doctor(None, skip=("nodes", "checkpoint_storage", "mlflow", "prefect"))  # kc doctor: always runs
    assert "all_reduce ok" in again.check("gloo").detail
    memo = tmp_path / "doctor-gloo.json"
    data = json.loads(memo.read_text())
    memo.write_text(json.dumps({**data, "key": "another-machine"}))
    assert D.recent_gloo_pass(600) is None  # another host, Python or torch: run it again


def test_the_prefect_check_reads_the_active_profiles_api(tmp_path):
    """Issue 45: with no PREFECT_API_URL in the environment but one in the active Prefect profile, the doctor
    checks that server (here nothing listens: it fails naming it), never 'not set' (control: no profile)."""
    url = f"http://127.0.0.1:{free_port()}/api"
    (tmp_path / "profiles.toml").write_text(f'active = "remote"\n\n[profiles.remote]\nPREFECT_API_URL = "{url}"\n')
    code = "from kuangchao_core.sched.service_checks import check_prefect; c = check_prefect(2); print(c.ok, c.detail)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    for home, expect in ((tmp_path, f"False Prefect API {url}"), (tmp_path / "none", "True PREFECT_API_URL not set")):
        run_env = {**env, "PREFECT_HOME": str(home)}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=60)
        assert out.stdout.startswith(expect), out.stdout + out.stderr[-2000:]


def test_the_prefect_check_asks_the_orchestrators_settings_after_env_and_profile(tmp_path, monkeypatch):
    """Issue 43 item 6: the in-process Prefect settings (a test harness's API) reach the core's check through the
    caller's ``RunHooks.api_url``; without hooks the check imports no Prefect and finds nothing set (control)."""
    from kuangchao_core.obs.run_hooks import RunHooks
    from kuangchao_core.sched.service_checks import check_prefect

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("PREFECT_PROFILE", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))  # no profiles.toml
    url = f"http://127.0.0.1:{free_port()}/api"
    named = check_prefect(2, hooks=RunHooks(api_url=lambda: url))
    assert not named.ok and url in named.detail
    assert "not set" in check_prefect(2).detail
    assert "not set" in check_prefect(2, hooks=RunHooks(api_url=lambda: 1 / 0)).detail  # unreadable settings: unset
