"""Prometheus metrics users can scrape (issue 27 §4), the parts: every step reaches the metrics through rank 0's step
feed (batched, sent by a background thread), the ``log_interval`` step lines are not counted twice, the endpoint
serves on a stable port (the next free one of the span when another job holds it) and stays up after the last step
until a scrape has read the final values. (A real Prometheus scraping a real job: tests/test_prometheus_scrape.py.)"""

from __future__ import annotations

import io
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kuangchao_core.config import config_from_dict
from kuangchao_core.errors import ConfigError, PermissionDenied
from kuangchao_core.obs.console import LiveView
from kuangchao_core.obs.jsonlog import emit_event, parse_event
from kuangchao_core.obs.prometheus import JobMetrics, MetricsExporter
from kuangchao_core.obs.step_feed import StepFeed
from tests.mp import free_port

ROOT = Path(__file__).resolve().parent.parent


def _values(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def _scrape(url: str) -> dict[str, float]:
    return _values(urllib.request.urlopen(url, timeout=10).read().decode())


def _lines_feed(period_s: float) -> tuple[StepFeed, io.StringIO]:
    out = io.StringIO()
    return StepFeed(period_s, emit=lambda kind, **fields: emit_event(kind, stream=out, **fields)), out


def test_the_step_feed_sends_every_step_in_batches_from_its_thread():
    feed, out = _lines_feed(0.05)
    try:
        for step in range(1, 201):
            feed.record(step, 0.001 * step, {"loss": 10.0 / step, "tokens_per_s": 100.0})
            if step % 20 == 0:
                time.sleep(0.06)  # the thread sends what accumulated meanwhile
        time.sleep(0.2)
        before_close = out.getvalue()  # sent by the thread alone
    finally:
        feed.close()
    events = [parse_event(line) for line in out.getvalue().splitlines()]
    assert all(e["event"] == "steps" for e in events)
    steps = [s for e in events for s in range(e["first_step"], e["step"] + 1)]
    assert steps == list(range(1, 201))  # every step, once, in order
    times = [t for e in events for t in e["step_times"]]
    assert times == pytest.approx([0.001 * s for s in range(1, 201)])
    assert 5 <= len(events) < 200  # batched, not a line per step
    assert events[-1]["step"] == 200 and events[-1]["loss"] == pytest.approx(10.0 / 200)
    assert parse_event(before_close.splitlines()[-1])["step"] == 200  # the thread sent them, not close()


def test_recording_a_step_writes_nothing_in_the_step_loop():
    feed, out = _lines_feed(3600)  # the thread would send in an hour
    try:
        for step in range(1, 101):
            feed.record(step, 0.01, {"loss": 1.0})
        assert out.getvalue() == ""  # the step loop only appended to a list
    finally:
        feed.close()
    (event,) = [parse_event(line) for line in out.getvalue().splitlines()]
    assert (event["first_step"], event["step"], len(event["step_times"])) == (1, 100, 100)  # close() sends the rest


def test_every_step_feeds_the_histogram_and_the_log_interval_lines_are_not_counted_twice():
    metrics = JobMetrics("t", "r")
    view = LiveView(stream=io.StringIO(), quiet=True)
    view.listeners.append(metrics.observe)
    lines = io.StringIO()
    for first in range(1, 100, 10):  # 10 batches of 10 steps; a log_interval of 25
        last = first + 9
        emit_event(
            "steps", stream=lines, step=last, first_step=first, step_times=[0.02] * 10, loss=1.0 / last, grad_norm=2.0
        )
        for step in range(first, last + 1):
            if step % 25 == 0:
                emit_event("step", stream=lines, step=step, loss=9.9, step_time_s=0.02, in_steps=True)
    for line in lines.getvalue().splitlines():
        view.handle_line(f"[rank0]: {line}")
    got = _values(generate_latest(metrics.registry).decode())
    assert got["kuangchao_train_step"] == 100 and got["kuangchao_train_loss"] == pytest.approx(0.01)
    assert got["kuangchao_train_step_seconds_count"] == 100 and got["kuangchao_train_grad_norm"] == 2.0
    assert not any(e["event"] == "steps" for e in view.events)  # not kept by the console view
    # a step line of a job without the feed (no in_steps) still counts
    metrics.observe({"event": "step", "step": 101, "step_time_s": 0.5})
    assert _values(generate_latest(metrics.registry).decode())["kuangchao_train_step_seconds_count"] == 101


def test_the_endpoint_takes_the_next_free_port_of_the_span(tmp_path):
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        exporter = MetricsExporter(JobMetrics("t", "r"), port=port, port_span=16)
        try:
            assert port < exporter.port < port + 16
            with pytest.raises(OSError, match=f"port {port} is in use"):
                MetricsExporter(JobMetrics("t", "r"), port=port)
        finally:
            exporter.stop()


def test_a_job_says_which_port_it_could_not_serve_on(tmp_path):
    from kuangchao_core.job.metrics_endpoint import start_exporter

    port = free_port()
    cfg = config_from_dict(
        {"task": {"name": "t"}, "tracking": {"prometheus_port": port}, "permission": {"mode": "trusted"}}
    )
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("kuangchao_core.config.schema.PROMETHEUS_PORT_SPAN", 1)
            with pytest.raises(ConfigError, match="tracking.prometheus_port"):
                start_exporter(cfg, tmp_path, "r", _NullLogger())


def test_the_port_and_grace_are_validated_and_documented_defaults():
    cfg = config_from_dict({"task": {"name": "t"}})
    assert cfg.tracking.prometheus_port == 9400 and cfg.tracking.prometheus_grace_s == 60.0
    for key, bad in (("prometheus_grace_s", -1), ("prometheus_port", 70000), ("prometheus_grace_s", "soon")):
        with pytest.raises(ConfigError, match=f"tracking.{key}"):
            config_from_dict({"task": {"name": "t"}, "tracking": {key: bad}})


def test_the_endpoint_stays_up_until_a_scrape_reads_the_final_values():
    metrics = JobMetrics("t", "r")
    exporter = MetricsExporter(metrics)
    url = exporter.start()
    try:
        assert exporter.linger(30) == 0.0  # nothing scraped it: nobody to wait for
        _scrape(url)  # one read by hand (issue 45: it used to hold the job for the whole grace period)
        assert exporter.linger(30) == 0.0
        _scrape(url)  # a Prometheus scrapes during the job: two reads, the last within twice their interval
        metrics.observe({"event": "steps", "step": 3000, "first_step": 3000, "step_times": [0.01]})  # the last step
        seen: dict[str, float] = {}

        def later_scrape() -> None:
            time.sleep(0.5)
            seen.update(_scrape(url))

        scraper = threading.Thread(target=later_scrape)
        scraper.start()
        waited = exporter.linger(30)
        scraper.join()
        assert 0.4 < waited < 10 and seen["kuangchao_train_step"] == 3000
        assert 0.25 <= exporter.linger(0.3) < 5  # no further scrape: at most the grace period
        time.sleep(1.2)  # the scraper gone: nothing to wait for
        assert exporter.linger(30) == 0.0
    finally:
        exporter.stop()


def test_a_denied_scrape_does_not_end_the_grace_period():
    allowed = {"yes": True}

    def authorize() -> None:
        if not allowed["yes"]:
            raise PermissionDenied("metrics_read", "metrics:t", "not allowed", "monitor")

    exporter = MetricsExporter(JobMetrics("t", "r"), authorize=authorize)
    url = exporter.start()
    try:
        _scrape(url)
        _scrape(url)
        allowed["yes"] = False
        codes: list[int] = []

        def denied_scrape() -> None:
            time.sleep(0.2)
            try:
                _scrape(url)
            except urllib.error.HTTPError as exc:
                codes.append(exc.code)

        scraper = threading.Thread(target=denied_scrape)
        scraper.start()
        waited = exporter.linger(1.0)
        scraper.join()
        assert codes == [403] and exporter.denied == 1 and waited >= 0.95
    finally:
        exporter.stop()


class _NullLogger:
    def info(self, *args) -> None:
        return

    warning = info


def test_a_real_job_feeds_every_step_though_it_logs_only_its_last(tmp_path, monkeypatch):
    """Two real Gloo workers (enforcing permissions, started as the flow starts them), 60 steps, log_interval above
    the run: the console sees one step line, the metrics every step."""
    from kuangchao_core.config import load_config
    from kuangchao_core.job.launch_attempt import launch_workers
    from kuangchao_core.obs.prometheus import register_exporter
    from kuangchao_core.perm.issuance import issue_tokens_for_run

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    steps = 60
    overrides = {
        "task.name": "kc-feed",
        "train.steps": steps,
        "train.warmup_steps": 2,
        "train.log_interval": 1000,
        "train.eval_interval": 1000,
        "checkpoint.interval": 1000,
        "checkpoint.dir": str(tmp_path / "ckpt"),
        "data.synthetic.num_train": 512,
        "data.synthetic.num_eval": 16,
        "parallel.micro_batch_size": 2,
        "permission.audit_log": str(tmp_path / "audit"),
        "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), [f"{k}={v}" for k, v in overrides.items()])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    env = issue_tokens_for_run(cfg, run_dir, 0)
    metrics = JobMetrics(cfg.task.name, "r")
    exporter = MetricsExporter(metrics)
    register_exporter(str(run_dir), exporter)
    view = LiveView(stream=io.StringIO(), quiet=True)
    try:
        summary = launch_workers(cfg, run_dir / "config.yaml", run_dir, 0, "never", None, env, view=view)
    finally:
        register_exporter(str(run_dir), None)
        exporter.stop()
    assert summary.steps == steps
    got = _values(generate_latest(metrics.registry).decode())
    assert got["kuangchao_train_step"] == steps and got["kuangchao_train_step_seconds_count"] == steps
    assert view.last_step["step"] == steps and view.last_step["in_steps"] is True  # the one step line
    logged = {r["step"]: r["loss"] for r in _worker_records(run_dir) if r.get("msg") == "step"}
    assert list(logged) == [steps] and got["kuangchao_train_loss"] == logged[steps]  # the last step's loss
    fed = [parse_event(line) for line in _launcher_lines(run_dir) if '"event": "steps"' in line]
    assert sum(len(e["step_times"]) for e in fed) == steps and len(fed) < steps  # every step, batched


def _worker_records(run_dir) -> list[dict]:
    import json

    path = run_dir / "logs" / "worker-0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")]


