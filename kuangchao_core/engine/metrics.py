"""The per-step metrics: where they go (:class:`StepReport`) and the memory in use, named for what it is (the
tensors a rank holds are the grad sync's own account: :meth:`~kuangchao_core.parallel.grad_sync.GradSync.tensor_bytes`).

On CUDA the figure is a peak, and a peak is only meaningful over a phase: the trainer calls :func:`start_phase` at
the start of every step, so a step's ``mem_bytes`` is that step's peak (activations, gradients, the optimizer's
update), not the largest since the process started (model build, the first step's compilation, an evaluation or
a checkpoint save between steps). On the CPU the figure is the resident set size, a current value: there is no
peak to reset and nothing changes. ``cuda`` (default ``torch.cuda``) is the allocator's statistics interface.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from kuangchao_core.engine.routing_report import RoutingReport
from kuangchao_core.obs.jsonlog import emit_event, log_event
from kuangchao_core.obs.step_feed import StepFeed

log = logging.getLogger("kuangchao.engine")


def memory_kind(device: torch.device) -> str:
    """What :func:`memory_bytes` measures on ``device``: ``cuda_peak`` (peak allocated tensor bytes) or ``rss``
    (the whole process: tensors plus the Python runtime and libraries)."""
    return "cuda_peak" if device.type == "cuda" and torch.cuda.is_available() else "rss"


def start_phase(device: torch.device, cuda: Any = None) -> None:
    """Start a phase whose peak :func:`memory_bytes` then reports: on CUDA the allocator's peak is reset to what is
    allocated now (``torch.cuda.reset_peak_memory_stats``); on the CPU nothing happens."""
    cuda = torch.cuda if cuda is None else cuda
    if device.type == "cuda" and cuda.is_available():
        cuda.reset_peak_memory_stats(device)


def memory_bytes(device: torch.device, cuda: Any = None) -> int:
    """Peak allocated bytes on a CUDA device since the last :func:`start_phase` (or the process's start), or the
    resident set size of this process on CPU."""
    cuda = torch.cuda if cuda is None else cuda
    if device.type == "cuda" and cuda.is_available():
        return int(cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            resident_pages = int(fh.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class StepReport:
    """Where rank 0 reports each step of a run (other ranks report nothing): every step's metrics to
    ``metric_sink`` (MLflow) and to the orchestrator's step feed (Prometheus), and a ``step`` line every
    ``log_interval`` steps and at the last, ``stop_at``, with the ETA to the job's ``total``. Built when the loop
    starts, it times the loop from then (:meth:`elapsed`). A MoE model's routing (``engine.routing_report``) joins
    the step metrics; its debug file goes to ``run_dir`` (default ``KC_RUN_DIR``) and its plot to the sink's run at
    :meth:`close`."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        metric_sink: Any,
        total: int,
        start_step: int,
        stop_at: int,
        run_dir: str | None = None,
    ):
        self.rank, self.device, self.sink = rank, device, metric_sink
        self.total, self.start_step, self.stop_at = total, start_step, stop_at
        self.t_start = time.perf_counter()
        self.feed: StepFeed | None = None
        self.routing = RoutingReport(run_dir or os.environ.get("KC_RUN_DIR"))

    def start(self, **fields: Any) -> None:
        """Rank 0: the ``start`` event (with ``fields``: world size, lineage) and the step feed's thread."""
        if self.rank == 0:
            emit_event("start", total_steps=self.total, start_step=self.start_step, **fields)
            self.feed = StepFeed()

    def elapsed(self) -> float:
        """Seconds since the loop started."""
        return time.perf_counter() - self.t_start

    def after_step(self, result: Any, metrics: dict[str, float], log_interval: int) -> None:
        """Report the step ``result`` (the trainer's ``StepResult``) with its ``metrics`` (those of ``result`` and
        what the loop added: data wait, anomaly counts, evaluations)."""
        if self.rank != 0:
            return
        step = result.step
        log_line = step % log_interval == 0 or step == self.stop_at
        load = getattr(result, "expert_load", None)
        if load is not None:  # MoE: tokens per expert and imbalance, every step (not on the log line: too many)
            metrics = metrics | self.routing.metrics(load)
            self.routing.note(step, load, log_line)
        if self.sink is not None:
            self.sink.log_step(step, metrics)
        if self.feed is not None:
            self.feed.record(step, result.step_time_s, metrics)
        if log_line:
            done = step - self.start_step
            eta = self.elapsed() / done * (self.total - step) if done else None
            fields = result.metrics() | {
                "step": step,
                "total_steps": self.total,
                "eta_s": eta,
                "step_time_s": result.step_time_s,
                "eval_time_s": metrics.get("eval_time_s"),  # None: no evaluation at this step
                "mem_kind": memory_kind(self.device),
                "in_steps": True,  # the step feed carries this step's metrics too
            }
            if "moe_imbalance" in metrics:
                fields["moe_imbalance"] = metrics["moe_imbalance"]
            log_event(log, "step", **fields)
            emit_event("step", **fields)

    def close(self) -> None:
        """Send the feed's last steps and stop its thread; attach the MoE expert-load plot (rank 0)."""
        if self.feed is not None:
            self.feed.close()
        if self.rank == 0:
            self.routing.close(self.sink)
