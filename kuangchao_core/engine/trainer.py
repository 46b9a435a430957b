"""The training loop of one worker process: build this rank's part, then step.

One optimizer step = ``gradient_accumulation_steps`` micro-batches on every data-parallel rank. Each micro-batch's
loss is its token losses' sum over the global batch's labelled-token count (times dp,
:mod:`~kuangchao_core.parallel.step_loss`) and the job's :class:`~kuangchao_core.parallel.grad_sync.GradSync`
averages gradients across the DP group, so the step equals one process training on the whole global batch. The
forward and backward of a step is chosen once (:func:`~kuangchao_core.parallel.forward_backward.get_forward_backward`);
checkpoint I/O is :mod:`kuangchao_core.engine.checkpointing`, following ``kc config set`` is
:mod:`kuangchao_core.engine.live_config`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kuangchao_core.comm import primitives as P
from kuangchao_core.comm import watchdog as comm_watchdog
from kuangchao_core.comm.group import host_group
from kuangchao_core.comm.order_check import verify_order
from kuangchao_core.comm.timing import COMM_STATS
from kuangchao_core.config.settings import RunSettings
from kuangchao_core.data import PrefetchLoader, ResumableBatchSampler
from kuangchao_core.data.image_pool import DataWait
from kuangchao_core.engine.anomaly import AnomalyDetector, AnomalyStop
from kuangchao_core.engine.checkpointing import TrainerCheckpoints
from kuangchao_core.engine.eval_step import StepEvaluations
from kuangchao_core.engine.grad_snapshot import SnapshotStep
from kuangchao_core.engine.job_data import job_data
from kuangchao_core.engine.live_config import LiveConfig, LiveSettings
from kuangchao_core.engine.metrics import StepReport, memory_bytes, memory_kind, start_phase
from kuangchao_core.engine.parallel_model import build_parallel_model, target_layout
from kuangchao_core.engine.schedule import lr_at
from kuangchao_core.engine.step_values import start_step_values
from kuangchao_core.engine.vlm_model import with_pretrained_vision, wrap_vision
from kuangchao_core.errors import KuangchaoError
from kuangchao_core.models.attention import job_attention_path
from kuangchao_core.models.llama import config_from_model_section
from kuangchao_core.obs.jsonlog import emit_event, log_event
from kuangchao_core.parallel.context import shard_micro_batches
from kuangchao_core.parallel.forward_backward import BATCH_KEYS
from kuangchao_core.parallel.grad_sync import make_grad_sync
from kuangchao_core.parallel.mixed_precision import mixed_precision_for
from kuangchao_core.parallel.step_loss import known_global_count, labelled_tokens, step_loss_weight

log = logging.getLogger("kuangchao.engine")


@dataclass
class StepResult:
    """What one optimizer step produced (all values are global across the data-parallel group)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    mem_bytes: int
    comm_share: float
    step_time_s: float
    precision: dict[str, float] = field(default_factory=dict)  # skipped_steps; loss_scale under fp16
    expert_load: dict[int, list[int]] | None = None  # MoE: decoder layer -> tokens per expert (engine.step_values)

    def metrics(self) -> dict[str, float]:
        """The MLflow metric dict (contract names)."""
        return {
            "loss": self.loss,
            "lr": self.lr,
            "tokens_per_s": self.tokens_per_s,
            "grad_norm": self.grad_norm,
            "mem_bytes": float(self.mem_bytes),
            "comm_share": self.comm_share,
            **self.precision,
        }


@dataclass
class TrainState:
    """Progress that a checkpoint must carry besides tensors."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    trained_tokens: int = 0  # global tokens of the steps this run trained (not of resumed ones)
    train_seconds: float = 0.0  # wall time of those steps
    loop_seconds: float = 0.0  # wall time of the whole loop: steps, evaluations, checkpoints, data waits
    bad_in_a_row: int = 0  # consecutive skipped steps that count towards train.max_bad_steps

    @property
    def tokens_per_s_mean(self) -> float | None:
        """Mean global throughput of this run's steps (total tokens / total step time); None before any step."""
        return self.trained_tokens / self.train_seconds if self.train_seconds > 0 else None

    @property
    def tokens_per_s_loop(self) -> float | None:
        """Global throughput of the whole loop (evaluations, checkpoints and data waits included); None before."""
        return self.trained_tokens / self.loop_seconds if self.loop_seconds > 0 else None