def _launcher_lines(run_dir) -> list[str]:
    return [line for path in sorted(run_dir.rglob("launcher.log")) for line in path.read_text().splitlines()]


def test_the_flow_waits_for_the_last_scrape_but_not_once_the_prefect_api_is_lost(monkeypatch):
    from types import SimpleNamespace

    from kuangchao_core.job import metrics_endpoint
    from kuangchao_core.obs import prefect_watch

    cfg = config_from_dict({"task": {"name": "t"}, "tracking": {"prometheus_grace_s": 0.5}})
    exporter = MetricsExporter(JobMetrics("t", "r"))
    url = exporter.start()
    try:
        _scrape(url)  # scraped during the job, by a scraper at work
        _scrape(url)
        t0 = time.monotonic()
        metrics_endpoint.last_scrape(cfg, exporter, _NullLogger())
        assert 0.45 <= time.monotonic() - t0 < 5  # nobody scraped again: the whole grace period
        monkeypatch.setattr(prefect_watch, "current", lambda: SimpleNamespace(lost=True))
        t0 = time.monotonic()
        metrics_endpoint.last_scrape(cfg, exporter, _NullLogger())
        assert time.monotonic() - t0 < 0.1  # a lost Prefect API ends the run at once
    finally:
        exporter.stop()
