"""A real Prometheus scrapes a real ``kc train`` (issue 27 §4).

Prometheus (Debian's ``prometheus``: on PATH, else the package's binary unpacked from ``apt-get download``; never
installed as a service) runs with the shipped ``deployments/prometheus/prometheus.yml``, its scrape interval set to
1 s and its target to the job's ``tracking.prometheus_port``. The job, ``configs/tiny.yaml`` for a few hundred steps
(enforcing permissions: each scrape is a ``metrics_read`` of the job's ``monitor``), logs at a ``log_interval`` of
half the run, so step lines alone would give the gauge two values. Asserted through Prometheus's HTTP API:

- ``kuangchao_train_step`` changed at (nearly) every scrape while the job trained, the job's step rate times the
  scrape interval being at least two steps (so each scrape must see a new value);
- the last value scraped is the job's last step, and the step-time histogram counted every step (the endpoint stayed
  up after the last step until Prometheus read it: ``tracking.prometheus_grace_s``);
- every query of the Grafana dashboard ``deployments/grafana/kuangchao-training.json`` (its panels' and its
  variables') returns data.

And a real Pushgateway (Debian's ``prometheus-pushgateway``) receives the final metrics of each run
(``tracking.prometheus_pushgateway``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests.mp import free_port

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deployments" / "grafana" / "kuangchao-training.json"
SCRAPE_CONFIG = ROOT / "deployments" / "prometheus" / "prometheus.yml"
STEPS = 400
SCRAPE_S = 1


def _unpacked_debian(package: str, binary: str, cache: Path) -> str | None:
    """``/usr/bin/<binary>`` of Debian's ``package``, from the package file (``apt-get download``, ``dpkg-deb -x``
    into ``cache``): no service is installed or started. None when apt cannot fetch it."""
    path = cache / "usr" / "bin" / binary
    if path.is_file():
        return str(path)
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        return None
    cache.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(["apt-get", "download", package], cwd=cache, capture_output=True, timeout=300)
    if got.returncode != 0 and os.geteuid() == 0:  # no package lists yet
        subprocess.run(["apt-get", "update"], capture_output=True, timeout=300)
        got = subprocess.run(["apt-get", "download", package], cwd=cache, capture_output=True, timeout=300)
    debs = sorted(cache.glob(f"{package}_*.deb"))
    if got.returncode != 0 or not debs:
        return None
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(cache)], check=True, timeout=120)
    return str(path) if path.is_file() else None


def _debian_tool(package: str, binary: str) -> str:
    """``binary`` on PATH, or Debian's ``package`` unpacked into ~/.cache/kuangchao; else the test is skipped."""
    found = shutil.which(binary) or _unpacked_debian(package, binary, Path.home() / ".cache" / "kuangchao" / package)
    if not found:
        pytest.skip(f"no `{binary}` on PATH and Debian's package could not be fetched (apt-get download {package})")
    return found


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    """A ``prometheus`` executable (Debian's ``prometheus``)."""
    return _debian_tool("prometheus", "prometheus")


@pytest.fixture(scope="session")
def pushgateway_bin() -> str:
    """A Pushgateway executable (Debian's ``prometheus-pushgateway``)."""
    return _debian_tool("prometheus-pushgateway", "prometheus-pushgateway")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Prometheus:
    """One Prometheus process of the test's own: its config file, data dir, and free port."""

    def __init__(self, binary: str, tmp: Path, target_port: int):
        config = yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8"))  # the shipped scrape config
        config["global"]["scrape_interval"] = f"{SCRAPE_S}s"
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{target_port}"]}]
        path = tmp / "prometheus.yml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tmp / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={path}",
                f"--storage.tsdb.path={tmp / 'prometheus-data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=open(self.log, "w"),  # noqa: SIM115 - the process owns it
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while not self._ready():
            assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "prometheus not ready in 60 s"
            time.sleep(0.2)

    def _ready(self) -> bool:
        return _ready(self.url)

    def api(self, path: str, **params: str) -> dict:
        """The ``data`` of a Prometheus HTTP API answer."""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def samples(self, selector: str) -> list[tuple[float, float]]:
        """Every raw sample of the series ``selector`` (one series) over the last 10 minutes."""
        result = self.api("query", query=f"{selector}[10m]")["result"]
        assert len(result) == 1, f"{selector}: {result}"
        return [(float(t), float(v)) for t, v in result[0]["values"]]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _dashboard_queries() -> tuple[list[str], list[tuple[str, str]]]:
    """The dashboard's panel queries, and its variables' ``label_values(selector, label)`` queries."""
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    variables = []
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *(\w+)\)", var["query"]["query"])
            assert m, var["query"]
            variables.append((m.group(1), m.group(2)))
    return exprs, variables


