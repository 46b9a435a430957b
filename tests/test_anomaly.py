"""Anomaly flags (issue 13, RT.6) and the job's Prometheus endpoint.

- the detector on hand-made series: each kind fires on its cause and stays quiet on a normal run (the control);
- real Gloo trainers with a NaN injected into step 3's loss flag ``loss_nan`` on every rank at that step; with the
  action ``stop`` the run saves that step and ends with ``AnomalyStop`` (never retried), with ``warn`` it goes on;
- the orchestrator side: the ranks' event lines through the live view reach the Prometheus counters (a real HTTP
  scrape parsed with the text-format parser), an MLflow tag on a real store and a Prefect event on the session's
  server; a monitor whose role lacks ``metrics_read`` is refused the scrape (403)."""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kuangchao_core.config import config_from_dict
from kuangchao_core.engine.anomaly import AnomalyDetector
from kuangchao_core.errors import WorkerFailed
from kuangchao_core.sched.recovery import RestartPolicy
from tests.engine_helpers import tiny_job, trainer_in_process
from tests.mp import run_distributed

SETTINGS = config_from_dict({"task": {"name": "a"}}).train.anomaly


def _series(n, over=None):
    over = over or {}
    base = {"grad_norm": 1.0, "comm_share": 0.1, "mem_bytes": 1e8}
    return [{**base, "loss": 2.0 - 0.01 * i, **over.get(i, {})} for i in range(n)]


def _kinds(metrics_list, settings=SETTINGS):
    det = AnomalyDetector(settings)
    return [(a.kind, a.step) for step, m in enumerate(metrics_list, 1) for a in det.observe(step, m)]


def test_each_kind_fires_on_its_cause_and_a_normal_run_is_quiet():
    assert _kinds(_series(80)) == []  # the control
    assert _kinds(_series(10, {5: {"loss": float("nan")}})) == [("loss_nan", 6)]  # judged from the first step
    # loss and gradient norm: judged once a full window (20) of steps is seen; the same spike earlier is not
    assert _kinds(_series(40, {29: {"loss": 9.0}})) == [("loss_spike", 30)]
    assert _kinds(_series(40, {5: {"loss": 9.0}})) == []
    exploding = {i: {"grad_norm": 50.0} for i in (29, 30, 31)}  # grad_norm_steps (3) in a row
    assert _kinds(_series(40, exploding)) == [("grad_norm", 32)]
    assert _kinds(_series(40, {29: {"grad_norm": 50.0}})) == []  # one step's outlier (clipped): not an explosion
    assert _kinds(_series(40, {i: {"grad_norm": 50.0} for i in (3, 4, 5)})) == []  # before a full window
    assert _kinds(_series(10, {5: {"mem_bytes": 1e8 + 2 * 2**30}})) == [("memory_growth", 6)]
    # communication: the median of the last comm_share_steps (50) against the run's baseline (10 %): 40 % is 6x
    # the baseline's time relative to compute, flagged once the median is over it, then every window
    busy = {i: {"comm_share": 0.4} for i in range(100, 200)}
    assert _kinds(_series(200, busy)) == [
        ("comm_share", 126),
        ("comm_share", 146),
        ("comm_share", 166),
        ("comm_share", 186),
    ]
    jitter = {i: {"comm_share": 0.9} for i in range(50, 200, 3)}  # one step in three: never the median
    assert _kinds(_series(200, jitter)) == []
    strict = SETTINGS.model_copy(update={"comm_share": 0.05, "comm_share_steps": 1, "comm_baseline_factor": 0})
    assert _kinds(_series(3), strict)[0] == ("comm_share", 1)


def test_thresholds_are_warmed_up_and_relative_to_the_run():
    from kuangchao_core.engine.anomaly import comm_share_limit

    # a share that is high on this machine from the start (two ranks on shared cores) is its baseline, not an anomaly
    shared = {i: {"comm_share": 0.45 + 0.2 * ((i * 7) % 5 == 0)} for i in range(300)}
    assert _kinds(_series(300, shared)) == []
    assert comm_share_limit(0.3, 0.05) == 0.3 and round(comm_share_limit(0.3, 0.4), 3) == 0.727
    assert comm_share_limit(0.3, 0.95) == 0.9 and comm_share_limit(0.3, 0.4, factor=0) == 0.3
    # no judgement of loss or gradient norm during warm-up and the window after it
    det = AnomalyDetector(SETTINGS, warmup_steps=30)
    early = [
        (a.kind, s)
        for s in range(1, 51)
        for a in det.observe(s, {"loss": 9.0 if s % 7 == 0 else 2.0, "grad_norm": 50.0 if s % 9 == 0 else 1.0})
    ]
    assert early == []
    # a converged loss near zero that triples is noise (under loss_spike_min_delta); a jump of nats is a spike
    converged = {i: {"loss": 0.002 + 0.004 * (i % 4 == 0)} for i in range(100)}
    assert _kinds(_series(100, converged)) == []
    assert _kinds(_series(100, {**converged, 70: {"loss": 1.5}})) == [("loss_spike", 71)]


