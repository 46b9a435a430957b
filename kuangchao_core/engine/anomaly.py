"""Anomaly flags of a training run (SPEC RT.6): communication over its share of step time for several steps, an
exploding gradient norm, a NaN/infinite or spiking loss, memory growing between steps.

:class:`AnomalyDetector` looks at each step's metrics and returns the anomalies it raises, each with the action
configured for its kind (``train.anomaly.actions``: ``warn``, ``checkpoint`` or ``stop``; by default ``stop`` for a
non-finite loss and ``warn`` for the rest, ``config.schema.ANOMALY_DEFAULT_ACTIONS``). Loss and gradient norm
are the same on every rank (reduced over the job), so every rank flags them at the same step and can act on them
together; communication share and memory are measured per rank and only warn. A kind that stays anomalous is
flagged when it starts and again after ``window`` steps, not at every step.

Quiet on a healthy run (issue 27 §7): loss spikes and gradient norms are judged only after the learning-rate
warm-up and a full ``window`` of steps after it (their median is the reference; during warm-up and the first steps
both move fast by design); a gradient norm must stay over its limit ``grad_norm_steps`` steps in a row (one step's
outlier is common in heavy-tailed gradients near convergence, and clipped), and a loss spike must also rise ``loss_spike_min_delta`` nats over that median (a
converged loss near zero doubling is noise, not divergence). Communication share is judged on the median of the
last ``comm_share_steps`` steps (not single steps: two ranks on shared cores wait on each other at random) against
the larger of ``comm_share`` and a limit from this run's own baseline — the median share of the first
``comm_share_steps`` steps after warm-up — at which communication takes ``comm_baseline_factor`` (4) times
its baseline time relative to compute: a machine where the exchange is always a large share is not anomalous, a link
that becomes several times slower is.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kuangchao_core.config.schema import ANOMALY_DEFAULT_ACTIONS
from kuangchao_core.errors import KuangchaoError
from kuangchao_core.obs.jsonlog import emit_event

log = logging.getLogger("kuangchao.engine")

KINDS = ("comm_share", "grad_norm", "loss_nan", "loss_spike", "memory_growth")
#: the most a baseline raises the communication-share limit to
COMM_SHARE_CAP = 0.9


def comm_share_limit(configured: float, baseline: float | None, factor: float = 4.0) -> float:
    """The communication share over which a run's recent median is anomalous: ``configured``, raised to where
    communication takes ``factor`` times the ``baseline`` share's time relative to compute — a baseline share b
    gives k·b / (1 + (k-1)·b), at most :data:`COMM_SHARE_CAP` (no baseline, or ``factor`` 0: ``configured``)."""
    if baseline is None or factor <= 0:
        return configured
    k, b = factor, min(max(baseline, 0.0), 1.0)
    return max(configured, min(COMM_SHARE_CAP, k * b / (1 + (k - 1) * b)))


class AnomalyStop(KuangchaoError):
    """The run was stopped by an anomaly whose action is ``stop``, or because its parameters or optimizer state are
    no longer finite (nothing more is saved then; the last good checkpoint stays the newest). Never retried."""


@dataclass(frozen=True)
class Anomaly:
    """One flag: ``kind`` at ``step``, the ``value`` seen and the ``threshold`` it crossed, what to do."""

    kind: str
    step: int
    value: float
    threshold: float
    action: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class AnomalyDetector:
    """Feed :meth:`observe` every step's metrics; it returns the anomalies of that step (usually none)."""

    def __init__(self, settings: Any, warmup_steps: int = 0):
        self.s = settings
        chosen = getattr(settings, "actions", None) or {}
        self.actions = {k: str(chosen.get(k, ANOMALY_DEFAULT_ACTIONS.get(k, "warn"))) for k in KINDS}
        self.warmup_steps = int(warmup_steps)
        self._losses: deque[float] = deque(maxlen=int(settings.window))
        self._norms: deque[float] = deque(maxlen=int(settings.window))
        self._shares: deque[float] = deque(maxlen=int(settings.comm_share_steps))
        self._norm_run = 0  # steps in a row whose gradient norm is over its limit
        self.comm_baseline: float | None = None  # the median share of the first comm_share_steps after warm-up
        self._last_mem: float | None = None
        self._last_seen: dict[str, int] = {}  # the last step each kind was anomalous
        self._reported: dict[str, int] = {}  # the last step each kind was flagged
        self.counts = dict.fromkeys(KINDS, 0)

    def observe(self, step: int, metrics: dict[str, float]) -> list[Anomaly]:
        """The anomalies of ``step`` given its ``loss``, ``grad_norm``, ``comm_share`` and ``mem_bytes``."""
        s, found = self.s, []
        window = int(s.window)
        warm = step > self.warmup_steps
        loss, norm = float(metrics.get("loss", 0.0)), float(metrics.get("grad_norm", 0.0))
        if not math.isfinite(loss):
            found.append(self._flag("loss_nan", step, loss, 0.0, f"loss is {loss} at step {step}", always=True))
        elif warm and len(self._losses) >= window:
            median = statistics.median(self._losses)
            limit = max(s.loss_spike_factor * median, median + s.loss_spike_min_delta)
            if loss > limit:
                text = f"loss {loss:.4g} > {limit:.4g} (spike over the median {median:.4g} of {window} steps)"
                found.append(self._flag("loss_spike", step, loss, limit, text))
        if math.isfinite(norm) and warm and len(self._norms) >= window:
            limit = s.grad_norm_factor * statistics.median(self._norms)
            self._norm_run = self._norm_run + 1 if norm > limit else 0
            if self._norm_run >= int(getattr(s, "grad_norm_steps", 1)):
                text = (
                    f"gradient norm {norm:.4g} > {limit:.4g} ({s.grad_norm_factor:g}× the median of {window} steps) "
                    f"for {self._norm_run} steps"
                )
                found.append(self._flag("grad_norm", step, norm, limit, text))
        found.append(self._comm(step, float(metrics.get("comm_share", 0.0)), warm))
        mem = float(metrics.get("mem_bytes", 0.0))
        if self._last_mem is not None and mem - self._last_mem > s.memory_growth_mb * 2**20:
            grown = (mem - self._last_mem) / 2**20
            found.append(self._flag("memory_growth", step, grown, s.memory_growth_mb, f"memory grew {grown:.0f} MiB"))
        self._last_mem = mem
        if warm and math.isfinite(loss):
            self._losses.append(loss)
        if warm and math.isfinite(norm):
            self._norms.append(norm)
        return [a for a in found if a is not None]

    def after_step(self, step: int, metrics: dict[str, float], rank: int, save: Callable[[], Any]) -> str | None:
        """The loop's call after every step: flag its anomalies (logged; rank 0 emits an ``anomaly`` event for the
        orchestrator and adds the MLflow counts ``anomalies_<kind>`` to ``metrics``) and run their ``checkpoint``
        actions (``save``: the trainer's checkpoint of this step, collective); returns the kind whose action is
        ``stop``, if any — the same on every rank, since only rank-independent kinds can stop."""
        stop = None
        for a in self.observe(step, metrics):
            # the ``anomaly`` field keeps this record out of the console, which tallies the events per kind
            log.warning(
                "anomaly %s at step %d: %s (action %s)",
                a.kind,
                step,
                a.message,
                a.action,
                extra={"fields": {"anomaly": a.kind}},
            )
            if rank == 0:
                emit_event("anomaly", **a.to_dict())
                metrics[f"anomalies_{a.kind}"] = float(self.counts[a.kind])
            if a.action == "checkpoint":
                save()
            elif a.action == "stop":
                stop = a.kind
        return stop

    def _comm(self, step: int, share: float, warm: bool) -> Anomaly | None:
        """Communication share: the median of the last ``comm_share_steps`` steps against :func:`comm_share_limit`."""
        if not warm or not math.isfinite(share):
            return None
        self._shares.append(share)
        if len(self._shares) < self._shares.maxlen:
            return None
        recent = statistics.median(self._shares)
        factor = float(getattr(self.s, "comm_baseline_factor", 0.0))
        if factor > 0 and self.comm_baseline is None:
            self.comm_baseline = recent  # this machine's own share, measured once
            return None
        limit = comm_share_limit(self.s.comm_share, self.comm_baseline, factor)
        if recent <= limit:
            return None
        base = f", this run's baseline {100 * self.comm_baseline:.0f}%" if self.comm_baseline is not None else ""
        text = (
            f"communication {100 * recent:.0f}% of step time (median of {len(self._shares)} steps; "
            f"limit {100 * limit:.0f}%{base})"
        )
        return self._flag("comm_share", step, recent, limit, text)

    def _flag(self, kind: str, step: int, value: float, threshold: float, text: str, always: bool = False):
        ongoing = self._last_seen.get(kind) == step - 1
        self._last_seen[kind] = step
        if not always and ongoing and step - self._reported.get(kind, -(10**9)) < self.s.window:
            return None  # the same episode goes on: flagged again only every ``window`` steps
        self._reported[kind] = step
        self.counts[kind] += 1
        return Anomaly(kind, step, value, threshold, self.actions[kind], text)
