"""A lost Prefect API ends ``kc train`` cleanly (issue 26 §5).

The attack: with the Prefect server killed mid-run, the job trained to the end, registered its model, then
``kc train`` never exited (the run-summary artifact call retried a refused connection, then the process drained its
event queue one refused connection after another). Here a real ``prefect server start`` is killed (SIGKILL of its
process group) once the job has trained its first steps: ``kc train`` must end within 60 s of the kill with exit 1,
one line naming the lost API and the summary, ``summary.json`` in the run directory, and no model version
registered. The fast tests check the pieces (:mod:`kuangchao_core.obs.prefect_watch`) against an address nobody
answers on.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from kuangchao_core.obs import prefect_watch
from kuangchao_core.obs.run_hooks import RunHooks
from kuangchao_core.obs.voice import message_of
from tests.fixtures import free_port

ROOT = Path(__file__).resolve().parent.parent
KC = str(ROOT / ".venv" / "bin" / "kc")
PREFECT = str(ROOT / ".venv" / "bin" / "prefect")


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/api"  # nothing listens there


def _wait(cond, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: the process ended with {proc.returncode}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")


def test_a_lost_api_interrupts_the_interruptible_stretch_only():
    watch = prefect_watch.APIWatch(_dead_url(), grace_s=0.5, interval_s=0.1)
    caught: list[BaseException] = []

    def body() -> None:
        try:
            with watch.interruptible():
                while True:
                    time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - the interrupt is what we look for
            caught.append(exc)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    watch.start()
    t.join(timeout=15)
    watch.stop()
    prefect_watch.body_ended()  # restores Prefect's client retries
    assert not t.is_alive() and caught and type(caught[0]).__name__ == "_Interrupt"
    assert watch.lost and "no answer" in watch.lost_reason
    with pytest.raises(prefect_watch.PrefectAPILost, match="was lost during the run"):
        watch.interruptible().__enter__()  # entered once lost: refused at once


def test_summary_is_written_before_the_artifact_and_a_failed_artifact_undoes_the_registration(tmp_path):
    """The end of the flow against a lost API: summary.json on disk, the registration undone, the aliases back."""
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    name = f"kc-lost-{uuid.uuid4().hex[:6]}"
    client.create_registered_model(name)
    exp = client.create_experiment("e")
    run = client.create_run(exp)
    v1 = client.create_model_version(name, "file:///nowhere", run_id=run.info.run_id)
    client.set_registered_model_alias(name, "newest", v1.version)
    client.set_registered_model_alias(name, "champion", v1.version)
    cfg = SimpleNamespace(tracking=SimpleNamespace(uri=uri, register_model=name))

    def refused(*_a, **_k):
        raise ConnectionRefusedError(111, "Connection refused")

    hooks = RunHooks(api_url=_dead_url, in_run=lambda: True, artifact=refused)  # a flow run's, its API gone
    with pytest.raises(prefect_watch.PrefectAPILost) as raised, prefect_watch.watching(600, hooks) as watch:
        prefect_watch.note(task="t", run_dir=str(tmp_path))
        before = {"newest": 1, "champion": 1}
        v2 = client.create_model_version(name, "file:///nowhere2", run_id=run.info.run_id)
        for alias in ("newest", "champion"):
            client.set_registered_model_alias(name, alias, v2.version)
        registered = {"name": name, "version": int(v2.version), "aliases": ["newest", "champion"]}
        prefect_watch.publish_summary(
            cfg, {"task": "t", "model_version": 2}, tmp_path, "# s", {"registered": registered}, before
        )
    prefect_watch.body_ended()
    assert watch.lost
    assert "the registration of" in str(raised.value) and "summary.json" in str(raised.value)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model_version"] is None and summary["outcome"].startswith("failed")
    assert [int(v.version) for v in client.search_model_versions(f"name='{name}'")] == [1]
    assert all(str(client.get_model_version_by_alias(name, a).version) == "1" for a in ("newest", "champion"))


def test_before_registration_refuses_once_the_api_is_lost():
    from types import SimpleNamespace

    cfg = SimpleNamespace(tracking=SimpleNamespace(uri="sqlite:///unused.db", register_model="m"))
    with pytest.raises(prefect_watch.PrefectAPILost), prefect_watch.watching(600, RunHooks(api_url=_dead_url)):
        prefect_watch.before_registration(cfg)
    prefect_watch.body_ended()


@pytest.mark.slow
def test_kc_train_ends_within_60s_of_the_prefect_server_being_killed(tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "KC_RUNS_DIR": str(tmp_path / "runs"),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PREFECT_PROFILES_PATH", None)
    env.pop(prefect_watch.ENV_GRACE, None)  # the default grace
    server = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=open(tmp_path / "server.log", "w"),  # noqa: SIM115 - the process owns it
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    kc = None
    try:

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        _wait(healthy, 180, "the Prefect server answering /health", server)
        task, model = f"kc-lost-{uuid.uuid4().hex[:6]}", f"kc-lost-model-{uuid.uuid4().hex[:6]}"
        sets = {
            "task.name": task,
            "train.steps": 3000,  # far more than the minute after the kill: the loss must stop the training
            "train.warmup_steps": 2,
            "train.log_interval": 5,
            "checkpoint.interval": 10,
            "checkpoint.keep_last": 2,
            "data.packing": "concat",
            "checkpoint.dir": str(tmp_path / "ckpt"),
            "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "tracking.register_model": model,
            "permission.audit_log": str(tmp_path / "audit"),
        }
        argv = [KC, "train", "--config", str(ROOT / "configs" / "tiny.yaml")]
        argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        kc = subprocess.Popen(
            argv,
            env=env,
            cwd=tmp_path,
            stdout=open(tmp_path / "kc.out", "w"),  # noqa: SIM115 - the process owns it
            stderr=open(tmp_path / "kc.err", "w"),  # noqa: SIM115
            start_new_session=True,
        )
        first_step = str(tmp_path / "ckpt" / task / "*" / "step_*" / "manifest.json")
        _wait(lambda: glob.glob(first_step), 300, "the job's first checkpoint", kc)
        os.killpg(server.pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            rc = kc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - killed
        err = (tmp_path / "kc.err").read_text(errors="replace")
        assert rc is not None and took < 60, f"kc train still running {took:.0f} s after the kill:\n{err[-3000:]}"
        assert rc == 1, err[-3000:]
        lines = [ln for ln in err.splitlines() if message_of(ln).startswith("kc train: the Prefect API at")]
        assert len(lines) == 1 and api in lines[0] and "the model was not registered" in lines[0], err[-3000:]
        summaries = glob.glob(str(tmp_path / "runs" / task / "*" / "summary.json"))
        assert len(summaries) == 1 and summaries[0] in lines[0]
        summary = json.loads(Path(summaries[0]).read_text())
        assert summary["outcome"] == "failed: the Prefect API was lost" and summary["model_version"] is None
        assert summary["newest_checkpoint"] and Path(summary["newest_checkpoint"], "manifest.json").exists()

        from mlflow.tracking import MlflowClient

        client = MlflowClient(sets["tracking.uri"])
        assert client.search_model_versions(f"name='{model}'") == []
        assert client.get_run(summary["mlflow_run_id"]).info.status == "FAILED"
    finally:
        for proc in (kc, server):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def test_the_exit_hook_of_kc_train_ends_with_its_command(monkeypatch):
    """kc train's exit-on-loss hook is removed when the command ends: a loss declared later in the same process
    (another flow run, a test runner) does not end that process."""
    ended: list[int] = []
    monkeypatch.setattr(prefect_watch.os, "_exit", ended.append)
    with prefect_watch.exit_when_lost(lambda _line: None, deadline_s=0.1):
        assert len(prefect_watch._HOOKS) == 1
    assert prefect_watch._HOOKS == []
    watch = prefect_watch.APIWatch(_dead_url())
    watch.declare_lost("declared by the test")
    prefect_watch.body_ended()
    time.sleep(0.3)
    assert ended == []