def _nan_at_step_3(rank, world_size, cfg):
    import sys

    from kuangchao_core.engine.trainer import AnomalyStop

    trainer = trainer_in_process(cfg, rank, world_size, timeout_ms=120_000)
    step = trainer.train_step

    def injected(batches):
        result = step(batches)
        if result.step == 3:
            result.loss = float("nan")  # what a diverging step reports
        return result

    trainer.train_step = injected
    out, sys.stdout = sys.stdout, io.StringIO()
    stopped = None
    try:
        trainer.run(resume="never")
    except AnomalyStop as exc:
        stopped = str(exc)
    finally:
        captured, sys.stdout = sys.stdout.getvalue(), out
    events = [json.loads(line.split("KC_EVENT ", 1)[1]) for line in captured.splitlines() if "KC_EVENT " in line]
    anomalies = [e for e in events if e["event"] == "anomaly"]
    return {
        "stopped": stopped,
        "steps": trainer.state.step,
        "anomalies": anomalies,
        "counts": dict(trainer.anomaly.counts),
    }


@pytest.mark.parametrize("action", ["stop", "warn"])
def test_a_nan_loss_is_flagged_on_every_rank_and_its_action_runs(tmp_path, action):
    cfg = tiny_job(
        str(tmp_path),
        task={"name": f"nan-{action}"},
        parallel={"data_parallel_size": 2},
        train={"steps": 5, "anomaly": {"actions": {"loss_nan": action}}},
        checkpoint={"interval": 100},
    )
    res = run_distributed(_nan_at_step_3, 2, args=(cfg,), timeout=300)
    for r in res:
        assert r["counts"]["loss_nan"] == 1, r
        assert (r["stopped"] is not None) == (action == "stop") and r["steps"] == (3 if action == "stop" else 5)
    assert [(a["kind"], a["step"], a["action"]) for a in res[0]["anomalies"]] == [("loss_nan", 3, action)]
    assert res[1]["anomalies"] == []  # rank 0 reports for the job
    saved = sorted(p.name for p in tmp_path.rglob("step_*") if p.is_dir())
    if action == "stop":  # the step that showed it is kept to look at; the stop is never retried
        assert saved == ["step_00000003"]
        assert not RestartPolicy(max_restarts=3).retryable(WorkerFailed(0, f"AnomalyStop: {res[0]['stopped']}"))
    else:
        assert saved == ["step_00000005"]  # the end of the run only


def _run_with_spikes(rank, world_size, cfg, spikes):
    """A real trainer whose reported loss/gradient norm at the given steps is multiplied (``{step: (what, x)}``)."""
    import sys

    trainer = trainer_in_process(cfg, rank, world_size, timeout_ms=120_000)
    step = trainer.train_step

    def injected(batches):
        result = step(batches)
        what, times = spikes.get(result.step, (None, 1.0))
        if what is not None:
            setattr(result, what, getattr(result, what) * times)
        return result

    trainer.train_step = injected
    out, sys.stdout = sys.stdout, io.StringIO()
    try:
        trainer.run(resume="never")
    finally:
        captured, sys.stdout = sys.stdout.getvalue(), out
    events = [json.loads(line.split("KC_EVENT ", 1)[1]) for line in captured.splitlines() if "KC_EVENT " in line]
    return {
        "counts": {k: n for k, n in trainer.anomaly.counts.items() if n},
        "flags": [(e["kind"], e["step"]) for e in events if e["event"] == "anomaly"],
        "baseline": trainer.anomaly.comm_baseline,
    }


@pytest.mark.serial  # the communication share of two ranks moves when another worker takes a core
def test_a_healthy_run_is_quiet_and_a_real_spike_still_fires(tmp_path):
    """Two real Gloo ranks on this machine's shared cores with the default thresholds: the healthy run flags
    nothing (communication share, early loss and gradient norm included); the same run with the loss ×20 at step
    110 and the gradient norm ×100 at steps 128-130 flags exactly those (the negative control of the quiet one)."""
    base = {
        "parallel": {"data_parallel_size": 2},
        "train": {"steps": 140, "warmup_steps": 10, "log_interval": 1000, "eval_interval": 1000},
        "checkpoint": {"interval": 1000},
    }
    healthy = run_distributed(
        _run_with_spikes, 2, args=(tiny_job(str(tmp_path / "a"), task={"name": "quiet"}, **base), {}), timeout=300
    )
    for r in healthy:
        assert r["counts"] == {} and r["baseline"] is not None, r
    spikes = {110: ("loss", 20.0), **{s: ("grad_norm", 100.0) for s in (128, 129, 130)}}
    spiked = run_distributed(
        _run_with_spikes, 2, args=(tiny_job(str(tmp_path / "b"), task={"name": "spiky"}, **base), spikes), timeout=300
    )
    for r in spiked:
        assert r["counts"] == {"grad_norm": 1, "loss_spike": 1}, r
    assert spiked[0]["flags"] == [("loss_spike", 110), ("grad_norm", 130)]


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = sample.labels.get("kind")
            out[sample.name + (f"{{{label}}}" if label else "")] = sample.value
    return out


