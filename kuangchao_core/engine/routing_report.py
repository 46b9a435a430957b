"""What rank 0 reports of a MoE model's routing (issue 40 item 5), from each step's global tokens per expert
(``StepResult.expert_load``, summed over every rank by ``engine.step_values``).

A layer's **tokens per expert** are the assignments its router chose for each expert over the step's whole global
batch (every micro-batch, every data-parallel rank, every position of each sequence, padding included), before any
capacity drop: each token counts once per expert of its top-k, so a layer's counts sum to tokens × top_k. Its
**load imbalance** is the busiest expert's count over the mean count, max_i c_i / mean_i c_i: 1 when balanced, E
when every assignment goes to one of the E experts (top-1). Per step, to MLflow and the step feed (Prometheus):

- ``moe_imbalance``: the worst MoE layer's imbalance (the aggregate);
- ``moe_imbalance.l<L>``: each MoE layer's, by decoder-layer index L;
- ``moe_tokens.l<L>.e<i>``: each layer's count for expert i, while layers × experts is at most
  :data:`MAX_EXPERT_METRICS` (above it these are left out, said once: the history below, the plot and ``kc debug
  routing`` still have every count).

:class:`RoutingReport` also keeps a bounded history of the counts (:class:`LoadHistory`), from which the run's
``moe/expert_load_steps_<first>-<last>.png`` is drawn at the end of each attempt (``obs.expert_load_plot``; a
resumed attempt adds the plot of its own steps), and writes the last logged step's counts to
``<run dir>/debug/routing/routing.json`` at each log line (atomically), which ``kc debug routing RUN_DIR`` shows.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("kuangchao.engine.routing")

#: the most per-expert count metrics a step logs (layers × experts); MLflow takes 1000 metrics per batch
MAX_EXPERT_METRICS = 512
#: steps the history keeps for the plot (every step while it fits, then every 2nd, 4th, …)
HISTORY_POINTS = 1000
ROUTING_FILE = "routing.json"


def imbalance(counts: list[int] | list[float]) -> float | None:
    """``max(counts) / mean(counts)`` (None when nothing was routed)."""
    total = float(sum(counts))
    return max(counts) * len(counts) / total if total > 0 else None


def routing_metrics(expert_load: dict[int, list[int]], per_expert: bool = True) -> dict[str, float]:
    """The step metrics of ``expert_load`` (decoder layer -> tokens per expert; module docstring); ``per_expert``:
    include each expert's count."""
    out: dict[str, float] = {}
    worst = None
    for layer, counts in expert_load.items():
        ratio = imbalance(counts)
        if ratio is None:
            continue
        out[f"moe_imbalance.l{layer}"] = ratio
        worst = ratio if worst is None else max(worst, ratio)
        if per_expert:
            out.update({f"moe_tokens.l{layer}.e{i}": float(c) for i, c in enumerate(counts)})
    if worst is not None:
        out["moe_imbalance"] = worst
    return out


class LoadHistory:
    """The counts of some of the steps, at most ``points`` of them spread over the run: every ``stride``-th step
    is kept, and when ``points`` are held every other one is dropped and the stride doubles."""

    def __init__(self, points: int = HISTORY_POINTS):
        self.points, self.stride, self._seen = points, 1, 0
        self.steps: list[int] = []
        self.loads: list[dict[int, list[int]]] = []

    def add(self, step: int, expert_load: dict[int, list[int]]) -> None:
        """Note one step's counts (kept when the stride says so)."""
        self._seen += 1
        if (self._seen - 1) % self.stride:
            return
        self.steps.append(step)
        self.loads.append(expert_load)
        if len(self.steps) > self.points:
            self.steps, self.loads, self.stride = self.steps[::2], self.loads[::2], self.stride * 2


def routing_path(run_dir: str | os.PathLike) -> Path:
    """Where ``kc debug routing`` reads a run's last logged routing."""
    return Path(run_dir) / "debug" / "routing" / ROUTING_FILE


def write_routing(run_dir: str | os.PathLike, step: int, expert_load: dict[int, list[int]]) -> Path:
    """Write ``{"step", "layers": {L: {"tokens": [...], "imbalance"}}}`` to :func:`routing_path` atomically."""
    path = routing_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    layers = {str(k): {"tokens": list(v), "imbalance": imbalance(v)} for k, v in expert_load.items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"step": step, "layers": layers}), encoding="utf-8")
    os.replace(tmp, path)
    return path


class RoutingReport:
    """Rank 0's routing reports of one run (module docstring): :meth:`metrics` per step, :meth:`note` per step
    (history; the debug file when ``log_line``), :meth:`close` the plot into ``sink``'s run. ``run_dir``: where the
    debug file goes (None: nowhere)."""

    def __init__(self, run_dir: str | os.PathLike | None):
        self.run_dir = run_dir
        self.history = LoadHistory()
        self._told = False

    def metrics(self, expert_load: dict[int, list[int]]) -> dict[str, float]:
        """The step's routing metrics (per-expert counts left out above :data:`MAX_EXPERT_METRICS`)."""
        cells = sum(len(c) for c in expert_load.values())
        if cells > MAX_EXPERT_METRICS and not self._told:
            self._told = True
            log.info(
                "MoE routing: %d layers x experts counts per step are more than %d metrics: only the imbalance is "
                "logged per step (the plot and kc debug routing have every count)",
                cells,
                MAX_EXPERT_METRICS,
            )
        return routing_metrics(expert_load, per_expert=cells <= MAX_EXPERT_METRICS)

    def note(self, step: int, expert_load: dict[int, list[int]], log_line: bool) -> None:
        """Keep the step's counts for the plot; on a log line, write them for ``kc debug routing``."""
        self.history.add(step, expert_load)
        if log_line and self.run_dir:
            try:
                write_routing(self.run_dir, step, expert_load)
            except OSError as exc:  # a debug aid: never the run's end
                log.warning("MoE routing not written to %s: %s", self.run_dir, exc)

    def close(self, sink: Any) -> None:
        """Attach the plot of the expert load over the steps kept to ``sink``'s run as
        ``moe/expert_load_steps_<first>-<last>.png`` (nothing without a sink or a step; a failure is a warning)."""
        steps = self.history.steps
        if sink is None or not steps:
            return
        try:
            from kuangchao_core.obs.expert_load_plot import expert_load_image

            name = f"moe/expert_load_steps_{steps[0]}-{steps[-1]}.png"
            sink.log_image(expert_load_image(steps, self.history.loads), name)
        except Exception as exc:  # the plot is a view of metrics already logged: never the run's end
            log.warning("the MoE expert-load plot was not made: %s", exc)
