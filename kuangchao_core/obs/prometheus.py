"""The job's Prometheus metrics (SPEC RT.1), served by the orchestrating process at ``/metrics``.

:class:`JobMetrics` keeps one registry per job, fed with the ranks' events as the orchestrator receives them (the
``steps`` events of rank 0, ``anomaly`` events, restarts): ``kuangchao_train_loss``, ``_tokens_per_second``,
``_step_seconds`` (histogram), ``_grad_norm``, ``_comm_share``, ``_loss_scale`` (when the job reports one),
``_step``, ``_restarts_total`` and ``_anomalies_total{kind}``; labels are only ``task`` and ``run``, but for a MoE
model's routing (issue 40, ``engine.routing_report``): ``_moe_load_imbalance`` (the worst MoE layer's busiest
expert over the mean), ``_moe_layer_load_imbalance{layer}`` and ``_moe_expert_tokens{layer,expert}``.
Every step reaches it: rank 0's :class:`~kuangchao_core.obs.step_feed.StepFeed` sends batched ``steps`` events
(a few a second), whatever ``train.log_interval``.
:class:`MetricsExporter` serves it over HTTP; every scrape first calls ``authorize`` (the orchestrator passes the
job's ``monitor`` guard: reading metrics is a ``metrics_read`` on ``metrics:<task>``), and a denial is a 403. It
binds ``tracking.prometheus_port`` (9400) or the next free port of its span, and :meth:`MetricsExporter.linger` keeps
it up after the last step until one more scrape has read the final values.
"""

from __future__ import annotations

import errno
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from kuangchao_core.errors import PermissionDenied

log = logging.getLogger("kuangchao.obs.prometheus")
_ROUTING_KEY = re.compile(r"moe_(imbalance|tokens)\.l(\d{1,6})(?:\.e(\d{1,6}))?")
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_EXPORTERS: dict[str, MetricsExporter] = {}