def _prefect_events(name: str) -> list[dict]:
    import asyncio

    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as c:
            r = await c._client.post("/events/filter", json={"filter": {"event": {"prefix": [name]}}, "limit": 50})
            r.raise_for_status()
            return r.json().get("events", [])

    return asyncio.run(read())


def test_the_orchestrator_counts_tags_and_announces_anomalies_and_serves_metrics(prefect_api, tmp_path):
    from mlflow.tracking import MlflowClient

    from kuangchao_core.job.job_events import JobEvents
    from kuangchao_core.obs.console import LiveView
    from kuangchao_core.obs.jsonlog import emit_event
    from kuangchao_core.obs.prometheus import JobMetrics, MetricsExporter
    from tasks.prefect_hooks import PREFECT_HOOKS

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config_from_dict({"task": {"name": "kc-anomaly"}, "tracking": {"uri": uri}})
    client = MlflowClient(uri)
    run_id = client.create_run(
        client.create_experiment("kc-anomaly", artifact_location=str(tmp_path / "a"))
    ).info.run_id
    metrics = JobMetrics("kc-anomaly", run_id)
    exporter = MetricsExporter(metrics)
    url = exporter.start()
    try:
        view, lines = LiveView(stream=io.StringIO(), quiet=True), io.StringIO()
        events = JobEvents(cfg, "kc-anomaly@run", run_id, metrics, prefect=True, hooks=PREFECT_HOOKS)
        view.listeners.append(events)
        emit_event(
            "step", stream=lines, step=7, loss=2.5, tokens_per_s=1000.0, grad_norm=0.5, comm_share=0.4, step_time_s=0.2
        )
        emit_event(
            "anomaly", stream=lines, kind="comm_share", step=7, value=0.4, threshold=0.3, action="warn", message="m"
        )
        emit_event(
            "anomaly",
            stream=lines,
            kind="loss_nan",
            step=8,
            value=float("nan"),
            threshold=0.0,
            action="stop",
            message="n",
        )
        for line in lines.getvalue().splitlines():
            view.handle_line(f"[rank0]: {line}")  # as the launcher relays them
        got = _scrape(url)
        assert got["kuangchao_train_loss"] == 2.5 and got["kuangchao_train_step"] == 7
        assert got["kuangchao_train_step_seconds_count"] == 1 and got["kuangchao_train_restarts_total"] == 0
        assert (
            got["kuangchao_train_anomalies_total{comm_share}"] == 1
            and got["kuangchao_train_anomalies_total{loss_nan}"] == 1
        )
        tags = client.get_run(run_id).data.tags
        assert tags["kuangchao.anomaly.comm_share"] == "7" and tags["kuangchao.anomaly.loss_nan"] == "8"
        wanted, deadline, seen = {"kuangchao.anomaly.comm_share", "kuangchao.anomaly.loss_nan"}, time.time() + 30, set()
        while time.time() < deadline and not seen >= wanted:  # the session's server also has other jobs' events
            found = _prefect_events("kuangchao.anomaly.")
            seen = {e["event"] for e in found if e["resource"]["prefect.resource.id"] == "kuangchao.job.kc-anomaly@run"}
            time.sleep(0.5)
        assert seen >= wanted, seen  # announced, each on this job's resource
    finally:
        exporter.stop()


def test_a_scrape_is_a_monitor_read_under_its_roles_rules(tmp_path):
    from kuangchao_core.obs.prometheus import JobMetrics, MetricsExporter
    from kuangchao_core.perm.authority import Authority
    from kuangchao_core.perm.guard import TokenGuard
    from kuangchao_core.perm.roles import Policy

    auth = Authority(tmp_path / "authority")
    token = auth.issue("monitor", "monitor", "j", 0, interfaces=["metrics_read"], objects=["metrics:t"], ttl_s=600)
    claims = auth.verifier("j").verify(token, subject="monitor")
    for roles, allowed in ((None, True), ({"monitor": {"interfaces": [], "resources": []}}, False)):
        guard = TokenGuard(claims, Policy(roles))
        exporter = MetricsExporter(JobMetrics("t", "r"), authorize=lambda g=guard: g.check("metrics_read", "metrics:t"))
        url = exporter.start()
        try:
            if allowed:
                assert "kuangchao_train_restarts_total" in _scrape(url)
            else:
                with pytest.raises(urllib.error.HTTPError) as ei:
                    _scrape(url)
                assert ei.value.code == 403 and exporter.denied == 1
        finally:
            exporter.stop()