def _grafana(expr: str, task: str) -> str:
    """``expr`` as Grafana sends it with variable task = this job's task, run = All, a 1 m rate interval."""
    return expr.replace("$task", task).replace("$run", ".*").replace("$__rate_interval", "1m")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_prometheus_scrapes_every_step_value_of_a_real_job(prometheus_bin, prefect_api, tmp_path):
    task = f"kc-prom-{uuid.uuid4().hex[:6]}"
    port = free_port()
    prom = Prometheus(prometheus_bin, tmp_path, port)
    try:
        sets = {
            "task.name": task,
            "train.steps": STEPS,
            "train.warmup_steps": 2,
            "train.log_interval": STEPS // 2,  # step lines alone would give the gauge 2 values
            "train.eval_interval": 10 * STEPS,
            "data.synthetic.num_train": 8000,
            "data.synthetic.num_eval": 16,
            "checkpoint.interval": STEPS,
            "checkpoint.dir": str(tmp_path / "ckpt"),
            "checkpoint.resume": "never",
            "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "tracking.log_model": "false",
            "tracking.register_model": "null",
            "tracking.system_metrics": "false",
            "tracking.prometheus_port": port,
            "permission.audit_log": str(tmp_path / "audit"),
        }
        env = {
            **os.environ,
            "PREFECT_API_URL": prefect_api,
            "PYTHONPATH": str(ROOT),
            "KC_RUNS_DIR": str(tmp_path / "runs"),
            "OMP_NUM_THREADS": "1",
        }
        argv = [sys.executable, "-m", "kuangchao.cli.main", "train", "--config", str(ROOT / "configs" / "tiny.yaml")]
        argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=480)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

        sel = f'{{task="{task}"}}'
        steps = prom.samples(f"kuangchao_train_step{sel}")
        assert steps[-1][1] == STEPS, f"the last step was not scraped: {steps[-3:]}"  # the grace period
        counted = prom.samples(f"kuangchao_train_step_seconds_count{sel}")
        assert counted[-1][1] == STEPS  # the histogram holds every step's time
        training = [(t, v) for t, v in steps if v < STEPS]
        assert len(training) >= 3, f"too few scrapes while the job trained to judge: {steps}"
        (t0, v0), (t1, v1) = training[0], training[-1]
        rate = (v1 - v0) / (t1 - t0)  # steps per second between the first and last scrape of the training
        gaps = sorted(b[0] - a[0] for a, b in zip(training, training[1:], strict=False))
        interval = gaps[len(gaps) // 2]
        assert interval == pytest.approx(SCRAPE_S, abs=0.3)
        assert rate * interval >= 2, f"{rate:.1f} steps/s: a scrape interval is under 2 steps, nothing to judge"
        values = [v for _, v in training]
        assert values == sorted(values)
        new_at_scrape = sum(1 for a, b in zip(values, values[1:], strict=False) if b > a)
        # every scrape saw a new step (one repeat allowed: a scrape landing in a pause of the job)
        assert new_at_scrape >= len(values) - 2, f"{len(set(values))} values in {len(values)} scrapes: {values}"

        at = str(steps[-1][0])  # the queries as a dashboard shows the job's last moment
        exprs, variables = _dashboard_queries()
        assert len(exprs) >= 8
        for expr in exprs:
            result = prom.api("query", query=_grafana(expr, task), time=at)["result"]
            assert result, f"no data for the dashboard's query {expr}"
        for selector, label in variables:
            series = prom.api("series", **{"match[]": _grafana(selector, task), "start": str(t0), "end": at})
            assert any(s.get(label) for s in series), f"no values for label_values({selector}, {label})"
    finally:
        prom.stop()


def test_the_final_metrics_are_pushed_to_a_real_pushgateway(pushgateway_bin, tmp_path):
    """``tracking.prometheus_pushgateway``: at the end of the job the flow pushes the final values (a Prometheus
    that scrapes the gateway gets them after the job is gone), grouped by task and run; an unreachable gateway is a
    warning, not a failed run."""
    from prometheus_client.parser import text_string_to_metric_families

    from kuangchao_core.config import config_from_dict
    from kuangchao_core.job.metrics_endpoint import last_scrape
    from kuangchao_core.obs.prometheus import JobMetrics, MetricsExporter

    url = f"http://127.0.0.1:{free_port()}"
    gateway = subprocess.Popen(
        [pushgateway_bin, f"--web.listen-address={url.removeprefix('http://')}"],
        stdout=open(tmp_path / "pushgateway.log", "w"),  # noqa: SIM115 - the process owns it
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not _ready(url):
            assert gateway.poll() is None and time.monotonic() < deadline, (tmp_path / "pushgateway.log").read_text()
            time.sleep(0.2)
        warnings: list[str] = []
        log = type("Log", (), {"info": lambda *a: None, "warning": lambda self, *a: warnings.append(a[0] % a[1:])})()
        for run, last in (("run-a", 3000), ("run-b", 1200)):
            cfg = config_from_dict({"task": {"name": "t"}, "tracking": {"prometheus_pushgateway": url}})
            metrics = JobMetrics("t", run)
            metrics.observe({"event": "steps", "step": last, "first_step": last - 1, "step_times": [0.01, 0.02]})
            exporter = MetricsExporter(metrics)
            try:
                last_scrape(cfg, exporter, log)  # nothing scraped the job: no grace period, only the push
            finally:
                exporter.stop()
        assert warnings == []
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
        steps = {
            s.labels["run"]: s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "kuangchao_train_step" and s.labels.get("job") == "kuangchao"
        }
        assert steps == {"run-a": 3000, "run-b": 1200}  # one group per run, the last value of each
        dead = config_from_dict(
            {"task": {"name": "t"}, "tracking": {"prometheus_pushgateway": f"http://127.0.0.1:{free_port()}"}}
        )
        exporter = MetricsExporter(JobMetrics("t", "run-c"))
        try:
            last_scrape(dead, exporter, log)
        finally:
            exporter.stop()
        assert len(warnings) == 1 and "could not push the final metrics" in warnings[0]
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)


def test_the_pushgateway_must_be_a_url():
    from kuangchao_core.config import config_from_dict
    from kuangchao_core.errors import ConfigError

    with pytest.raises(ConfigError, match="tracking.prometheus_pushgateway"):
        config_from_dict({"task": {"name": "t"}, "tracking": {"prometheus_pushgateway": "gateway:9091"}})