class BadStepsStop(KuangchaoError):
    """``train.max_bad_steps`` steps in a row were not finite and skipped; the run stopped (never retried)."""


def step_is_finite(loss: float, grad_norm: float) -> bool:
    """Whether a step may be applied: its loss and its global gradient norm are both finite."""
    return math.isfinite(loss) and math.isfinite(grad_norm)


class Trainer:
    """Builds this rank's model part, data and optimizer for a dp×cp×pp×tp mesh and runs the step loop.

    ``run``: the job's :class:`~kuangchao_core.config.settings.RunSettings` (built once from the validated config,
    :func:`~kuangchao_core.config.settings.run_settings`); each part gets its own piece of them.
    ``mesh``: a :class:`~kuangchao_core.parallel.mesh.ParallelMesh` (groups built once, passed explicitly);
    ``world_group``: every rank, for device tensors. Host-side agreements (resume plan, barriers, followed config)
    travel on the host group, which the trainer builds (collectively) beside them.
    """

    def __init__(self, run: RunSettings, rank: int, world_size: int, device: torch.device, world_group: Any, mesh: Any):
        self.run_settings = run = with_pretrained_vision(run)  # a LLaVA checkpoint's tower sizes (issue 31)
        self.train_settings = train = run.train
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.world_group = world_group
        self.host_group = host_group()
        self.mesh = mesh
        self.state = TrainState()
        batches = run.batches

        torch.manual_seed(train.seed)
        self.model_config = config_from_model_section(run.model)
        self.parts = build_parallel_model(run.build, self.model_config, mesh, device)
        if run.model.vision is not None:  # the decoder under LLaVA's tower and projector (issue 31)
            self.parts = wrap_vision(self.parts, run.build, run.model.vision, self.model_config, mesh, device)
        self.model = self.parts.model
        self.groups = mesh.reduce_groups(self.parts.placement.replica_axes(), self.parts.placement.apart())
        self.sync = make_grad_sync(run.grad_sync, self.model, self.groups, self.parts.placement.norm_weight())
        self.precision = mixed_precision_for(run.precision, device)
        self.forward_backward = self.parts.step_function(self.precision if self.precision.enabled else None)
        if rank == 0 and (report := self.sync.memory_report()) is not None:
            log_event(log, "zero memory per rank", **report)
        self.attention_path = job_attention_path(batches.documents, int(run.data.seq_len))
        if rank == 0:
            gqa = self.model_config.num_heads // self.model_config.num_kv_heads
            log_event(log, "attention", path=self.attention_path, gqa_groups=gqa, repeated_kv=False)

        self.dataset, self.evaluator, self.samples = job_data(run, self.parts, mesh, device, self.model_config, rank)
        self.evaluate = StepEvaluations(
            self.evaluator, self.samples, train.eval_interval, run.evaluation.sample_every, rank
        )
        self.sampler = ResumableBatchSampler(
            len(self.dataset),
            micro_batch_size=batches.micro_batch_size,
            grad_accum=batches.gradient_accumulation_steps,
            dp_rank=mesh.dp_rank,
            dp_size=mesh.dp,
            seed=train.seed,
            shuffle=batches.shuffle,
        )
        self.loader: PrefetchLoader | None = None
        self.global_config: Any = None  # job-global settings changed at run time (kc config set), see the worker
        self.lr_scale = 1.0
        self.anomaly = AnomalyDetector(train.anomaly, warmup_steps=train.warmup_steps)
        self.checkpoints = TrainerCheckpoints(
            run.checkpoint,
            rank,
            world_size,
            mesh,
            self.parts,
            self.sync,
            self.host_group,
            self.model_config,
            target_layout(mesh, run.build),
            self.barrier,
        )

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        """A barrier over every rank, on the host group, through the communication layer (so the guard sees it)."""
        P.all_reduce(torch.zeros(1), group=self.host_group, op="sum")

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path | None:
        """Write the checkpoint of the current step into this run's lineage (collective over all ranks); with
        ``checkpoint.async`` it is written in the background and None is returned. Rank 0 reports the
        ``checkpoint`` event when the step is published."""
        assert self.loader is not None
        extra = {
            "optimizer_steps": self.state.step - self.precision.skipped_steps,
            "precision": self.precision.state_dict(),
        }
        return self.checkpoints.save(
            self.state.step, self.state.losses, self.loader.state_dict(), on_commit=self._published, extra=extra
        )

    def _published(self, step_dir: Path) -> None:
        if self.rank == 0:
            emit_event("checkpoint", step=int(step_dir.name.removeprefix("step_")))

    def load_checkpoint(self, step_dir: Path) -> None:
        """Restore params, optimizer, step, sampler position and RNG from ``step_dir`` (any layout)."""
        state = self.checkpoints.load(step_dir)
        self.precision.load_state_dict(state.get("precision"))
        self.state.step = int(state["step"])
        self.state.losses = list(state.get("losses", []))
        self.sampler.load_state_dict(state["sampler"])

    # ------------------------------------------------------------------ the step
    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        """One optimizer step over this rank's micro-batches; returns global metrics."""
        start_phase(self.device)  # mem_bytes: this step's peak on CUDA (metrics.start_phase)
        t0, comm0 = time.perf_counter(), COMM_STATS.total_seconds()
        train = self.train_settings
        schedule = (train.lr, train.steps, train.warmup_steps, train.lr_schedule, train.min_lr_ratio)
        lr = lr_at(self.state.step, *schedule) * self.lr_scale
        for group in self.sync.param_groups:
            group["lr"] = lr
        self.sync.zero_grad()
        known = known_global_count(micro_batches, self.groups.replicas, self.mesh)  # the loader's, if counted
        micro_batches = shard_micro_batches(micro_batches, self.mesh)  # CP: this rank's shard of each sequence
        batches = [
            {k: v.to(self.device, non_blocking=True) for k, v in b.items() if k in BATCH_KEYS} for b in micro_batches
        ]
        tokens = labelled_tokens(micro_batches)  # host tensors: no device sync
        # every labelled token of the global batch weighs the same, as in one process (step_loss; dp×cp counts)
        weight = step_loss_weight(micro_batches, self.groups.replicas, self.device, known)
        local_loss = self.forward_backward(self.sync, batches, weight)
        pending = start_step_values(local_loss, self.parts.moe, self.device, self.mesh.pp_group, self.groups.replicas)
        self.precision.unscale(self.sync.local_grads())  # fp16: gradients back to their true scale
        # the global norm (equal on every rank) is not finite when any rank's gradients are not
        norm_t = self.sync.clip_grad_norm(self.train_settings.max_grad_norm)
        summed = pending.finish(norm_t)  # loss (MoE loads) over PP and dp×cp, read with the norm before the optimizer
        comm_watchdog.settle()  # the step's NCCL ops are done: their device time into COMM_STATS
        bad = not step_is_finite(summed.loss_sum, summed.grad_norm)  # the same values and decision on every rank
        if not bad:
            self.sync.step()
        self.parts.after_step(not bad, summed.loads)  # MoE: the routing bias update (issue 40)
        loss = summed.loss_sum / self.groups.replicas.size
        self._count_bad_step(bad, loss, summed.grad_norm)
        self.state.step += 1
        self.state.losses.append(loss)
        dt = time.perf_counter() - t0
        comm = COMM_STATS.total_seconds() - comm0
        return StepResult(
            step=self.state.step,
            loss=loss,
            lr=lr,
            grad_norm=summed.grad_norm,
            tokens_per_s=tokens * self.groups.replicas.size / dt if dt > 0 else 0.0,
            mem_bytes=memory_bytes(self.device),
            comm_share=min(1.0, comm / dt) if dt > 0 else 0.0,
            step_time_s=dt,
            precision=self.precision.metrics(),
            expert_load=summed.expert_load,
        )

    def _count_bad_step(self, bad: bool, loss: float, grad_norm: float) -> None:
        """Count a skipped step (``skipped_steps``, the reason logged); ``train.max_bad_steps`` in a row end the run
        with :class:`BadStepsStop` (fp16 counts them once its loss scale cannot back off any further)."""
        counts = bad and self.precision.at_min_scale
        self.precision.update(bad)
        self.state.bad_in_a_row = self.state.bad_in_a_row + 1 if counts else 0
        if not bad:
            return
        step, limit = self.state.step + 1, self.train_settings.max_bad_steps
        log.warning(
            "step %d skipped on every rank: loss %s, gradient norm %s (not finite; %d skipped in all, %d in a row "
            "of train.max_bad_steps %d)",
            step,
            loss,
            grad_norm,
            self.precision.skipped_steps,
            self.state.bad_in_a_row,
            limit,
        )
        if self.rank == 0:
            emit_event("skipped_step", step=step, loss=loss, grad_norm=grad_norm, in_a_row=self.state.bad_in_a_row)
        if self.state.bad_in_a_row >= limit:
            self.checkpoints.finish()  # a save in flight is the last good state: let it land
            raise BadStepsStop(
                f"stopped at step {step}: {limit} steps in a row had a non-finite loss or gradient norm and were "
                f"skipped (train.max_bad_steps {limit}); the weights are those of step {step - limit}, and the last "
                "checkpoint is intact: look at the data and the learning rate before resuming"
            )

    def _report_memory(self, result: StepResult) -> None:
        """Once, after the first step: rank 0's measured tensor bytes beside ``kc plan``'s estimate of them, and
        the process memory (RSS on CPU), which also counts the runtime and is not what the plan estimates."""
        from kuangchao_core.engine.plan import explain_plan

        measured = self.sync.tensor_bytes()
        try:
            est = explain_plan(self.run_settings.job)["ranks"][self.rank]["memory_bytes"]
            estimate = int(est["params"] + est["grads"] + est["optimizer"])
        except Exception:  # the estimate is informative only; a job never fails on it
            estimate = None
        fields = {
            "tensor_bytes": sum(measured.values()),
            **{f"tensor_bytes_{k}": v for k, v in measured.items()},
            "plan_estimate_bytes": estimate,
            "mem_kind": memory_kind(self.device),
            "mem_bytes": result.mem_bytes,
        }
        log_event(log, "memory", **fields)
        emit_event("memory", **fields)

    # ------------------------------------------------------------------ the loop
    def run(
        self, resume: str = "auto", metric_sink: Any = None, max_steps: int | None = None, lineage: str | None = None
    ) -> TrainState:
        """Train to ``train.steps`` (or ``max_steps`` more steps), checkpointing every ``checkpoint.interval`` into
        this run's lineage (``lineage`` pins it; else it is decided from ``resume``). After each step its observers
        run in order, and each decides whether this step is one of its own."""
        self.sync.prepare()
        lineage, fine_tune = self._resume(resume, lineage)
        live = self._live_config()
        self.stopped_at = None  # the step a stop request ended the run at (the stop file, issue 32 §3)
        # a change made before this attempt (or before a resume) applies from its first step
        self.lr_scale = live.follow(self.state.step, first=True).lr_scale
        # on CUDA the prefetched batches sit in pinned memory, so the step's non-blocking copies overlap compute
        pin, depth = self.device.type == "cuda", self.run_settings.batches.prefetch
        self.loader = PrefetchLoader(self.dataset, self.sampler, depth=depth, pin_memory=pin)
        self.data_wait, self.step_seconds = DataWait(), []
        total, start_step = self.train_settings.steps, self.state.step
        stop_at = total if max_steps is None else min(total, start_step + max_steps)
        report = StepReport(self.rank, self.device, metric_sink, total, start_step, stop_at)  # the loop's clock
        report.start(world_size=self.world_size, lineage=lineage)
        snapshot = SnapshotStep()  # `kc debug gradient`'s step, if any
        try:
            if fine_tune:  # from pretrained weights: its starting point, to read every later evaluation against
                self.evaluate.baseline(metric_sink)
            while self.state.step < stop_at:
                result = self.train_step(self.data_wait.measure(self.loader.next_step))
                self._account(result, first=result.step == start_step + 1)
                self.lr_scale = live.follow(result.step, first=False).lr_scale  # kc config set, the stop file
                metrics = result.metrics() | {"data_wait_s": self.data_wait.last}
                snapshot.after_step(result.step, self.rank, self.sync, self.model, self.mesh.coords)
                stop = self.anomaly.after_step(result.step, metrics, self.rank, self.save_checkpoint)
                self.evaluate(result.step, metrics, metric_sink)  # what is due at this step, timed (eval_time_s)
                report.after_step(result, metrics, live.settings.log_interval)  # MLflow, step feed, log line
                if stop is not None:
                    self._stop_on_anomaly(result.step, stop)
                if self._stop_requested(live, result.step, stop_at):
                    break
                self.checkpoints.after_step(result.step, live.settings.checkpoint_interval, self.save_checkpoint)
            self.checkpoints.at_end(self.state.step, total, self.save_checkpoint)  # published before run() returns
            self.state.loop_seconds += report.elapsed()  # the whole loop, for tokens_per_s_loop
            if self.rank == 0 and self.step_seconds:  # the step's wait for its data (issue 31: < 5 % of the step)
                log_event(log, "data wait", **self.data_wait.summary(self.step_seconds))
        finally:
            report.close()
            self.loader.close()
        return self.state

    def _resume(self, resume: str, lineage: str | None) -> tuple[str, bool]:
        """Agree on this run's lineage and load what it starts from (collective); returns the lineage and whether
        the run fine-tunes pretrained weights from their start (no checkpoint to resume)."""
        plan = self.checkpoints.plan_run(resume, lineage)
        if self.rank == 0:
            log_event(log, "checkpoints", lineage=plan.lineage, resume_from=plan.step_dir, reason=plan.reason)
        step_dir = Path(plan.step_dir) if plan.step_dir else None
        # a checkpoint holds only what trains (LoRA adapters; not a frozen or unread tower): the rest comes again
        pretrained = self.train_settings.pretrained  # from model.checkpoint (or the seed), the checkpoint over it
        if pretrained and (step_dir is None or self.parts.lora is not None or getattr(self.parts, "vision", None)):
            self.checkpoints.load_pretrained(pretrained)
        if step_dir is not None:
            self.load_checkpoint(step_dir)
        self.checkpoints.saved_at = self.state.step if step_dir is not None else -1
        return plan.lineage, bool(pretrained) and step_dir is None

    def _live_config(self) -> LiveConfig:
        """What this run follows while it trains: the job-global settings (``kc config set``) and the stop file."""
        interval = self.run_settings.checkpoint.interval
        settings = LiveSettings(self.lr_scale, self.train_settings.log_interval, interval)
        return LiveConfig(self.global_config, self.rank, self.world_size, self.host_group, settings)

    def _account(self, result: StepResult, first: bool) -> None:
        """After every step: its time and tokens into the run's totals, CI's check that every rank ran the same
        collectives (a no-op elsewhere), and after the ``first`` step of the run, rank 0's memory report."""
        self.step_seconds.append(result.step_time_s)
        verify_order(self.host_group)
        self.state.trained_tokens += round(result.tokens_per_s * result.step_time_s)
        self.state.train_seconds += result.step_time_s
        if first and self.rank == 0:
            self._report_memory(result)

    def _stop_on_anomaly(self, step: int, kind: str) -> None:
        """An anomaly whose action is ``stop``: checkpoint the state that showed it, to look at; then end the run."""
        self.save_checkpoint()
        self.checkpoints.finish()
        raise AnomalyStop(f"stopped at step {step} by anomaly {kind} (train.anomaly.actions)")

    def _stop_requested(self, live: LiveConfig, step: int, stop_at: int) -> bool:
        """The stop file (issue 32 §3): once every rank has learnt of it (``live``, all at the same step), checkpoint
        this step — published before :meth:`run` returns — note it in ``stopped_at`` and end the loop. At the loop's
        last step (``stop_at``) nothing happens: the loop ends there anyway."""
        if live.stop_requested is None or step >= stop_at:
            return False
        self.save_checkpoint()
        self.stopped_at = step
        return True
