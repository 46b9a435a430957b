"""ZeRO optimizer-state sharding across the data-parallel group (SPEC L3.5), AdamW in fp32 (fp64 for fp64 models).

Layout (planned in :mod:`kuangchao_core.parallel.zero_layout`). Trainable parameters are laid out in *reverse registration order* (roughly the order backward produces
their gradients) and cut into buckets of at most ``bucket_cap_mb``. Each bucket is padded to a multiple of the DP
size ``N``; bucket ``b`` is split into ``N`` equal chunks and DP rank ``r`` owns chunk ``r`` of every bucket. All
buckets live in one contiguous buffer of the master dtype (fp32, or fp64 when every parameter is fp64) and every
parameter of that dtype becomes a view into it (no second copy).

Per rank this keeps (Ψ = trainable elements, fp32): parameters 4Ψ (replicated), AdamW ``exp_avg`` +
``exp_avg_sq`` 8Ψ/N, gradients 4Ψ at stage 1 (a flat buffer that ``param.grad`` views) or 4Ψ/N at stage 2.

- **Stage 1**: backward accumulates into the flat gradient buffer; :meth:`ZeroOptimizer.finish_gradient_sync`
  reduce-scatters every bucket (sum, then divide by N), so each rank holds its chunk's averaged gradient.
- **Stage 2**: a post-accumulate-grad hook copies each parameter's gradient into a transient bucket buffer and
  drops ``param.grad``; when a bucket is complete (buckets launch in order, so every rank issues the same
  collectives) it is reduce-scattered straight into this rank's persistent gradient shard and freed.
- Gradient accumulation: micro-steps inside ``with opt.no_sync():`` accumulate locally, no communication; the last
  micro-step's backward communicates. Scale each micro-step's loss by ``1 / grad_accum``.
- :meth:`step` runs ``torch.optim.AdamW`` (``hal.dtypes.adamw_kernel``: fused on CUDA, foreach elsewhere) on this
  rank's chunks, then all-gathers every bucket so all replicas hold equal parameters again.

Typical step::

    opt = ZeroOptimizer(model.named_parameters(), dp_group, stage=2, lr=1e-3)
    for i, (x, y) in enumerate(micro_batches):
        with opt.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss_fn(model(x), y) / len(micro_batches)).backward()
    total_norm = opt.clip_grad_norm(1.0)
    opt.step()
    opt.zero_grad()

Checkpoints of the sharded state (this rank's pieces, the gathered full state, loading either, offline merge) are
in :mod:`kuangchao_core.parallel.zero_state`; the optimizer's methods of the same names call it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kuangchao_core.comm import primitives as comm
from kuangchao_core.errors import KuangchaoError
from kuangchao_core.hal.dtypes import adamw_kernel
from kuangchao_core.hal.memory import pool_zeros
from kuangchao_core.parallel import data, zero_state
from kuangchao_core.parallel.bucket_reduce import reduce_scatter_sum
from kuangchao_core.parallel.precision_policy import PrecisionPolicy
from kuangchao_core.parallel.weight_decay import apply_decay
from kuangchao_core.parallel.zero_layout import Slot, named_trainable, plan_buckets

_MB = 1024 * 1024


class ZeroOptimizer(zero_state.ShardedState):
    """AdamW whose state (stage 1) and gradients (stage 2) are sharded across ``dp_group``.

    Args:
        params: ``model.named_parameters()`` (names are used by checkpoints) or plain parameters (named
            ``param_<i>``). Parameters not requiring a gradient are ignored.
        dp_group: the data-parallel ``CommGroup``; every member constructs the optimizer with the same model.
        stage: 1 (optimizer state sharded) or 2 (gradients sharded too).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (the same update code,
            :func:`~kuangchao_core.hal.dtypes.adamw_kernel`).
        bucket_cap_mb: upper bound of one bucket in MiB (the unit of reduce-scatter and all-gather).
        no_decay: names of parameters without weight decay (:mod:`~kuangchao_core.parallel.weight_decay`); the
            decay of the others is then applied to their ranges of the shard before AdamW's update.
        policy: with master weights (``train.param_dtype: bf16``) the module's parameters become ``param_dtype``
            views of ``flat_params`` and AdamW steps ``master``, this rank's fp32 chunk of every bucket; gradients
            are fp32 from the first backward on (each parameter's hook adds its gradient into an fp32 slot and
            drops ``param.grad``, under ``no_sync`` too: stage 1 into the full buffer ``flat_grads``, reduced in
            place; stage 2 into transient buckets reduce-scattered and *added* into the shard every micro-batch,
            DeepSpeed's way, then averaged once), summed over DP in ``reduce_dtype``; after AdamW each rank rounds
            its chunk and the rounded chunks are all-gathered. Built while the parameters are still fp32.

    Parameters are broadcast from the group's first rank at construction so that all replicas start equal.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]],
        dp_group,
        stage: int = 1,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        bucket_cap_mb: float = 25,
        no_decay: Iterable[str] = (),
        policy: PrecisionPolicy = PrecisionPolicy(),
    ):
        if stage not in (1, 2):
            raise KuangchaoError(f"ZeroOptimizer: stage must be 1 or 2, got {stage}; set parallel.zero_stage to 1 or 2")
        if bucket_cap_mb <= 0:
            raise KuangchaoError(f"ZeroOptimizer: bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if dp_group.rank is None:
            raise KuangchaoError(
                f"ZeroOptimizer: this process (global rank {dp_group.global_rank}) is not in {dp_group}"
            )
        self.group = dp_group
        self.stage = stage
        self.size = dp_group.size
        self.rank = dp_group.rank
        self._named = named_trainable(params)
        devices = {p.device for _, p in self._named}
        if len(devices) != 1:
            raise KuangchaoError(f"ZeroOptimizer: parameters live on several devices {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.dtype = _master_dtype(p.dtype for _, p in self._named)
        self._item = torch.empty((), dtype=self.dtype).element_size()
        self.policy = policy
        self.reduce_dtype = policy.reduce_dtype or self.dtype
        self.master: torch.Tensor | None = None
        self._build_layout(bucket_cap_mb)
        self._sync_enabled = True
        self._synced = False
        self._next_launch = 0
        self._bucket_bufs: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._ready: list[list[bool]] = [[False] * len(b.slots) for b in self.buckets]
        self.peak_transient_grad_bytes = 0
        self._hooks = []
        if stage == 2 or policy.masters:
            for slot in self._slots:
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._on_grad_ready))
        self.shard_params = [
            torch.nn.Parameter(self._param_chunk(i), requires_grad=True) for i in range(len(self.buckets))
        ]
        for sp, g in zip(self.shard_params, self._grad_shards(), strict=True):
            sp.grad = g
        self._no_decay = set(no_decay)
        self.weight_decay = float(weight_decay)
        self.optimizer = torch.optim.AdamW(
            self.shard_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=0.0 if self._no_decay else weight_decay,
            **adamw_kernel(self.shard_params),
        )
        self._broadcast_params()

    # ------------------------------------------------------------------ layout
    def _build_layout(self, bucket_cap_mb: float) -> None:
        cap = max(1, int(bucket_cap_mb * _MB) // self._item)
        self.buckets, self._slots = plan_buckets(self._named, cap, self.size)
        start = sum(b.size for b in self.buckets)
        self._slot_of = {id(s.param): s for s in self._slots}
        self.numel = sum(s.numel for s in self._slots)
        self.padded_numel = start
        masters, param_dtype = self.policy.masters, self.policy.param_dtype or self.dtype
        self.flat_params = pool_zeros(start, param_dtype, self.device, "zero.flat_params", "params")
        if masters:
            self.master = pool_zeros(start // self.size, self.dtype, self.device, "zero.master_params", "optim")
        self._copy_back: list[Slot] = []
        with torch.no_grad():
            for b in self.buckets:
                if masters:  # every replica's masters are the first one's fp32 values
                    full = torch.zeros(b.size, dtype=self.dtype, device=self.device)
                    for s in b.slots:
                        full[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
                    if self.size > 1:
                        comm.broadcast(full, src=self.group.ranks[0], group=self.group)
                    self.master[b.start // self.size :][: b.chunk].copy_(full[self.rank * b.chunk :][: b.chunk])
                    self.flat_params[b.start : b.start + b.size].copy_(full)
                for s in b.slots:
                    view = self.flat_params[b.start + s.offset : b.start + s.offset + s.numel]
                    if not masters:
                        view.copy_(s.param.detach().reshape(-1))
                    if masters or s.param.dtype == self.dtype:
                        s.param.data = view.view_as(s.param)
                    else:
                        self._copy_back.append(s)
        if self.stage == 1:
            self.flat_grads = pool_zeros(start, self.dtype, self.device, "zero.flat_grads", "grads")
            for b in self.buckets:
                for s in b.slots:
                    if not masters and s.param.dtype == self.dtype:  # masters: added in by the hooks
                        at = b.start + s.offset
                        s.param.grad = self.flat_grads[at : at + s.numel].view_as(s.param)
        else:
            self.grad_shard = pool_zeros(start // self.size, self.dtype, self.device, "zero.grad_shard", "grads")

    def _param_chunk(self, b: int) -> torch.Tensor:
        """This rank's chunk of bucket ``b`` that AdamW steps (its fp32 master chunk under a master policy)."""
        bk = self.buckets[b]
        if self.master is not None:
            return self.master[bk.start // self.size :][: bk.chunk]
        lo = bk.start + self.rank * bk.chunk
        return self.flat_params[lo : lo + bk.chunk]

    def _grad_shards(self) -> list[torch.Tensor]:
        out = []
        shard_off = 0
        for bk in self.buckets:
            if self.stage == 1:
                lo = bk.start + self.rank * bk.chunk
                out.append(self.flat_grads[lo : lo + bk.chunk])
            else:
                out.append(self.grad_shard[shard_off : shard_off + bk.chunk])
            shard_off += bk.chunk
        return out

    # ------------------------------------------------------------------ torch.optim-like surface
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this block backward accumulates gradients locally and communicates nothing."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_gradient_sync(self) -> None:
        """Reduce-scatter (average) the gradients still to be reduced; afterwards this rank's gradient shard is final.

        Called by :meth:`clip_grad_norm` and :meth:`step` if not yet done; call it once per optimizer step after
        the last micro-step's backward. At stage 1, ``param.grad`` outside this rank's chunks is not averaged.
        """
        if self._synced:
            return
        if self.stage == 1:
            for s in self._copy_back:
                bk = self.buckets[s.bucket]
                dst = self.flat_grads[bk.start + s.offset : bk.start + s.offset + s.numel]
                if s.param.grad is None:
                    dst.zero_()
                else:
                    dst.copy_(s.param.grad.reshape(-1))
            for bk, out in zip(self.buckets, self._grad_shards(), strict=True):
                self._reduce_into(out, self.flat_grads[bk.start : bk.start + bk.size])
                if self.size > 1:
                    out.div_(self.size)
        elif self.master is not None:
            for _ in range(len(self.buckets)):  # from the next bucket due, round to it again
                b = self._next_launch
                if self._bucket_bufs[b] is not None:
                    self._ready[b] = [True] * len(self._ready[b])
                    self._launch_in_order()
                else:
                    self._next_launch = (b + 1) % len(self.buckets)
            self._next_launch = 0
            if self.size > 1:
                self.grad_shard.div_(self.size)
        else:
            for b in range(self._next_launch, len(self.buckets)):
                for i, s in enumerate(self.buckets[b].slots):
                    if not self._ready[b][i]:
                        self._take_gradient(b, i, s)
            self._launch_in_order()
        self._synced = True

    def _reduce_into(self, out: torch.Tensor, buf: torch.Tensor, add: bool = False) -> None:
        copied = reduce_scatter_sum(out, buf, self.group, self.reduce_dtype, data.accumulate_grad if add else None)
        self.peak_transient_grad_bytes = max(self.peak_transient_grad_bytes, copied)

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's averaged gradient shards (valid after :meth:`finish_gradient_sync`), one per bucket."""
        return list(self._grad_shards())

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale the gradient shards so that the global L2 norm is at most ``max_norm``; returns the norm before.

        The norm is computed from the shards (sum of squares, all-reduced over the DP group), so it equals
        ``torch.nn.utils.clip_grad_norm_`` on the full averaged gradient.
        """
        self.finish_gradient_sync()
        sq = torch.zeros((), dtype=self.dtype, device=self.device)
        for g in self._grad_shards():
            sq += g.pow(2).sum()
        if self.size > 1:
            comm.all_reduce(sq, group=self.group, op="sum")
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in self._grad_shards():
            g.mul_(coef)
        return total

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's chunks, then all-gather every bucket so all replicas hold the same parameters
        (master chunks are rounded to ``param_dtype`` first, and the rounded chunks gathered)."""
        self.finish_gradient_sync()
        if self._no_decay:
            apply_decay(self._decayed_ranges(), self.optimizer.param_groups[0]["lr"], self.weight_decay)
        self.optimizer.step()
        for b, bk in enumerate(self.buckets):
            full = self.flat_params[bk.start : bk.start + bk.size]
            if self.size > 1:
                mine = self._param_chunk(b).to(full.dtype, copy=True)
                comm.all_gather(list(full.split(bk.chunk)), mine, group=self.group)
            elif self.master is not None:
                full.copy_(self._param_chunk(b))
        for s in self._copy_back:
            bk = self.buckets[s.bucket]
            src = self.flat_params[bk.start + s.offset : bk.start + s.offset + s.numel]
            s.param.data.copy_(src.view_as(s.param))
        self._synced = False

    def _decayed_ranges(self) -> list[torch.Tensor]:
        return [
            self.shard_params[s.bucket].data[coff : coff + hi - lo]
            for s, lo, hi, coff in self._pieces()
            if s.name not in self._no_decay
        ]

    def set_weight_decay(self, value: float) -> None:
        """Change the decoupled weight decay (of the decayed parameters)."""
        self.weight_decay = float(value)
        if not self._no_decay:
            self.optimizer.param_groups[0]["weight_decay"] = self.weight_decay

    def zero_grad(self) -> None:
        """Zero the gradients (stage 1: the flat buffer; stage 2: the shard, and ``param.grad`` is dropped)."""
        if self.master is not None:  # its reductions are synchronous: none is ever half done
            self._next_launch = 0
        if self._next_launch not in (0, len(self.buckets)):
            raise KuangchaoError("ZeroOptimizer.zero_grad: a gradient sync is half done; call step() first")
        self._next_launch = 0
        self._synced = False
        self._ready = [[False] * len(b.slots) for b in self.buckets]
        if self.stage == 1:
            self.flat_grads.zero_()
            for s in self._copy_back:
                s.param.grad = None
        else:
            self.grad_shard.zero_()
            self._bucket_bufs = [None] * len(self.buckets)
            for s in self._slots:
                s.param.grad = None

    def remove_hooks(self) -> None:
        """Detach the stage-2 gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ stage 2 internals
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        slot = self._slot_of[id(p)]
        if self.master is not None:  # every backward, under no_sync too: into fp32 (module docstring)
            if self.stage == 1:
                bk = self.buckets[slot.bucket]
                data.accumulate_grad(self.flat_grads[bk.start + slot.offset :][: slot.numel], p.grad)
                p.grad = None
            else:
                self._take_gradient(slot.bucket, slot.index, slot)
                self._launch_in_order()
            return
        if not self._sync_enabled:
            return
        b, i = slot.bucket, slot.index
        if self._ready[b][i] or b < self._next_launch:
            raise KuangchaoError(
                f"ZeroOptimizer on group {self.group.name!r}: gradient of {slot.name} became ready twice in one "
                "synchronized step; run all but the last micro-step inside opt.no_sync() and call step()/zero_grad() "
                "between optimizer steps"
            )
        self._take_gradient(b, i, slot)
        self._launch_in_order()

    def _take_gradient(self, b: int, i: int, s: Slot) -> None:
        bk = self.buckets[b]
        if self._bucket_bufs[b] is None:
            self._bucket_bufs[b] = pool_zeros(bk.size, self.dtype, self.device, "zero.grad_buckets", "comm")
            held = sum(x.numel() * self._item for x in self._bucket_bufs if x is not None)
            self.peak_transient_grad_bytes = max(self.peak_transient_grad_bytes, held)
        if s.param.grad is not None:
            dst = self._bucket_bufs[b][s.offset : s.offset + s.numel]
            if self.master is not None:
                data.accumulate_grad(dst, s.param.grad)
            else:
                dst.copy_(s.param.grad.reshape(-1))
            s.param.grad = None
        self._ready[b][i] = True

    def _launch_in_order(self) -> None:
        shards = self._grad_shards()
        while self.master is not None and all(self._ready[self._next_launch]):  # added in; round and round
            b = self._next_launch
            self._reduce_into(shards[b], self._bucket_bufs[b], add=True)
            self._bucket_bufs[b] = None
            self._ready[b] = [False] * len(self._ready[b])
            self._next_launch = (b + 1) % len(self.buckets)
        while self.master is None and self._next_launch < len(self.buckets) and all(self._ready[self._next_launch]):
            b = self._next_launch
            buf = self._bucket_bufs[b]
            if self.size > 1:
                comm.reduce_scatter(shards[b], buf, group=self.group, op="sum")
                shards[b].div_(self.size)
            else:
                shards[b].copy_(buf)
            self._bucket_bufs[b] = None
            self._next_launch += 1

    def _broadcast_params(self) -> None:
        if self.size <= 1 or self.master is not None:  # masters: broadcast in _build_layout
            return
        with torch.no_grad():
            comm.broadcast(self.flat_params, src=self.group.ranks[0], group=self.group)
            for s in self._copy_back:
                bk = self.buckets[s.bucket]
                src = self.flat_params[bk.start + s.offset : bk.start + s.offset + s.numel]
                s.param.data.copy_(src.view_as(s.param))

    def full_parameters(self, writeback: bool = False) -> contextlib.AbstractContextManager[None]:
        """The module's parameters always hold their full values at stages 1 and 2: nothing to gather (the same
        surface as :meth:`Zero3Optimizer.full_parameters`), except under masters: :func:`zero_state.full_masters`."""
        return contextlib.nullcontext() if self.master is None else zero_state.full_masters(self, writeback)

    # ------------------------------------------------------------------ memory
    def memory_report(self) -> dict[str, Any]:
        """Bytes per rank for parameters, gradients and AdamW state: :func:`~kuangchao_core.parallel.zero_state.memory_report`."""
        return zero_state.memory_report(self)

    def copied_back_params(self) -> list[Any]:
        """Slots of parameters in another dtype than the master buffer (copied back after each step)."""
        return list(self._copy_back)

    def transient_grad_buffers(self) -> list[torch.Tensor]:
        """Stage 2's bucket buffers alive now (filled by backward, freed after their reduce-scatter)."""
        return [x for x in self._bucket_bufs if x is not None]

    @property
    def named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The optimised parameters with their names, in registration order."""
        return list(self._named)


def _master_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """fp64 when every parameter is fp64, else fp32 (the master dtype of fp32 and half-precision parameters)."""
    found = set(dtypes)
    return torch.float64 if found == {torch.float64} else torch.float32
