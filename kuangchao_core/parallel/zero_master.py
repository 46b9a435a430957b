"""ZeRO-1/2 with bf16 parameters and fp32 master weights (``train.param_dtype: bf16``; see
:mod:`~kuangchao_core.parallel.master_weights`).

The layout is :class:`~kuangchao_core.parallel.zero.ZeroOptimizer`'s (buckets cut at ``bucket_cap_mb`` of fp32,
chunk ``r`` of every bucket owned by DP rank ``r``), with other buffers behind it. Per rank (Ψ trainable elements,
N = DP size):

- ``flat_params``: the bf16 parameters, which the model's parameters view (2Ψ);
- ``master``: this rank's fp32 chunk of every bucket, the parameters the wrapped AdamW steps (4Ψ/N), and its
  fp32 moments (8Ψ/N);
- gradients in fp32 from the first backward on, so the micro-batches of a step (``grad_accum`` > 1, every
  pipeline schedule, whose backwards all run under ``no_sync``) are summed in fp32, never in bf16 (Megatron-Core's
  ``main_grad``): each parameter's post-accumulate-grad hook adds its bf16 gradient into an fp32 slot
  (:func:`~kuangchao_core.parallel.data.accumulate_grad`) and drops ``param.grad``.

  - Stage 1: the slots are a full fp32 gradient buffer ``flat_grads`` (4Ψ, in the layout of ``flat_params``);
    :meth:`finish_gradient_sync` reduce-scatters each bucket of it in place, so this rank's averaged gradient
    chunk is a view of the buffer (no second chunk, no transient copy). Per parameter 2 + 4 + 12/N bytes, as
    Megatron-Core's distributed optimizer.
  - Stage 2, DeepSpeed's way: the slots are transient fp32 buckets; a bucket whose every parameter has a
    gradient is reduce-scattered (in bucket order, on every rank alike) and its sum *added* into this rank's fp32
    gradient shard ``grad_shard`` (4Ψ/N), then freed — for every micro-batch, under ``no_sync`` too; the shard is
    divided by N once, when the step's reduction finishes. ZeRO-2's memory (4Ψ/N plus the buckets in flight)
    is kept at the price of a reduce-scatter per micro-batch: ``grad_accum`` (or a pipeline's micro-batches)
    times a stage-1 step's gradient traffic. The alternative, a full fp32 buffer reduced once, is stage 1's 4Ψ:
    at N = 8 it would hold 4Ψ where this holds Ψ/2, for the ZeRO-2 memory a user asked for; who prefers fewer
    bytes on the wire with accumulation runs stage 1. A bucket that misses a gradient in one backward (a chunk
    of an interleaved pipeline) waits, accumulating, for the next; :meth:`finish_gradient_sync` flushes what is
    left. With ``grad_reduce_dtype`` bf16 a bucket travels as a bf16 copy and its sum is widened into the shard.

After AdamW's step each rank rounds its master chunk to bf16 and the bf16 chunks are all-gathered (half of an fp32
run's bytes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kuangchao_core.comm import primitives as comm
from kuangchao_core.hal.memory import pool_zeros
from kuangchao_core.parallel import data
from kuangchao_core.parallel.state_memory import zero_formula
from kuangchao_core.parallel.weight_decay import apply_decay
from kuangchao_core.parallel.zero import _MB, ZeroOptimizer
from kuangchao_core.parallel.zero_layout import plan_buckets
from kuangchao_core.parallel.zero_state import STATE_KEYS

PARAM_DTYPE = torch.bfloat16


class MasterZeroOptimizer(ZeroOptimizer):
    """:class:`ZeroOptimizer` over fp32 master chunks of bf16 parameters (module docstring). Built while the
    parameters are still fp32 (their values become the masters, broadcast from the group's first rank); the
    trainable parameters are bf16 views of ``flat_params`` afterwards. ``reduce_dtype``: what buckets are summed
    in (fp32; bf16 for ``parallel.grad_reduce_dtype: bf16``, then widened into the fp32 chunk)."""

    reduce_dtype = torch.float32

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.stage == 1:  # ZeroOptimizer hooks stage 2 only
            self._hooks += [s.param.register_post_accumulate_grad_hook(self._on_grad_ready) for s in self._slots]

    def _build_layout(self, bucket_cap_mb: float) -> None:
        cap = max(1, int(bucket_cap_mb * _MB) // self._item)
        self.buckets, self._slots = plan_buckets(self._named, cap, self.size)
        start = sum(b.size for b in self.buckets)
        self._slot_of = {id(s.param): s for s in self._slots}
        self.numel = sum(s.numel for s in self._slots)
        self.padded_numel = start
        self.flat_params = pool_zeros(start, PARAM_DTYPE, self.device, "zero.flat_params", "params")
        self.master = pool_zeros(start // self.size, self.dtype, self.device, "zero.master_params", "optim")
        self._master_offsets = []
        self._copy_back = []
        off = 0
        with torch.no_grad():
            for b in self.buckets:
                full = torch.zeros(b.size, dtype=self.dtype, device=self.device)
                for s in b.slots:
                    full[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
                if self.size > 1:  # every replica starts from the first one's masters
                    comm.broadcast(full, src=self.group.ranks[0], group=self.group)
                self.master[off : off + b.chunk].copy_(full[self.rank * b.chunk : (self.rank + 1) * b.chunk])
                self._master_offsets.append(off)
                off += b.chunk
                self.flat_params[b.start : b.start + b.size].copy_(full)
                for s in b.slots:
                    view = self.flat_params[b.start + s.offset : b.start + s.offset + s.numel]
                    s.param.data = view.view_as(s.param)
        if self.stage == 1:  # the fp32 main gradients; this rank's chunks of them are its gradient shard
            self.flat_grads = pool_zeros(start, self.dtype, self.device, "zero.flat_grads", "grads")
            self.grad_shard = None
        else:
            self.grad_shard = pool_zeros(start // self.size, self.dtype, self.device, "zero.grad_shard", "grads")

    def _param_chunk(self, b: int) -> torch.Tensor:
        """This rank's fp32 master chunk of bucket ``b`` (what AdamW steps)."""
        return self.master[self._master_offsets[b] : self._master_offsets[b] + self.buckets[b].chunk]

    def _grad_shards(self) -> list[torch.Tensor]:
        if self.stage == 1:
            return [self.flat_grads[bk.start + self.rank * bk.chunk :][: bk.chunk] for bk in self.buckets]
        return [
            self.grad_shard[off : off + bk.chunk] for off, bk in zip(self._master_offsets, self.buckets, strict=True)
        ]

    def _broadcast_params(self) -> None:
        """Done in :meth:`_build_layout` (the fp32 values, before the masters are cut)."""

    def finish_gradient_sync(self) -> None:
        """Stage 1: reduce-scatter every bucket of the fp32 gradient buffer in place (averaged); stage 2: the
        buckets still holding gradients reduce-scattered into the shard (in bucket order), then the shard averaged."""
        if self._synced:
            return
        if self.stage == 1:
            for bk, out in zip(self.buckets, self._grad_shards(), strict=True):
                self._reduce_into(out, self.flat_grads[bk.start : bk.start + bk.size])
                if self.size > 1:
                    out.div_(self.size)
        else:
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
        self._synced = True

    def _reduce_into(self, out: torch.Tensor, buf: torch.Tensor, add: bool = False) -> None:
        """This rank's chunk of the sum of fp32 ``buf`` over the group (summed in ``reduce_dtype``), written into
        ``out`` (which may be ``buf``'s own chunk) or, with ``add``, added to it."""
        if self.size == 1:
            if add:
                data.accumulate_grad(out, buf)
            elif out.data_ptr() != buf.data_ptr():
                out.copy_(buf)
            return
        wire = buf if buf.dtype == self.reduce_dtype else buf.to(self.reduce_dtype)
        if wire is not buf:  # a copy: alive while its bucket is reduced
            self.peak_transient_grad_bytes = max(self.peak_transient_grad_bytes, wire.numel() * wire.element_size())
        mine = out if wire.dtype == out.dtype and not add else torch.empty_like(out, dtype=wire.dtype)
        comm.reduce_scatter(mine, wire, group=self.group, op="sum")
        if add:
            data.accumulate_grad(out, mine)
        elif mine is not out:
            out.copy_(mine)

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        """Every backward, under ``no_sync`` too: the bf16 gradient added into its fp32 slot and dropped; at stage 2
        the buckets complete in bucket order are reduce-scattered into the shard."""
        slot = self._slot_of[id(p)]
        if self.stage == 1:
            bk = self.buckets[slot.bucket]
            data.accumulate_grad(self.flat_grads[bk.start + slot.offset :][: slot.numel], p.grad)
            p.grad = None
            return
        self._take_gradient(slot.bucket, slot.index, slot)
        self._launch_in_order()

    def _take_gradient(self, b: int, i: int, s: Any) -> None:
        """Stage 2: ``s``'s gradient added into its slot of bucket ``b`` (an fp32 buffer made when the bucket's
        first gradient comes), ``param.grad`` dropped."""
        bk = self.buckets[b]
        if self._bucket_bufs[b] is None:
            self._bucket_bufs[b] = pool_zeros(bk.size, self.dtype, self.device, "zero.grad_buckets", "comm")
            held = sum(x.numel() * x.element_size() for x in self._bucket_bufs if x is not None)
            self.peak_transient_grad_bytes = max(self.peak_transient_grad_bytes, held)
        if s.param.grad is not None:
            data.accumulate_grad(self._bucket_bufs[b][s.offset : s.offset + s.numel], s.param.grad)
            s.param.grad = None
        self._ready[b][i] = True

    def _launch_in_order(self) -> None:
        """Stage 2: from the next bucket due, each bucket whose every parameter has a gradient is reduce-scattered
        and added into the shard, then freed; after the last bucket the round starts again at the first."""
        shards = self._grad_shards()
        while all(self._ready[self._next_launch]):
            b = self._next_launch
            self._reduce_into(shards[b], self._bucket_bufs[b], add=True)
            self._bucket_bufs[b] = None
            self._ready[b] = [False] * len(self._ready[b])
            self._next_launch = (b + 1) % len(self.buckets)

    def zero_grad(self) -> None:
        """As :class:`ZeroOptimizer` (the reductions here are synchronous: none is ever half done)."""
        self._next_launch = 0
        super().zero_grad()

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's fp32 master chunks, then the chunks rounded to bf16 and all-gathered."""
        self.finish_gradient_sync()
        if self._no_decay:
            apply_decay(self._decayed_ranges(), self.optimizer.param_groups[0]["lr"], self.weight_decay)
        self.optimizer.step()
        self._publish()
        self._synced = False

    def _publish(self) -> None:
        """Every bucket's bf16 parameters from the ranks' master chunks (rounded, all-gathered in bf16)."""
        for b, bk in enumerate(self.buckets):
            full = self.flat_params[bk.start : bk.start + bk.size]
            mine = self._param_chunk(b).to(PARAM_DTYPE)
            if self.size > 1:
                comm.all_gather(list(full.split(bk.chunk)), mine, group=self.group)
            else:
                full.copy_(mine)

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[None]:
        """Collective: inside the block the trainable parameters hold the full fp32 masters (gathered; what
        checkpoints save and load); with ``writeback`` each rank keeps its chunk of what was written, rounded into
        the bf16 parameters."""
        fulls = []
        with torch.no_grad():
            for b, bk in enumerate(self.buckets):
                full = torch.empty(bk.size, dtype=self.dtype, device=self.device)
                if self.size > 1:
                    comm.all_gather(list(full.split(bk.chunk)), self._param_chunk(b).clone(), group=self.group)
                else:
                    full.copy_(self._param_chunk(b))
                fulls.append(full)
                for s in bk.slots:
                    s.param.data = full[s.offset : s.offset + s.numel].view_as(s.param)
        try:
            yield
        finally:
            with torch.no_grad():
                for b, bk in enumerate(self.buckets):
                    if writeback:
                        self._param_chunk(b).copy_(fulls[b][self.rank * bk.chunk : (self.rank + 1) * bk.chunk])
                        self.flat_params[bk.start : bk.start + bk.size].copy_(fulls[b])
                    for s in bk.slots:
                        view = self.flat_params[bk.start + s.offset : bk.start + s.offset + s.numel]
                        s.param.data = view.view_as(s.param)

    def memory_report(self) -> dict[str, Any]:
        """Bytes per rank: the bf16 parameters; the fp32 gradient buffer (stage 1) or chunk and any fp32 bucket
        alive (stage 2), any bf16 gradient a parameter holds; the fp32 moments and masters as ``optimizer_state`` — beside
        :func:`~kuangchao_core.parallel.state_memory.zero_formula` for bf16 parameters."""
        params = self.flat_params.numel() * self.flat_params.element_size()
        held = self.flat_grads if self.stage == 1 else self.grad_shard
        grads = held.numel() * held.element_size() + sum(
            x.numel() * x.element_size() for x in self.transient_grad_buffers()
        )
        grads += sum(p.grad.numel() * p.grad.element_size() for _, p in self._named if p.grad is not None)
        moments = sum(
            st[k].numel() * st[k].element_size() for st in self.optimizer.state.values() for k in STATE_KEYS if k in st
        )
        optim = moments + self.master.numel() * self._item
        return {
            "stage": self.stage,
            "dp_size": self.size,
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "num_buckets": len(self.buckets),
            "measured": {"params": params, "grads": grads, "optimizer_state": optim, "total": params + grads + optim},
            "formula": zero_formula(self.numel, self.size, self.stage, "bf16", "bf16"),
            "peak_transient_grad_bytes": self.peak_transient_grad_bytes,
        }
