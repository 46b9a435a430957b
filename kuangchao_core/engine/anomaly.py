"""Anomaly flags of a training run (SPEC RT.6): communication over its share of step time for several steps, an
exploding gradient norm, a NaN/infinite or spiking loss, memory growing between steps.

:class:`AnomalyDetector` looks at each step's metrics and returns the anomalies it raises, each with the action
configured for its kind (``train.anomaly.actions``: ``warn``, ``checkpoint`` or ``stop``; by default ``stop`` for a
non-finite loss and ``warn`` for the rest, ``config.schema.ANOMALY_DEFAULT_ACTIONS``). Loss and gradient norm
are the same on every rank (reduced over the job), so every rank flags them at the same step and can act on them
together; communication share and memory are measured per rank and only warn. A kind that stays anomalous is
flagged when it starts and again after ``window`` steps, not at every step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from kuangchao_core.config.schema import ANOMALY_DEFAULT_ACTIONS
from kuangchao_core.errors import KuangchaoError

KINDS = ("comm_share", "grad_norm", "loss_nan", "loss_spike", "memory_growth")


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

    def __init__(self, settings: Any):
        self.s = settings
        chosen = getattr(settings, "actions", None) or {}
        self.actions = {k: str(chosen.get(k, ANOMALY_DEFAULT_ACTIONS.get(k, "warn"))) for k in KINDS}
        self._losses: deque[float] = deque(maxlen=int(settings.window))
        self._norms: deque[float] = deque(maxlen=int(settings.window))
        self._comm_run = 0
        self._last_mem: float | None = None
        self._last_seen: dict[str, int] = {}  # the last step each kind was anomalous
        self._reported: dict[str, int] = {}  # the last step each kind was flagged
        self.counts = dict.fromkeys(KINDS, 0)

    def observe(self, step: int, metrics: dict[str, float]) -> list[Anomaly]:
        """The anomalies of ``step`` given its ``loss``, ``grad_norm``, ``comm_share`` and ``mem_bytes``."""
        s, found = self.s, []
        loss, norm = float(metrics.get("loss", 0.0)), float(metrics.get("grad_norm", 0.0))
        if not math.isfinite(loss):
            found.append(self._flag("loss_nan", step, loss, 0.0, f"loss is {loss} at step {step}", always=True))
        elif len(self._losses) >= 3 and loss > s.loss_spike_factor * statistics.median(self._losses):
            limit = s.loss_spike_factor * statistics.median(self._losses)
            found.append(self._flag("loss_spike", step, loss, limit, f"loss {loss:.4g} > {limit:.4g} (spike)"))
        if math.isfinite(norm) and len(self._norms) >= 3 and norm > s.grad_norm_factor * statistics.median(self._norms):
            limit = s.grad_norm_factor * statistics.median(self._norms)
            found.append(self._flag("grad_norm", step, norm, limit, f"gradient norm {norm:.4g} > {limit:.4g}"))
        share = float(metrics.get("comm_share", 0.0))
        self._comm_run = self._comm_run + 1 if share > s.comm_share else 0
        if self._comm_run >= s.comm_share_steps:
            text = f"communication {100 * share:.0f}% of step time for {self._comm_run} steps (> {100 * s.comm_share:.0f}%)"
            found.append(self._flag("comm_share", step, share, s.comm_share, text))
        mem = float(metrics.get("mem_bytes", 0.0))
        if self._last_mem is not None and mem - self._last_mem > s.memory_growth_mb * 2**20:
            grown = (mem - self._last_mem) / 2**20
            found.append(self._flag("memory_growth", step, grown, s.memory_growth_mb, f"memory grew {grown:.0f} MiB"))
        self._last_mem = mem
        if math.isfinite(loss):
            self._losses.append(loss)
        if math.isfinite(norm):
            self._norms.append(norm)
        return [a for a in found if a is not None]

    def _flag(self, kind: str, step: int, value: float, threshold: float, text: str, always: bool = False):
        ongoing = self._last_seen.get(kind) == step - 1
        self._last_seen[kind] = step
        if not always and ongoing and step - self._reported.get(kind, -(10**9)) < self.s.window:
            return None  # the same episode goes on: flagged again only every ``window`` steps
        self._reported[kind] = step
        self.counts[kind] += 1
        return Anomaly(kind, step, value, threshold, self.actions[kind], text)
