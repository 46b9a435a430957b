"""The training loop of one worker process.

One optimizer step = ``gradient_accumulation_steps`` micro-batches on every data-parallel rank. Gradients are
averaged by :class:`~kuangchao_core.parallel.data.DataParallel` across the DP group and by the ``1/grad_accum``
loss scale across micro-steps, so the step equals one process training on the whole global batch.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kuangchao_core import __version__
from kuangchao_core.ckpt.optim_state import flatten_optimizer_state, load_optimizer_state
from kuangchao_core.ckpt.reader import find_latest_intact, load_shard, read_rng, read_state
from kuangchao_core.ckpt.rng import capture_rng_state, restore_rng_state
from kuangchao_core.ckpt.writer import CheckpointWriter
from kuangchao_core.comm import primitives as P
from kuangchao_core.comm.timing import COMM_STATS
from kuangchao_core.data import PrefetchLoader, ResumableBatchSampler, build_dataset
from kuangchao_core.engine.metrics import memory_bytes
from kuangchao_core.engine.schedule import lr_at
from kuangchao_core.errors import CheckpointError
from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss, config_from_model_section
from kuangchao_core.obs.jsonlog import emit_event, log_event
from kuangchao_core.parallel.data import DataParallel

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

    def metrics(self) -> dict[str, float]:
        """The MLflow metric dict (contract names)."""
        return {
            "loss": self.loss,
            "lr": self.lr,
            "tokens_per_s": self.tokens_per_s,
            "grad_norm": self.grad_norm,
            "mem_bytes": float(self.mem_bytes),
            "comm_share": self.comm_share,
        }


@dataclass
class TrainState:
    """Progress that a checkpoint must carry besides tensors."""

    step: int = 0
    losses: list[float] = field(default_factory=list)


class Trainer:
    """Builds model, data and optimizer for this rank and runs the step loop with checkpoints."""

    def __init__(self, cfg: Any, rank: int, world_size: int, device: torch.device, world_group: Any, dp_group: Any):
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.world_group = world_group
        self.dp_group = dp_group
        self.dp_rank = dp_group.rank
        self.dp_size = dp_group.size
        self.state = TrainState()
        par = cfg.parallel
        self.micro_batch_size = par.micro_batch_size
        self.grad_accum = par.gradient_accumulation_steps

        torch.manual_seed(cfg.task.seed)
        self.model_config = config_from_model_section(cfg.model)
        model = LlamaForCausalLM(self.model_config)
        model.init_weights(cfg.task.seed)
        self.model = model.to(device)
        self.param_names = [name for name, _ in self.model.named_parameters()]
        self.dp = DataParallel(self.model, dp_group, bucket_cap_mb=par.bucket_size_mb)
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=float(opt.lr),
            betas=tuple(opt.betas),
            eps=float(opt.eps),
            weight_decay=float(opt.weight_decay),
            foreach=False,
        )

        self.dataset = build_dataset(cfg.data, self.model_config.vocab_size)
        self.sampler = ResumableBatchSampler(
            len(self.dataset),
            micro_batch_size=self.micro_batch_size,
            grad_accum=self.grad_accum,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            seed=cfg.task.seed,
            shuffle=cfg.data.shuffle,
        )
        self.loader: PrefetchLoader | None = None
        self.task_dir = Path(cfg.checkpoint.dir) / cfg.task.name
        self.writer = CheckpointWriter(cfg.checkpoint.dir, cfg.task.name, rank, world_size, barrier=self.barrier)

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        """A barrier over every rank, through the communication layer (so the guard sees it)."""
        P.all_reduce(torch.zeros(1), group=self.world_group, op="sum")

    def _global_mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        if self.dp_size > 1:
            P.all_reduce(t, group=self.dp_group, op="sum")
            t /= self.dp_size
        return float(t.item())

    # ------------------------------------------------------------------ checkpoints
    def _meta(self) -> dict[str, Any]:
        return {
            "model": self.cfg.model.model_dump(mode="json"),
            "model_shape": asdict(self.model_config),
            "parallel": self.cfg.parallel.model_dump(mode="json"),
            "task": self.cfg.task.name,
        }

    def save_checkpoint(self) -> Path:
        """Write the checkpoint of the current step (collective over all ranks)."""
        tensors: dict[str, torch.Tensor] = {}
        if self.dp_rank == 0:
            for name, p in self.model.named_parameters():
                tensors[f"param.{name}"] = p.detach().cpu()
            opt_tensors, opt_meta = flatten_optimizer_state(self.optimizer, self.param_names)
            tensors.update(opt_tensors)
        else:
            opt_meta = None
        assert self.loader is not None
        state = {
            "step": self.state.step,
            "sampler": self.loader.state_dict(),
            "optimizer_meta": opt_meta,
            "losses": self.state.losses,
            "kuangchao_version": __version__,
            "config_hash": self.cfg.config_hash(),
        }
        path = self.writer.save(
            self.state.step,
            tensors,
            rng_state=capture_rng_state(),
            state=state if self.rank == 0 else None,
            meta=self._meta(),
        )
        keep = self.cfg.checkpoint.keep_last
        if self.rank == 0 and keep:
            from kuangchao_core.ckpt.retention import apply_retention

            apply_retention(self.task_dir, keep)
        self.barrier()
        return path

    def resolve_resume(self, resume: str) -> Path | None:
        """The step directory to resume from: ``auto`` = newest intact, ``never`` = none, else a path."""
        if resume == "never":
            return None
        if resume == "auto":
            return find_latest_intact(self.task_dir) if self.task_dir.exists() else None
        path = Path(resume)
        if not path.exists():
            raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
        return path

    def load_checkpoint(self, step_dir: Path) -> None:
        """Restore params, optimizer, step, sampler position and RNG from ``step_dir``."""
        state = read_state(step_dir)
        tensors = load_shard(step_dir, 0)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                key = f"param.{name}"
                if key not in tensors:
                    raise CheckpointError(f"{step_dir}: tensor {key} missing from shard of rank 0")
                p.copy_(tensors[key].to(p.dtype))
        load_optimizer_state(self.optimizer, self.param_names, tensors, state["optimizer_meta"])
        self.state.step = int(state["step"])
        self.state.losses = list(state.get("losses", []))
        self.sampler.load_state_dict(state["sampler"])
        restore_rng_state(read_rng(step_dir, self.rank))
        log_event(log, "resumed", step=self.state.step, checkpoint=str(step_dir))

    # ------------------------------------------------------------------ the step
    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        """One optimizer step over this rank's micro-batches; returns global metrics."""
        t0 = time.perf_counter()
        comm0 = COMM_STATS.total_seconds()
        step = self.state.step
        lr = lr_at(
            step,
            float(self.cfg.optimizer.lr),
            self.cfg.train.steps,
            self.cfg.train.warmup_steps,
            self.cfg.train.lr_schedule,
            self.cfg.train.min_lr_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.dp.zero_grad()
        local_loss = 0.0
        tokens = 0
        n = len(micro_batches)
        for i, batch in enumerate(micro_batches):
            input_ids = batch["input_ids"].to(self.device, non_blocking=True)
            labels = batch["labels"].to(self.device, non_blocking=True)
            tokens += int((labels != -100).sum())
            last = i == n - 1
            ctx = self.dp.no_sync() if not last else nullcontext()
            with ctx:
                loss = causal_lm_loss(self.model(input_ids), labels) / n
                loss.backward()
            local_loss += float(loss.detach())
        self.dp.finish_gradient_sync()
        max_norm = float(self.cfg.optimizer.max_grad_norm or 0.0)
        if max_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        else:
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None]))
        self.optimizer.step()
        loss = self._global_mean(local_loss)
        tokens_global = tokens * self.dp_size
        self.state.step += 1
        self.state.losses.append(loss)
        dt = time.perf_counter() - t0
        comm = COMM_STATS.total_seconds() - comm0
        return StepResult(
            step=self.state.step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens_per_s=tokens_global / dt if dt > 0 else 0.0,
            mem_bytes=memory_bytes(self.device),
            comm_share=min(1.0, comm / dt) if dt > 0 else 0.0,
            step_time_s=dt,
        )

    # ------------------------------------------------------------------ the loop
    def run(self, resume: str = "auto", metric_sink: Any = None, max_steps: int | None = None) -> TrainState:
        """Train to ``train.steps`` (or ``max_steps`` more steps), checkpointing every ``checkpoint.interval``."""
        self.dp.sync_parameters()
        step_dir = self.resolve_resume(resume)
        if step_dir is not None:
            self.load_checkpoint(step_dir)
        total = self.cfg.train.steps
        interval = self.cfg.checkpoint.interval
        self.loader = PrefetchLoader(self.dataset, self.sampler, depth=self.cfg.data.prefetch)
        last_saved = self.state.step if step_dir is not None else -1
        stop_at = total if max_steps is None else min(total, self.state.step + max_steps)
        log_interval = max(1, self.cfg.train.log_interval)
        start_step = self.state.step
        t_start = time.perf_counter()
        if self.rank == 0:
            emit_event("start", total_steps=total, start_step=start_step, world_size=self.world_size)
        try:
            while self.state.step < stop_at:
                result = self.train_step(self.loader.next_step())
                if metric_sink is not None and self.rank == 0:
                    metric_sink.log_step(result.step, result.metrics())
                if self.rank == 0 and (result.step % log_interval == 0 or result.step == stop_at):
                    elapsed = time.perf_counter() - t_start
                    done = result.step - start_step
                    eta = elapsed / done * (total - result.step) if done else None
                    fields = result.metrics() | {"step": result.step, "total_steps": total, "eta_s": eta}
                    log_event(log, "step", **fields)
                    emit_event("step", **fields)
                if interval and result.step % interval == 0:
                    self.save_checkpoint()
                    last_saved = result.step
                    if self.rank == 0:
                        emit_event("checkpoint", step=result.step)
            if self.state.step != last_saved and self.state.step == total:
                self.save_checkpoint()
                if self.rank == 0:
                    emit_event("checkpoint", step=self.state.step)
        finally:
            self.loader.close()
        return self.state
