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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from kuangchao_core.comm import primitives as comm
from kuangchao_core.errors import KuangchaoError
from kuangchao_core.hal import dtypes, memory
from kuangchao_core.parallel import zero_state
from kuangchao_core.parallel.weight_decay import apply_decay
from kuangchao_core.parallel.zero_layout import Slot, named_trainable, owned_sum_of_squares, pieces_of, plan_buckets

_MB = 1024 * 1024


class ZeroOptimizer:
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
        self._build_layout(bucket_cap_mb)
        self._sync_enabled = True
        self._synced = False
        self._next_launch = 0
        self._bucket_bufs: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._ready: list[list[bool]] = [[False] * len(b.slots) for b in self.buckets]
        self.peak_transient_grad_bytes = 0
        self._hooks = []
        if stage == 2:
            for slot in self._slots:
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._shard_params = [
            torch.nn.Parameter(self._param_chunk(i), requires_grad=True) for i in range(len(self.buckets))
        ]
        for sp, g in zip(self._shard_params, self._grad_shards(), strict=True):
            sp.grad = g
        self._no_decay = set(no_decay)
        self.weight_decay = float(weight_decay)
        self.optimizer = torch.optim.AdamW(
            self._shard_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=0.0 if self._no_decay else weight_decay,
            **dtypes.adamw_kernel(self._shard_params),
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
        self.flat_params = memory.pool_zeros(start, self.dtype, self.device, "zero.flat_params", "params")
        self._copy_back: list[Slot] = []
        with torch.no_grad():
            for b in self.buckets:
                for s in b.slots:
                    view = self.flat_params[b.start + s.offset : b.start + s.offset + s.numel]
                    view.copy_(s.param.detach().reshape(-1))
                    if s.param.dtype == self.dtype:
                        s.param.data = view.view_as(s.param)
                    else:
                        self._copy_back.append(s)
        if self.stage == 1:
            self.flat_grads = memory.pool_zeros(start, self.dtype, self.device, "zero.flat_grads", "grads")
            for b in self.buckets:
                for s in b.slots:
                    if s.param.dtype == self.dtype:
                        s.param.grad = self.flat_grads[b.start + s.offset : b.start + s.offset + s.numel].view_as(
                            s.param
                        )
        else:
            self.grad_shard = memory.pool_zeros(start // self.size, self.dtype, self.device, "zero.grad_shard", "grads")

    def _param_chunk(self, b: int) -> torch.Tensor:
        bk = self.buckets[b]
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

    def _pieces(self, rank: int | None = None) -> list[tuple[Slot, int, int, int]]:
        return pieces_of(self.buckets, self.rank if rank is None else rank)

    # ------------------------------------------------------------------ torch.optim-like surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner AdamW's param groups (set ``lr`` here, as for any torch optimizer)."""
        return self.optimizer.param_groups

    def parameter_names(self) -> list[str]:
        """Names of the optimized parameters, in registration order."""
        return [n for n, _ in self._named]

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
            if self.size > 1:
                shards = self._grad_shards()
                for b, bk in enumerate(self.buckets):
                    buf = self.flat_grads[bk.start : bk.start + bk.size]
                    out = shards[b]
                    comm.reduce_scatter(out, buf, group=self.group, op="sum")
                    out.div_(self.size)
        else:
            for b in range(self._next_launch, len(self.buckets)):
                for i, s in enumerate(self.buckets[b].slots):
                    if not self._ready[b][i]:
                        self._take_gradient(b, i, s)
            self._launch_in_order()
        self._synced = True

    def owned_pieces(self) -> list[tuple[Any, int, int, int]]:
        """``(slot, lo, hi, offset)`` of every parameter range this rank owns: elements ``[lo, hi)`` of the flattened
        parameter ``slot.name`` sit at ``offset`` in this rank's shard of bucket ``slot.bucket`` (read by
        :mod:`~kuangchao_core.parallel.zero_state`)."""
        return self._pieces()

    def grad_norm_sq(self, weight: Mapping[str, float]) -> torch.Tensor:
        """This rank's share of the squared global gradient norm: the sum of squares of the averaged gradient
        elements it owns, parameter ``name`` weighted by ``weight[name]`` (float64 scalar; sum it over the DP group
        and any other group of the mesh)."""
        self.finish_gradient_sync()
        return owned_sum_of_squares(self._grad_shards(), self._pieces(), weight)

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
        """AdamW on this rank's chunks, then all-gather every bucket so all replicas hold the same parameters."""
        self.finish_gradient_sync()
        if self._no_decay:
            apply_decay(self._decayed_ranges(), self.optimizer.param_groups[0]["lr"], self.weight_decay)
        self.optimizer.step()
        if self.size > 1:
            for b, bk in enumerate(self.buckets):
                full = self.flat_params[bk.start : bk.start + bk.size]
                chunks = list(full.split(bk.chunk))
                comm.all_gather(chunks, self._param_chunk(b).clone(), group=self.group)
        for s in self._copy_back:
            bk = self.buckets[s.bucket]
            src = self.flat_params[bk.start + s.offset : bk.start + s.offset + s.numel]
            s.param.data.copy_(src.view_as(s.param))
        self._synced = False

    def _decayed_ranges(self) -> list[torch.Tensor]:
        return [
            self._shard_params[s.bucket].data[coff : coff + hi - lo]
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
        if not self._sync_enabled:
            return
        slot = self._slot_of[id(p)]
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
            self._bucket_bufs[b] = memory.pool_zeros(bk.size, self.dtype, self.device, "zero.grad_buckets", "comm")
            held = sum(x.numel() * self._item for x in self._bucket_bufs if x is not None)
            self.peak_transient_grad_bytes = max(self.peak_transient_grad_bytes, held)
        if s.param.grad is not None:
            self._bucket_bufs[b][s.offset : s.offset + s.numel].copy_(s.param.grad.reshape(-1))
            s.param.grad = None
        self._ready[b][i] = True

    def _launch_in_order(self) -> None:
        shards = self._grad_shards()
        while self._next_launch < len(self.buckets) and all(self._ready[self._next_launch]):
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
        if self.size <= 1:
            return
        with torch.no_grad():
            comm.broadcast(self.flat_params, src=self.group.ranks[0], group=self.group)
            for s in self._copy_back:
                bk = self.buckets[s.bucket]
                src = self.flat_params[bk.start + s.offset : bk.start + s.offset + s.numel]
                s.param.data.copy_(src.view_as(s.param))

    def full_parameters(self, writeback: bool = False) -> contextlib.AbstractContextManager[None]:
        """The module's parameters always hold their full values at stages 1 and 2: nothing to gather (the same
        surface as :meth:`Zero3Optimizer.full_parameters`)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ memory
    def state_tensors(self) -> list[torch.Tensor]:
        """The AdamW moments this rank holds (its chunks' ``exp_avg``, ``exp_avg_sq``)."""
        return [v for st in self.optimizer.state.values() for k, v in st.items() if k != "step"]

    def memory_report(self) -> dict[str, Any]:
        """Bytes per rank for parameters, gradients and AdamW state: :func:`~kuangchao_core.parallel.zero_state.memory_report`."""
        return zero_state.memory_report(self)

    @property
    def item_bytes(self) -> int:
        """Bytes per element of the master dtype (4 in fp32, 8 in fp64)."""
        return self._item

    def copied_back_params(self) -> list[Any]:
        """Slots of parameters in another dtype than the master buffer (copied back after each step)."""
        return list(self._copy_back)

    def transient_grad_buffers(self) -> list[torch.Tensor]:
        """Stage 2's bucket buffers alive now (filled by backward, freed after their reduce-scatter)."""
        return [x for x in self._bucket_bufs if x is not None]

    # ------------------------------------------------------------------ checkpoints
    def hyperparameters(self) -> dict[str, Any]:
        """AdamW's settings (lr, betas, eps, weight_decay …) as the wrapped optimizer holds them."""
        return zero_state.adamw_hyperparameters(self.optimizer, self.weight_decay)

    def step_count(self) -> float:
        """Optimizer steps taken (AdamW's ``step``), 0 before the first."""
        return zero_state.adamw_step_count(self.optimizer)

    @property
    def named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The optimised parameters with their names, in registration order."""
        return list(self._named)

    @property
    def shard_params(self) -> list[torch.Tensor]:
        """This rank's chunk of every bucket: the parameters the wrapped AdamW steps."""
        return self._shard_params

    def shard_states(self) -> list[dict[str, torch.Tensor] | None]:
        """AdamW state of this rank's chunk of every bucket (None for a bucket never stepped)."""
        return [self.optimizer.state.get(sp) for sp in self._shard_params]

    def state_dict_for_checkpoint(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, Any]]:
        """This rank's shard of the optimizer state: :func:`~kuangchao_core.parallel.zero_state.sharded_state`."""
        return zero_state.sharded_state(self)

    def full_state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Collective over the DP group: :func:`~kuangchao_core.parallel.zero_state.gather_full_state`."""
        return zero_state.gather_full_state(self)

    def load_full_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Keep this rank's ranges of an unsharded AdamW state: :func:`~kuangchao_core.parallel.zero_state.load_full_state`."""
        zero_state.load_full_state(self, tensors, meta)

    def load_sharded_states(
        self, shards: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, Mapping[str, Any]], Mapping[str, Any]]]
    ) -> None:
        """Rebuild this rank's shard from every rank's :meth:`state_dict_for_checkpoint` of any DP size/stage."""
        tensors, meta = zero_state.merge_shards_to_full(shards)
        self.load_full_state(tensors, meta)


def _master_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """fp64 when every parameter is fp64, else fp32 (the master dtype of fp32 and half-precision parameters)."""
    found = set(dtypes)
    return torch.float64 if found == {torch.float64} else torch.float32