class JobMetrics:
    """The Prometheus metrics of one job (task ``task``, run ``run``)."""

    def __init__(self, task: str, run: str):
        self.registry = CollectorRegistry()
        labels = {"task": task, "run": run}
        self._labels = labels
        self.task, self.run = task, run
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kuangchao_train_{name}", doc, names, registry=self.registry)

        self.loss = gauge("loss", "Training loss of the latest logged step.")
        self.tokens_per_second = gauge("tokens_per_second", "Global training throughput of the latest step.")
        self.grad_norm = gauge("grad_norm", "Gradient norm (before clipping) of the latest step.")
        self.comm_share = gauge("comm_share", "Share of the latest step's time spent in communication (rank 0).")
        self.loss_scale = gauge("loss_scale", "Dynamic loss scale of the latest step (fp16 jobs).")
        self.step = gauge("step", "The latest optimizer step the job logged.")
        self.step_seconds = Histogram(
            "kuangchao_train_step_seconds",
            "Wall time of an optimizer step.",
            names,
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.restarts = Counter(
            "kuangchao_train_restarts", "Restarts of the job's workers.", names, registry=self.registry
        )
        self.anomalies = Counter(
            "kuangchao_train_anomalies", "Anomalies flagged, by kind.", [*names, "kind"], registry=self.registry
        )
        self.restarts.labels(**labels)  # present at 0 from the start
        self.moe_imbalance = gauge("moe_load_imbalance", "MoE: the worst layer's max/mean tokens per expert.")
        self.moe_layer_imbalance = Gauge(
            "kuangchao_train_moe_layer_load_imbalance",
            "MoE: a layer's max/mean tokens per expert in the latest step.",
            [*names, "layer"],
            registry=self.registry,
        )
        self.moe_tokens = Gauge(
            "kuangchao_train_moe_expert_tokens",
            "MoE: tokens a layer routed to an expert in the latest step (global batch, before capacity).",
            [*names, "layer", "expert"],
            registry=self.registry,
        )

    def observe(self, event: dict[str, Any]) -> None:
        """Update from one event of the ranks: ``steps`` (every step, from rank 0's step feed), ``step`` (the
        log-interval lines; skipped when marked ``in_steps``, the feed having carried that step), ``anomaly``."""
        kind, lab = event.get("event"), self._labels
        if kind == "steps" or (kind == "step" and not event.get("in_steps")):
            for gauge, key in (
                (self.loss, "loss"),
                (self.tokens_per_second, "tokens_per_s"),
                (self.grad_norm, "grad_norm"),
                (self.comm_share, "comm_share"),
                (self.loss_scale, "loss_scale"),
                (self.step, "step"),
                (self.moe_imbalance, "moe_imbalance"),
            ):
                value = event.get(key)
                if isinstance(value, (int, float)):
                    gauge.labels(**lab).set(float(value))
            self._observe_routing(event)
            times = event.get("step_times") if kind == "steps" else [event.get("step_time_s")]
            histogram = self.step_seconds.labels(**lab)
            for seconds in times if isinstance(times, list) else []:
                if isinstance(seconds, (int, float)):
                    histogram.observe(float(seconds))
        elif kind == "anomaly":
            self.anomalies.labels(**lab, kind=str(event.get("kind", "unknown"))[:32]).inc()

    def _observe_routing(self, event: dict[str, Any]) -> None:
        """The per-layer and per-expert MoE gauges from an event's ``moe_imbalance.l<L>`` and
        ``moe_tokens.l<L>.e<i>`` keys."""
        for key, value in event.items():
            if not key.startswith("moe_") or not isinstance(value, (int, float)):
                continue
            found = _ROUTING_KEY.fullmatch(key)
            if found is None:
                continue
            kind, layer, expert = found.groups()
            if kind == "imbalance" and expert is None:
                self.moe_layer_imbalance.labels(**self._labels, layer=layer).set(float(value))
            elif kind == "tokens" and expert is not None:
                self.moe_tokens.labels(**self._labels, layer=layer, expert=expert).set(float(value))

    def restart(self) -> None:
        """Count one restart of the workers."""
        self.restarts.labels(**self._labels).inc()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # scrapes every few seconds: not for the orchestrator's console
        return


class _Server(WSGIServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        log.warning("metrics endpoint: dropped a request from %s", client_address[0])


class MetricsExporter:
    """Serves ``metrics`` at ``http://host:port/metrics``; ``authorize()`` runs before each scrape (raise
    ``PermissionDenied`` to refuse it with a 403).

    ``port``: 0 for any free port; else that port, or when it is taken the first free one of the next
    ``port_span - 1`` (several jobs on one host: a Prometheus scrapes the whole range). :meth:`linger` keeps the
    endpoint up after the job's last step until a scrape has read the final values."""

    def __init__(
        self,
        metrics: JobMetrics,
        host: str = "127.0.0.1",
        port: int = 0,
        authorize: Callable[[], None] | None = None,
        port_span: int = 1,
    ):
        self.metrics = metrics
        self.authorize = authorize or (lambda: None)
        self.denied = 0
        #: scrapes answered with the metrics (the denied ones not counted)
        self.scrapes = 0
        self._scraped_at: list[float] = []  # the last two answered scrapes (monotonic)
        counting = threading.Lock()  # scrapes are served on threads of their own
        prometheus_app = make_wsgi_app(metrics.registry)

        def app(environ, start_response):
            if environ.get("PATH_INFO") != "/metrics":
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"not found: try /metrics\n"]
            try:
                self.authorize()
            except PermissionDenied as exc:
                self.denied += 1
                start_response("403 Forbidden", [("Content-Type", "text/plain")])
                return [f"denied: {exc}\n".encode()]
            with counting:  # before the values are read: this scrape sees every update made before now
                self.scrapes += 1
                self._scraped_at = [*self._scraped_at[-1:], time.monotonic()]
            return prometheus_app(environ, start_response)

        self._server = _bind(host, port, port_span, app)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._server.server_address[1])

    @property
    def address(self) -> str:
        """``http://host:port/metrics``."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/metrics"

    def start(self) -> str:
        """Serve in a background thread; returns :attr:`address`."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="kc-metrics", daemon=True)
        self._thread.start()
        return self.address

    def scraper_at_work(self) -> bool:
        """Whether something scrapes the endpoint periodically: two scrapes answered, the last within twice their
        interval (at least a second) of now."""
        if len(self._scraped_at) < 2:
            return False
        before, last = self._scraped_at
        return time.monotonic() - last <= max(2 * (last - before), 1.0)

    def linger(self, grace_s: float, poll_s: float = 0.05) -> float:
        """Call after the job's last update: serve on until one more scrape has been answered (it reads the final
        values), at most ``grace_s`` seconds, when a scraper is at work (:meth:`scraper_at_work`); at once otherwise:
        nothing scraped it, one read by hand, or a scraper gone. Returns the seconds waited."""
        if grace_s <= 0 or not self.scraper_at_work():
            return 0.0
        seen, t0 = self.scrapes, time.monotonic()
        while self.scrapes == seen and time.monotonic() - t0 < grace_s:
            time.sleep(poll_s)
        return time.monotonic() - t0

    def stop(self) -> None:
        """Stop serving (also when never started)."""
        if self._thread is not None:
            self._server.shutdown()  # waits for serve_forever, which only a started exporter runs
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _bind(host: str, port: int, span: int, app: Callable) -> _Server:
    """The server on ``port``, or on the first free one of the ``span`` ports from it (``port`` 0: any)."""
    ports = [port] if port == 0 else list(range(port, min(port + max(1, span), 65536)))
    for candidate in ports:
        try:
            server = make_server(host, candidate, app, server_class=_Server, handler_class=_QuietHandler)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            continue
        if candidate != port:
            log.warning("metrics endpoint: port %d is in use, serving on %d", port, candidate)
        return server
    which = f"port {port} is" if len(ports) == 1 else f"ports {ports[0]}-{ports[-1]} are all"
    raise OSError(errno.EADDRINUSE, f"{which} in use on {host}")


def push_final(metrics: JobMetrics, gateway: str, task: str, run: str, timeout_s: float = 10.0) -> None:
    """Push ``metrics`` to the Pushgateway at ``gateway`` (grouping key ``job="kuangchao"``, ``task``, ``run``:
    each run keeps its own group). Raises ``OSError`` when the gateway does not take them."""
    from prometheus_client import push_to_gateway

    push_to_gateway(
        gateway, job="kuangchao", registry=metrics.registry, grouping_key={"task": task, "run": run}, timeout=timeout_s
    )


def register_exporter(run_dir: str, exporter: MetricsExporter | None) -> None:
    """Remember (or, with None, forget) the exporter of the run in ``run_dir`` for the tasks of this process."""
    if exporter is None:
        _EXPORTERS.pop(str(run_dir), None)
    else:
        _EXPORTERS[str(run_dir)] = exporter


def exporter_for(run_dir: str) -> MetricsExporter | None:
    """The exporter registered for ``run_dir`` in this process, if any."""
    return _EXPORTERS.get(str(run_dir))
