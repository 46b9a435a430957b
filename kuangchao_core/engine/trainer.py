"""The training loop of one worker process.

One optimizer step = ``gradient_accumulation_steps`` micro-batches on every data-parallel rank. Gradients are
averaged by :class:`~kuangchao_core.parallel.data.DataParallel` across the DP group and by the ``1/grad_accum``
loss scale across micro-steps, so the step equals one process training on the whole global batch.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kuangchao_core import __version__
from kuangchao_core.ckpt.lineage import LEGACY, ResumePlan, create_lineage, plan_resume
from kuangchao_core.ckpt.reader import read_rng, read_state
from kuangchao_core.ckpt.reshard import Region, load_for_layout, load_optimizer_for_layout, param_keys
from kuangchao_core.ckpt.rng import capture_rng_state, restore_rng_state
from kuangchao_core.ckpt.writer import CheckpointWriter
from kuangchao_core.comm import primitives as P
from kuangchao_core.comm.timing import COMM_STATS
from kuangchao_core.data import PrefetchLoader, ResumableBatchSampler, build_dataset
from kuangchao_core.engine.metrics import memory_bytes, memory_kind, tensor_bytes
from kuangchao_core.engine.parallel_model import build_parallel_model, target_layout
from kuangchao_core.engine.schedule import lr_at
from kuangchao_core.errors import CheckpointError
from kuangchao_core.models.llama import config_from_model_section
from kuangchao_core.obs.jsonlog import emit_event, log_event
from kuangchao_core.parallel.data import DataParallel
from kuangchao_core.parallel.zero import ZeroOptimizer

ADAM_KEYS = ("exp_avg", "exp_avg_sq")

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
    trained_tokens: int = 0  # global tokens of the steps this run trained (not of resumed ones)
    train_seconds: float = 0.0  # wall time of those steps

    @property
    def tokens_per_s_mean(self) -> float | None:
        """Mean global throughput of this run's steps (total tokens / total step time); None before any step."""
        return self.trained_tokens / self.train_seconds if self.train_seconds > 0 else None


