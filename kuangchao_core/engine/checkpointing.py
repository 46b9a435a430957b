"""The trainer's checkpoint I/O: which lineage a run writes to, saving a step, resuming one, starting from HF weights.

Every rank holds one :class:`TrainerCheckpoints`. A checkpoint holds the parameters of the first DP replica and the
optimizer state as the job's :class:`~kuangchao_core.parallel.grad_sync.GradSync` gives it, each tensor with the
slice of the full tensor it is, so any layout reads only its own slices back
(:func:`~kuangchao_core.ckpt.index.load_for_layout`). Step directories go into the run's lineage
(:mod:`kuangchao_core.ckpt.lineage`), which rank 0 decides and broadcasts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kuangchao_core import __version__
from kuangchao_core.ckpt.async_save import AsyncSaver
from kuangchao_core.ckpt.index import load_for_layout, load_optimizer_for_layout, param_keys
from kuangchao_core.ckpt.integrity import mark_bad, read_manifest
from kuangchao_core.ckpt.lineage import LEGACY, ResumePlan, create_lineage, plan_resume
from kuangchao_core.ckpt.reader import load_shard, read_rng, read_state
from kuangchao_core.ckpt.retention import apply_retention
from kuangchao_core.ckpt.rng import capture_rng_state, restore_rng_state
from kuangchao_core.ckpt.writer import CheckpointWriter
from kuangchao_core.comm import diag
from kuangchao_core.comm import primitives as P
from kuangchao_core.config.settings import CheckpointSettings
from kuangchao_core.engine.anomaly import AnomalyStop
from kuangchao_core.errors import CheckpointError, ConfigError
from kuangchao_core.obs.jsonlog import log_event
from kuangchao_core.obs.publish_gate import nonfinite_names
from kuangchao_core.parallel.grad_sync import GradSync, require_full_state

log = logging.getLogger("kuangchao.engine")


def model_mismatch(manifest: dict[str, Any], model_config: Any) -> str | None:
    """Why a checkpoint (its manifest's ``model_shape``) cannot hold this job's model, naming both shapes; None
    when it fits or the manifest does not say."""
    saved = manifest.get("model_shape")
    if not isinstance(saved, dict):
        return None
    mine = asdict(model_config)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
    diff = {k: (saved.get(k), mine.get(k)) for k in keys if saved.get(k) != mine.get(k)}
    if not diff:
        return None
    shown = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in diff.items())
    return f"the checkpoint holds another model than this job's (checkpoint vs job: {shown})"


class TrainerCheckpoints:
    """Checkpoint I/O of one rank. ``parts``: the rank's :class:`~kuangchao_core.engine.parallel_model.ParallelModel`;
    ``layout``: its resharding view (:func:`~kuangchao_core.engine.parallel_model.target_layout`); ``host_group``:
    every rank, for host-side agreement (the resume plan); ``barrier``: a barrier over every rank; ``settings``:
    the run's :class:`~kuangchao_core.config.settings.CheckpointSettings` (with the key of its lineages)."""

    def __init__(
        self,
        settings: CheckpointSettings,
        rank: int,
        world_size: int,
        mesh: Any,
        parts: Any,
        sync: GradSync,
        host_group: Any,
        model_config: Any,
        layout: Any,
        barrier: Any,
    ):
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.mesh = mesh
        self.parts = parts
        self.sync = sync
        self.host_group = host_group
        self.model_config = model_config
        self.layout = layout
        self.barrier = barrier
        self.writer = CheckpointWriter(settings.dir, settings.task, rank, world_size, barrier=barrier)
        self.saver = AsyncSaver(self.writer) if settings.async_ else None
        self.plan: ResumePlan | None = None
        self.saved_at = -1  # the step the cadence last saved, or the run resumed from (-1: neither)

    # ------------------------------------------------------------------ lineage
    def plan_run(self, resume: str, lineage: str | None = None) -> ResumePlan:
        """Agree on this run's lineage and resume checkpoint; collective.

        Rank 0 decides (``lineage`` pins it, as a flow run does for every attempt) and broadcasts the plan, so all
        ranks write into the same lineage even when it is new; rank 0 creates it.
        """
        payload = b""
        if self.rank == 0:
            plan = plan_resume(self.settings.lineage, resume, pinned=lineage)
            if plan.new:
                create_lineage(self.settings.lineage, plan.lineage, started_from=plan.step_dir)
            payload = json.dumps(plan.to_dict()).encode("utf-8")
        if self.world_size > 1:
            size = torch.tensor([len(payload)], dtype=torch.int64)
            P.broadcast(size, src=0, group=self.host_group)
            buf = torch.zeros(int(size.item()), dtype=torch.uint8)
            if self.rank == 0:
                buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            P.broadcast(buf, src=0, group=self.host_group)
            payload = bytes(buf.tolist())
        self.plan = ResumePlan(**json.loads(payload.decode("utf-8")))
        self.writer.lineage = None if self.plan.lineage == LEGACY else self.plan.lineage
        return self.plan

    # ------------------------------------------------------------------ save
    def _meta(self) -> dict[str, Any]:
        meta = {
            "model": self.settings.model_meta,
            "model_shape": asdict(self.model_config),
            "parallel": self.settings.parallel_meta,
            "task": self.settings.task,
            "comm_layout": self._comm_layout(),
        }
        if self.parts.lora is not None:
            meta["lora"] = self._lora_meta()
        if self.settings.model_meta.get("vision") is not None:  # untrained tower weights are drawn from it at export
            meta["vision_seed"] = int(self.settings.seed)
            if self.settings.pretrained:  # ... or read from the LLaVA directory the job started from
                from kuangchao_core.models.lora import base_identity

                meta["vision_base"] = base_identity(self.settings.pretrained, self.settings.seed, self.model_config)
        return meta

    def _lora_meta(self) -> dict[str, Any]:
        """The adapters' settings and the identity of the frozen base they were trained on (a LoRA checkpoint
        holds only the adapters)."""
        if not hasattr(self, "_lora_meta_cache"):
            from kuangchao_core.models.lora import base_identity

            s = self.settings
            base = base_identity(s.pretrained, s.seed, self.model_config)
            self._lora_meta_cache = {**self.parts.lora.to_dict(), "base": base, "seed": s.seed}
        return self._lora_meta_cache

    def _tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """This rank's tensors and their slice metadata: parameters (first DP replica only) and optimizer state."""
        tensors: dict[str, torch.Tensor] = {}
        slices: dict[str, dict[str, Any]] = {}
        regions = self.parts.regions
        with self.sync.full_parameters():  # collective under ZeRO-3: its parameters are sharded between forwards
            for name, p in self.parts.model.named_parameters():
                # a LoRA checkpoint holds the adapters (the frozen base is its identity); the first replica writes
                if p.requires_grad and self.parts.placement.first_holder(name, self.mesh.coords):
                    tensors[f"param.{name}"] = p.detach().cpu()
                    slices[f"param.{name}"] = regions[name].to_meta()
        opt_tensors, opt_slices = self.sync.checkpoint_tensors(regions)
        tensors.update(opt_tensors)
        slices.update(opt_slices)
        comm_state = self.sync.comm_state_tensors()
        tensors.update({f"{self._comm_prefix()}{k}": v for k, v in comm_state.items()})
        return tensors, slices

    def _comm_prefix(self) -> str:
        """Per-rank gradient-compression state lives in the rank's own shard under ``comm.rank<r>.``."""
        return f"comm.rank{self.rank}."

    def _comm_layout(self) -> dict[str, Any]:
        return {**self.settings.comm_layout, "node_of_rank": list(getattr(self.mesh, "node_of_rank", []))}

    def save(
        self,
        step: int,
        losses: list[float],
        sampler_state: dict[str, Any],
        on_commit: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> Path | None:
        """Write the checkpoint of ``step`` into this run's lineage, then apply retention (collective); ``on_commit``
        is called with the step directory once it is published. With ``checkpoint.async`` the tensors are
        snapshotted and written in the background (``ckpt.async_save``) and None is returned. ``extra``: more
        ``state.json`` entries (``optimizer_steps`` when steps were skipped, the loss scaler's ``precision``)."""
        tensors, slices = self._tensors()
        self._refuse_nonfinite(step, tensors)
        state = {
            "step": step,
            "optimizer_steps": step,
            "sampler": sampler_state,
            "losses": losses,
            "kuangchao_version": __version__,
            "config_hash": self.settings.config_hash,
            **(extra or {}),
            **self.parts.extra_state(),  # MoE routing biases (issue 40)
        }
        keep = self.settings.keep_last

        def published(path: Path) -> None:
            if self.rank == 0 and keep:
                self.writer.check_lease("retention")
                apply_retention(self.writer.task_dir, keep, protect=path.name)  # this lineage only, never this step
            if on_commit is not None:
                on_commit(path)

        kw = dict(state=state if self.rank == 0 else None, meta=self._meta(), slices=slices)
        if self.saver is not None:
            self.saver.start(step, tensors, capture_rng_state(), on_commit=published, **kw)
            return None
        diag.beat()  # progress for comm.watchdog: before and after the files, this rank's longest quiet stretch
        path = self.writer.save(step, tensors, rng_state=capture_rng_state(), **kw)
        diag.beat()
        published(path)
        self.barrier()
        return path

    def _refuse_nonfinite(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Collective: raise :class:`~kuangchao_core.engine.anomaly.AnomalyStop` on every rank, before anything of
        ``step`` is written, when any rank's parameters or optimizer state hold a NaN or an infinity (a diverged run
        never saves; its newest checkpoint stays the last good one). Every rank's message names the same tensors."""
        bad = nonfinite_names(tensors)
        count = torch.tensor([float(len(bad))], dtype=torch.float64)
        if self.world_size > 1:
            P.all_reduce(count, group=self.host_group, op="sum")
        total = int(count.item())
        if total == 0:
            return
        named = self._gather_names([f"rank {self.rank}: {n}" for n in bad[:3]])
        self.finish()  # a save in flight holds the last good state: let it land
        more = f" and {len(named) - 3} more" if len(named) > 3 else ""
        raise AnomalyStop(
            f"stopped at step {step}: the run diverged — {total} parameter or optimizer tensor(s) are not finite "
            f"({', '.join(named[:3])}{more}); step {step} was not saved and the newest checkpoint is the last good "
            "one: look at the data, the learning rate and the starting weights before resuming"
        )

    def _gather_names(self, names: list[str]) -> list[str]:
        """Every rank's ``names``, in rank order, on every rank (host group; two small all-reduces)."""
        if self.world_size == 1:
            return names
        mine = "".join(f"{n}\n" for n in names).encode("utf-8")
        sizes = torch.zeros(self.world_size, dtype=torch.int64)
        sizes[self.rank] = len(mine)
        P.all_reduce(sizes, group=self.host_group, op="sum")
        buf = torch.zeros(int(sizes.sum()), dtype=torch.int32)
        start = int(sizes[: self.rank].sum())
        if mine:
            buf[start : start + len(mine)] = torch.tensor(list(mine), dtype=torch.int32)
        P.all_reduce(buf, group=self.host_group, op="sum")
        text = bytes(buf.tolist()).decode("utf-8", errors="replace")
        return [line for line in text.split("\n") if line]

    def check(self) -> None:
        """Raise the error of a failed background save (no-op for synchronous saves)."""
        if self.saver is not None:
            self.saver.check()

    def finish(self) -> None:
        """Wait until the background save in flight (if any) is published; raise its error."""
        if self.saver is not None:
            self.saver.wait()

    # ------------------------------------------------------------------ the loop's cadence
    def after_step(self, step: int, interval: int | None, save: Callable[[], Any]) -> None:
        """After every step: ``save`` (the trainer's checkpoint of this step, collective) when ``interval`` (the
        followed ``checkpoint.interval``) divides ``step``; then a failed background save ends the run here."""
        if interval and step % interval == 0:
            save()
            self.saved_at = step
        self.check()

    def at_end(self, step: int, total: int, save: Callable[[], Any]) -> None:
        """After the loop: the last step (``total``) saved unless it is saved already, and the save in flight
        published before the run reports done."""
        if step != self.saved_at and step == total:
            save()
        self.finish()

    # ------------------------------------------------------------------ load
    @torch.no_grad()
    def _copy_params(self, full_named: dict[str, torch.Tensor], source: str, names: set[str]) -> None:
        """Copy ``names`` (this rank's parameters) from ``full_named``; a missing or misshapen one is an error."""
        with self.sync.full_parameters(writeback=True):
            self._copy_into_params(full_named, source, names)

    def _copy_into_params(self, full_named: dict[str, torch.Tensor], source: str, names: set[str]) -> None:
        for name, p in self.parts.model.named_parameters():
            if name not in names:
                continue
            if name not in full_named:
                raise CheckpointError(f"{source}: tensor for parameter {name} missing")
            value = full_named[name]
            if tuple(value.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"{source}: {name} has shape {tuple(value.shape)}, this rank needs {tuple(p.shape)}"
                )
            if not value.is_floating_point():  # an integer tensor would be cast silently into the weights
                raise CheckpointError(f"{source}: {name} is {value.dtype}, a parameter must be floating point")
            p.copy_(value.to(p.dtype))  # ZeRO keeps parameters as views of its flat buffer: no refresh

    def load_pretrained(self, hf_dir: str) -> None:
        """Start from a local Hugging Face directory — a Llama, or a LLaVA for a vision-language model (tower,
        projector and decoder) — reading only the slices this rank holds."""
        adapters = self.parts.trainable() if self.parts.lora is not None else set()
        names = {n for n in self.parts.regions if n not in adapters}
        if getattr(self.parts, "vision", None) is not None:
            from kuangchao_core.ckpt.hf_llava import load_hf_llava_weights_for_layout

            regions = {n: r for n, r in self.parts.regions.items() if n in names}
            vision = self.parts.model.vision_config
            weights = load_hf_llava_weights_for_layout(hf_dir, regions, self.model_config, vision, dtype=None)
        else:
            from kuangchao_core.ckpt.hf import load_hf_weights_for_layout

            regions = self.parts.regions if self.model_config.moe is not None else None  # experts sharded over ep
            weights = load_hf_weights_for_layout(hf_dir, self.model_config, self.layout, regions=regions)
        self._copy_params(weights, hf_dir, names)
        log_event(log, "loaded pretrained weights", path=hf_dir, tensors=len(weights))

    def load(self, step_dir: Path) -> dict[str, Any]:
        """Restore params, optimizer and RNG from ``step_dir`` — written in this or any other layout: each rank
        reads only the slices its layout holds. Returns the checkpoint's ``state.json`` (step, losses, sampler).

        A step that verified but does not load (a tensor of the wrong shape or type, an unreadable header) is
        marked bad (:func:`~kuangchao_core.ckpt.integrity.mark_bad`) before the error is raised, so the next
        attempt resumes from the previous intact step instead of failing on this one again."""
        manifest = read_manifest(step_dir)
        mismatch = model_mismatch(manifest, self.model_config) or self._lora_mismatch(manifest)
        if mismatch:  # the job is wrong, not the checkpoint: nothing is marked, the run fails without retries
            raise ConfigError([("checkpoint.resume", f"{step_dir}: {mismatch}")])
        try:
            return self._load(step_dir)
        except (CheckpointError, RuntimeError, ValueError, KeyError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            mark_bad(step_dir, reason)
            log_event(log, "checkpoint marked bad", checkpoint=str(step_dir), reason=reason)
            raise CheckpointError(f"{step_dir} could not be loaded and is marked bad ({reason})") from exc

    def _lora_mismatch(self, manifest: dict[str, Any]) -> str | None:
        """Why a checkpoint's adapters (or full weights) do not fit this job's ``model.lora`` and base; None if
        they do."""
        saved = manifest.get("lora")
        if self.parts.lora is None:
            if saved is not None:
                return "the checkpoint holds LoRA adapters only; set model.lora as it was, or export it merged"
            return None
        if saved is None:
            return (
                "the checkpoint holds a fully trained model, this job trains LoRA adapters; export it "
                "(kc checkpoint convert --format hf) and start from it with model.checkpoint"
            )
        mine = self._lora_meta()
        if saved.get("base", {}).get("sha256") != mine["base"]["sha256"]:
            return (
                f"its adapters were trained on the base {saved.get('base', {}).get('source')} "
                f"(sha256 {str(saved.get('base', {}).get('sha256'))[:12]}), this job's base is "
                f"{mine['base']['source']} (sha256 {mine['base']['sha256'][:12]})"
            )
        for key in ("rank", "targets"):
            if saved.get(key) != mine[key]:
                return f"model.lora.{key} is {mine[key]}, the checkpoint's adapters have {saved.get(key)}"
        return None

    def _load(self, step_dir: Path) -> dict[str, Any]:
        state = read_state(step_dir)
        trainable = self.parts.trainable()
        regions = {n: r for n, r in self.parts.regions.items() if n in trainable}
        params = load_for_layout(step_dir, param_keys(regions))
        self._copy_params({k.removeprefix("param."): v for k, v in params.items()}, str(step_dir), set(regions))
        self.parts.load_extra_state(state)
        steps = int(state.get("optimizer_steps", state["step"]))
        optim = load_optimizer_for_layout(step_dir, regions)
        names = [n for n, _ in self.parts.model.named_parameters() if n in trainable]
        if require_full_state(optim, names, str(step_dir)):
            self.sync.load_state(optim, steps)
        elif steps:
            log.warning("%s holds no optimizer state; AdamW moments start from zero", step_dir)
        self._load_comm_state(step_dir)
        try:
            restore_rng_state(read_rng(step_dir, self.rank))
        except CheckpointError as exc:  # a new layout with more ranks than the old one
            log.warning("no RNG state for rank %d in %s (%s); RNG continues from the seed", self.rank, step_dir, exc)
        log_event(log, "resumed", step=int(state["step"]), checkpoint=str(step_dir))
        return state

    def _load_comm_state(self, step_dir: Path) -> None:
        """Top-k residuals back, when the checkpoint was written by the same layout, placement and compression;
        otherwise the residuals start from zero (they belong to a rank's own shard of the buckets)."""
        if not self.settings.topk_state:  # only top-k keeps state (and only without ZeRO)
            return
        saved = read_manifest(step_dir).get("comm_layout")
        if saved != self._comm_layout():
            log.warning(
                "%s: gradient-compression residuals were saved by another layout; they start from zero", step_dir
            )
            return
        prefix = self._comm_prefix()
        shard = load_shard(step_dir, self.rank)
        self.sync.load_comm_state_tensors({k.removeprefix(prefix): v for k, v in shard.items() if k.startswith(prefix)})