class Trainer:
    """Builds this rank's model part, data and optimizer for a dp×tp×pp mesh and runs the step loop.

    ``mesh``: a :class:`~kuangchao_core.parallel.mesh.ParallelMesh` (groups built once, passed explicitly).
    """

    def __init__(self, cfg: Any, rank: int, world_size: int, device: torch.device, world_group: Any, mesh: Any):
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.world_group = world_group
        self.mesh = mesh
        self.dp_group = mesh.dp_group
        self.dp_rank = mesh.dp_rank
        self.dp_size = mesh.dp
        self.state = TrainState()
        par = cfg.parallel
        self.micro_batch_size = par.micro_batch_size
        self.grad_accum = par.gradient_accumulation_steps
        self.zero_stage = int(par.zero_stage)

        torch.manual_seed(cfg.task.seed)
        if cfg.train.dtype in ("bf16", "fp16") and rank == 0:
            log.warning(
                "train.dtype %s: mixed precision is not implemented yet; this job trains with fp32 parameters and "
                "fp32 compute (set train.dtype: fp32 to silence this)",
                cfg.train.dtype,
            )
        if cfg.train.warmup_steps >= cfg.train.steps and rank == 0:
            log.warning(
                "train.warmup_steps %d >= train.steps %d: the learning rate rises for the whole run and never reaches "
                "optimizer.lr",
                cfg.train.warmup_steps,
                cfg.train.steps,
            )
        self.model_config = config_from_model_section(cfg.model)
        self.parts = build_parallel_model(cfg, self.model_config, mesh, device)
        self.model = self.parts.model
        self.layout = target_layout(mesh, cfg)
        named = list(self.model.named_parameters())
        self.param_names = [n for n, _ in named]
        opt = cfg.optimizer
        hyper = {
            "lr": float(opt.lr),
            "betas": tuple(opt.betas),
            "eps": float(opt.eps),
            "weight_decay": float(opt.weight_decay),
        }
        self.dp: DataParallel | None = None
        if self.zero_stage:
            self.optimizer: Any = ZeroOptimizer(
                named, self.dp_group, stage=self.zero_stage, bucket_cap_mb=par.bucket_size_mb, **hyper
            )
            if self.rank == 0:
                log_event(log, "zero memory per rank", **self.optimizer.memory_report())
        else:
            self.dp = DataParallel(self.model, self.dp_group, bucket_cap_mb=par.bucket_size_mb)
            self.optimizer = torch.optim.AdamW([p for _, p in named], foreach=False, **hyper)

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
        self.global_config: Any = None  # job-global settings changed at run time (kc config set), see the worker
        self.lr_scale = 1.0
        self._global_config_version = -1
        self.task_dir = Path(cfg.checkpoint.dir) / cfg.task.name
        self.writer = CheckpointWriter(cfg.checkpoint.dir, cfg.task.name, rank, world_size, barrier=self.barrier)
        self.plan: ResumePlan | None = None  # set by run(): this run's lineage and resume checkpoint

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        """A barrier over every rank, through the communication layer (so the guard sees it)."""
        P.all_reduce(torch.zeros(1), group=self.world_group, op="sum")

    def _sum_over(self, t: torch.Tensor, *groups: Any) -> torch.Tensor:
        for group in groups:
            if group is not None and group.size > 1:
                P.all_reduce(t, group=group, op="sum")
        return t

    # ------------------------------------------------------------------ checkpoints
    def _meta(self) -> dict[str, Any]:
        return {
            "model": self.cfg.model.model_dump(mode="json"),
            "model_shape": asdict(self.model_config),
            "parallel": self.cfg.parallel.model_dump(mode="json"),
            "task": self.cfg.task.name,
        }

    def _checkpoint_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """This rank's tensors and their slice metadata: parameters (first DP replica only) and optimizer state."""
        tensors: dict[str, torch.Tensor] = {}
        slices: dict[str, dict[str, Any]] = {}
        regions = self.parts.regions
        if self.dp_rank == 0:
            for name, p in self.model.named_parameters():
                tensors[f"param.{name}"] = p.detach().cpu()
                slices[f"param.{name}"] = regions[name].to_meta()
        if self.zero_stage and self.mesh.tp == 1:
            opt_tensors, opt_slices, _ = self.optimizer.state_dict_for_checkpoint()
            tensors.update(opt_tensors)
            slices.update(opt_slices)
        elif self.zero_stage:
            # a ZeRO range of a TP slice has no slice description: gather the state over DP, save it per TP slice
            full, _ = self.optimizer.full_state_dict()
            if self.dp_rank == 0:
                for name in self.param_names:
                    for key in ADAM_KEYS:
                        k = f"optim.{name}.{key}"
                        if k in full:
                            tensors[k] = full[k].detach().cpu().clone()
                            slices[k] = regions[name].to_meta()
        elif self.dp_rank == 0:
            params = dict(self.model.named_parameters())
            for name, p in params.items():
                st = self.optimizer.state.get(p) or {}
                for key in ADAM_KEYS:
                    if key in st:
                        tensors[f"optim.{name}.{key}"] = st[key].detach().cpu().clone()
                        slices[f"optim.{name}.{key}"] = regions[name].to_meta()
        return tensors, slices

    def save_checkpoint(self) -> Path:
        """Write the checkpoint of the current step (collective over all ranks)."""
        tensors, slices = self._checkpoint_tensors()
        assert self.loader is not None
        state = {
            "step": self.state.step,
            "optimizer_steps": self.state.step,
            "sampler": self.loader.state_dict(),
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
            slices=slices,
        )
        keep = self.cfg.checkpoint.keep_last
        if self.rank == 0 and keep:
            from kuangchao_core.ckpt.retention import apply_retention

            # this lineage only, and never the step just written
            apply_retention(self.writer.task_dir, keep, protect=path.name)
        self.barrier()
        return path

    def plan_checkpoints(self, resume: str, lineage: str | None = None) -> ResumePlan:
        """Agree on this run's lineage and resume checkpoint (see :mod:`kuangchao_core.ckpt.lineage`); collective.

        Rank 0 decides (``lineage`` pins it, as a flow run does for every attempt) and broadcasts the plan, so all
        ranks write into the same lineage even when it is new; rank 0 creates it.
        """
        payload = b""
        if self.rank == 0:
            plan = plan_resume(self.cfg, resume, pinned=lineage)
            if plan.new:
                create_lineage(self.cfg, plan.lineage, started_from=plan.step_dir)
            payload = json.dumps(plan.to_dict()).encode("utf-8")
        if self.world_size > 1:
            size = torch.tensor([len(payload)], dtype=torch.int64)
            P.broadcast(size, src=0, group=self.world_group)
            buf = torch.zeros(int(size.item()), dtype=torch.uint8)
            if self.rank == 0:
                buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            P.broadcast(buf, src=0, group=self.world_group)
            payload = bytes(buf.tolist())
        self.plan = ResumePlan(**json.loads(payload.decode("utf-8")))
        self.writer.lineage = None if self.plan.lineage == LEGACY else self.plan.lineage
        return self.plan

    @torch.no_grad()
    def _copy_params(self, full_named: dict[str, torch.Tensor], source: str) -> None:
        for name, p in self.model.named_parameters():
            if name not in full_named:
                raise CheckpointError(f"{source}: tensor for parameter {name} missing")
            value = full_named[name]
            if tuple(value.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"{source}: {name} has shape {tuple(value.shape)}, this rank needs {tuple(p.shape)}"
                )
            p.copy_(value.to(p.dtype))  # ZeRO keeps fp32 parameters as views of its flat buffer: no refresh

    def load_pretrained(self, hf_dir: str) -> None:
        """Start from a local Hugging Face Llama directory, reading only the slices this rank holds."""
        from kuangchao_core.ckpt.hf import load_hf_weights_for_layout

        weights = load_hf_weights_for_layout(hf_dir, self.model_config, self.layout)
        self._copy_params(weights, hf_dir)
        log_event(log, "loaded pretrained weights", path=hf_dir, tensors=len(weights))

    def load_checkpoint(self, step_dir: Path) -> None:
        """Restore params, optimizer, step, sampler position and RNG from ``step_dir`` — written in this or any
        other layout: each rank reads only the slices its layout holds."""
        state = read_state(step_dir)
        regions: dict[str, Region] = self.parts.regions
        params = load_for_layout(step_dir, param_keys(regions))
        self._copy_params({k.removeprefix("param."): v for k, v in params.items()}, str(step_dir))
        steps = int(state.get("optimizer_steps", state["step"]))
        optim = load_optimizer_for_layout(step_dir, regions)
        self._load_optimizer(optim, steps, step_dir)
        self.state.step = int(state["step"])
        self.state.losses = list(state.get("losses", []))
        self.sampler.load_state_dict(state["sampler"])
        try:
            restore_rng_state(read_rng(step_dir, self.rank))
        except CheckpointError as exc:  # a new layout with more ranks than the old one
            log.warning("no RNG state for rank %d in %s (%s); RNG continues from the seed", self.rank, step_dir, exc)
        log_event(log, "resumed", step=self.state.step, checkpoint=str(step_dir))

    def _load_optimizer(self, optim: dict[str, torch.Tensor], steps: int, step_dir: Path) -> None:
        names = self.param_names
        have = [n for n in names if all(f"optim.{n}.{k}" in optim for k in ADAM_KEYS)]
        if not have:
            if steps:
                log.warning("%s holds no optimizer state; AdamW moments start from zero", step_dir)
            return
        if len(have) != len(names):
            missing = sorted(set(names) - set(have))[:3]
            raise CheckpointError(f"{step_dir}: optimizer state missing for {missing}")
        if self.zero_stage:
            tensors = {f"optim.{n}.{k}": optim[f"optim.{n}.{k}"] for n in names for k in ADAM_KEYS}
            tensors.update({f"optim.{n}.step": torch.tensor(float(steps)) for n in names})
            meta = {
                "format": 1,
                "optimizer": "AdamW",
                "param_groups": [{"param_names": names}],
                "state_keys": {n: ["exp_avg", "exp_avg_sq", "step"] for n in names},
                "state_scalars": {},
            }
            self.optimizer.load_full_state(tensors, meta)
            return
        params = dict(self.model.named_parameters())
        for name in names:
            p = params[name]
            self.optimizer.state[p] = {
                "step": torch.tensor(float(steps), dtype=torch.float32),
                "exp_avg": optim[f"optim.{name}.exp_avg"].to(p.dtype).clone(),
                "exp_avg_sq": optim[f"optim.{name}.exp_avg_sq"].to(p.dtype).clone(),
            }

    # ------------------------------------------------------------------ the step
    def _grad_sync(self) -> Any:
        return self.optimizer if self.zero_stage else self.dp

    def _clip(self) -> float:
        """Global gradient norm over every group (each element counted once), clipped to ``max_grad_norm``."""
        max_norm = float(self.cfg.optimizer.max_grad_norm or 0.0)
        mesh = self.mesh
        if self.zero_stage:
            self.optimizer.finish_gradient_sync()
            grads = self.optimizer.grad_shards()
            sq = torch.zeros((), dtype=torch.float64)
            for slot, lo, hi, offset in self.optimizer.owned_pieces():
                piece = grads[slot.bucket][offset : offset + hi - lo]
                sq += piece.double().pow(2).sum() * self.parts.norm_weight[slot.name]
            self._sum_over(sq, self.dp_group, mesh.tp_group, mesh.pp_group)
        elif mesh.tp == 1 and mesh.pp == 1:
            params = [p for p in self.model.parameters() if p.grad is not None]
            if max_norm > 0:
                return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
            return float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        else:
            grads = []
            sq = torch.zeros((), dtype=torch.float64)
            for name, p in self.model.named_parameters():
                if p.grad is None:
                    continue
                grads.append(p.grad)
                sq += p.grad.double().pow(2).sum() * self.parts.norm_weight[name]
            self._sum_over(sq, mesh.tp_group, mesh.pp_group)
        total = float(sq.sqrt())
        if max_norm > 0:
            coef = min(1.0, max_norm / (total + 1e-6))
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        return total

    def _forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
        """Forward and backward of every micro-batch with the gradient reduction; (local mean loss, tokens)."""
        sync = self._grad_sync()
        n = len(micro_batches)
        batches = [
            {k: v.to(self.device, non_blocking=True) for k, v in b.items() if k in ("input_ids", "labels")}
            for b in micro_batches
        ]
        tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
        if self.parts.executor is not None:
            with sync.no_sync():
                loss = self.parts.executor.run(batches)
            if self.zero_stage:
                self.optimizer.finish_gradient_sync()
            else:
                self.dp.sync_accumulated()
            return (float(loss) if loss is not None else 0.0), tokens
        local = 0.0
        for i, batch in enumerate(batches):
            ctx = sync.no_sync() if i < n - 1 else nullcontext()
            with ctx:
                loss = self.parts.loss_fn(self.model(batch["input_ids"]), batch["labels"]) / n
                loss.backward()
            local += float(loss.detach())
        if self.zero_stage:
            self.optimizer.finish_gradient_sync()
        else:
            self.dp.finish_gradient_sync()
        return local, tokens

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        """One optimizer step over this rank's micro-batches; returns global metrics."""
        t0 = time.perf_counter()
        comm0 = COMM_STATS.total_seconds()
        step = self.state.step
        lr = (
            lr_at(
                step,
                float(self.cfg.optimizer.lr),
                self.cfg.train.steps,
                self.cfg.train.warmup_steps,
                self.cfg.train.lr_schedule,
                self.cfg.train.min_lr_ratio,
            )
            * self.lr_scale
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._grad_sync().zero_grad()
        local_loss, tokens = self._forward_backward(micro_batches)
        grad_norm = self._clip()
        self.optimizer.step()
        # the loss lives on the last pipeline stage (0 elsewhere): sum over PP, mean over DP
        loss_t = torch.tensor([local_loss], dtype=torch.float64)
        self._sum_over(loss_t, self.mesh.pp_group, self.dp_group)
        loss = float(loss_t.item()) / self.dp_size
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

    # ------------------------------------------------------------------ job-global configuration (L5)
    def _follow_global_config(self, step: int, log_interval: int, interval: int | None, first: bool) -> tuple[int, Any]:
        """Apply changes of the job's global configuration at a step boundary every rank agrees on.

        ``self.global_config`` (a :class:`~kuangchao_core.perm.global_config.GlobalConfig`, set by the worker from
        ``KC_GLOBAL_CONFIG``; None = nothing to follow). Ranks may see the file change at different moments, so
        only rank 0 reads it (a stat-cached read, no lock), on the first step of an attempt and then every
        ``log_interval`` steps, and broadcasts ``[version, lr_scale, log_interval, checkpoint_interval]`` over the
        world group; every rank applies what it received, at the same step. There is no per-step collective: one
        small broadcast every ``log_interval`` steps, and a change waits at most that many steps.
        Returns the (possibly changed) log and checkpoint intervals; each applied change is logged on every rank.
        """
        gc = self.global_config
        if gc is None or (not first and step % log_interval):
            return log_interval, interval
        packet = torch.zeros(4, dtype=torch.float64)
        if self.rank == 0:
            try:
                snap = gc.snapshot()
                v = snap.values
                packet = torch.tensor(
                    [snap.version, v.get("lr_scale", 1.0), v.get("log_interval", 0), v.get("checkpoint_interval", 0)],
                    dtype=torch.float64,
                )
            except Exception as exc:  # rank 0 must still join the broadcast; the job keeps its current settings
                packet[0] = -1
                log.warning("global config %s not readable at step %d (%s); settings unchanged", gc.path, step, exc)
        if self.world_size > 1:
            P.broadcast(packet, src=0, group=self.world_group)
        version = int(packet[0])
        if version < 0 or version == self._global_config_version:
            return log_interval, interval
        self._global_config_version = version
        current = {"lr_scale": self.lr_scale, "log_interval": log_interval, "checkpoint_interval": interval}
        new = {
            "lr_scale": float(packet[1]),
            "log_interval": int(packet[2]) or log_interval,
            "checkpoint_interval": int(packet[3]) or interval,
        }
        for key, value in new.items():
            if value != current[key]:
                fields = {"version": version, "key": key, "value": value, "old": current[key], "step": step}
                log_event(log, "global config applied", **fields)
                if self.rank == 0:
                    emit_event("config_applied", **fields)
        self.lr_scale = new["lr_scale"]
        return new["log_interval"], new["checkpoint_interval"]

    def _report_memory(self, result: StepResult) -> None:
        """Once, after the first step: rank 0's measured tensor bytes beside ``kc plan``'s estimate of them, and
        the process memory (RSS on CPU), which also counts the runtime and is not what the plan estimates."""
        from kuangchao_core.parallel.plan import explain_plan

        measured = tensor_bytes(self.model, self.optimizer)
        try:
            est = explain_plan(self.cfg)["ranks"][self.rank]["memory_bytes"]
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
        this run's lineage (``lineage`` pins it; else :meth:`plan_checkpoints` decides from ``resume``)."""
        if self.dp is not None:
            self.dp.sync_parameters()
        plan = self.plan_checkpoints(resume, lineage)
        if self.rank == 0:
            log_event(log, "checkpoints", lineage=plan.lineage, resume_from=plan.step_dir, reason=plan.reason)
        step_dir = Path(plan.step_dir) if plan.step_dir else None
        if step_dir is not None:
            self.load_checkpoint(step_dir)
        elif self.cfg.model.checkpoint:
            self.load_pretrained(self.cfg.model.checkpoint)
        total = self.cfg.train.steps
        interval = self.cfg.checkpoint.interval
        self.loader = PrefetchLoader(self.dataset, self.sampler, depth=self.cfg.data.prefetch)
        last_saved = self.state.step if step_dir is not None else -1
        stop_at = total if max_steps is None else min(total, self.state.step + max_steps)
        log_interval = max(1, self.cfg.train.log_interval)
        start_step = self.state.step
        t_start = time.perf_counter()
        if self.rank == 0:
            emit_event(
                "start", total_steps=total, start_step=start_step, world_size=self.world_size, lineage=plan.lineage
            )
        try:
            while self.state.step < stop_at:
                result = self.train_step(self.loader.next_step())
                self.state.trained_tokens += round(result.tokens_per_s * result.step_time_s)
                self.state.train_seconds += result.step_time_s
                if result.step == start_step + 1 and self.rank == 0:
                    self._report_memory(result)
                log_interval, interval = self._follow_global_config(
                    result.step, log_interval, interval, first=result.step == start_step + 1
                )
                if metric_sink is not None and self.rank == 0:
                    metric_sink.log_step(result.step, result.metrics())
                if self.rank == 0 and (result.step % log_interval == 0 or result.step == stop_at):
                    elapsed = time.perf_counter() - t_start
                    done = result.step - start_step
                    eta = elapsed / done * (total - result.step) if done else None
                    fields = result.metrics() | {
                        "step": result.step,
                        "total_steps": total,
                        "eta_s": eta,
                        "mem_kind": memory_kind(self.device),
                    }
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
