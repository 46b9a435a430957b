"""ZeRO-1/2 with bf16 parameters and fp32 master weights (``train.param_dtype: bf16``; see
:mod:`~kuangchao_core.parallel.master_weights`).

The layout is :class:`~kuangchao_core.parallel.zero.ZeroOptimizer`'s (buckets cut at ``bucket_cap_mb`` of fp32,
chunk ``r`` of every bucket owned by DP rank ``r``), with other buffers behind it. Per rank (Ψ trainable elements,
N = DP size):

- ``flat_params``: the bf16 parameters, which the model's parameters view (2Ψ);
- ``master``: this rank's fp32 chunk of every bucket, the parameters the wrapped AdamW steps (4Ψ/N), and its
  fp32 moments (8Ψ/N);
- ``grad_shard``: this rank's fp32 averaged gradient chunk (4Ψ/N). Stage 1 keeps the bf16 gradients in a flat
  buffer that ``param.grad`` views (2Ψ) and reduce-scatters each bucket from an fp32 copy made for it (one bucket
  alive at a time); stage 2 copies each bf16 gradient into an fp32 bucket as backward produces it, as ZeRO-2 does.

After AdamW's step each rank rounds its master chunk to bf16 and the bf16 chunks are all-gathered (half of an fp32
run's bytes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kuangchao_core.comm import primitives as comm
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

    def _build_layout(self, bucket_cap_mb: float) -> None:
        cap = max(1, int(bucket_cap_mb * _MB) // self._item)
        self.buckets, self._slots = plan_buckets(self._named, cap, self.size)
        start = sum(b.size for b in self.buckets)
        self._slot_of = {id(s.param): s for s in self._slots}
        self.numel = sum(s.numel for s in self._slots)
        self.padded_numel = start
        self.flat_params = torch.zeros(start, dtype=PARAM_DTYPE, device=self.device)
        self.master = torch.zeros(start // self.size, dtype=self.dtype, device=self.device)
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
        if self.stage == 1:
            self.flat_grads = torch.zeros(start, dtype=PARAM_DTYPE, device=self.device)
            for b in self.buckets:
                for s in b.slots:
                    s.param.grad = self.flat_grads[b.start + s.offset : b.start + s.offset + s.numel].view_as(s.param)
        self.grad_shard = torch.zeros(start // self.size, dtype=self.dtype, device=self.device)

    def _param_chunk(self, b: int) -> torch.Tensor:
        """This rank's fp32 master chunk of bucket ``b`` (what AdamW steps)."""
        return self.master[self._master_offsets[b] : self._master_offsets[b] + self.buckets[b].chunk]

    def _grad_shards(self) -> list[torch.Tensor]:
        return [
            self.grad_shard[off : off + bk.chunk] for off, bk in zip(self._master_offsets, self.buckets, strict=True)
        ]

    def _broadcast_params(self) -> None:
        """Done in :meth:`_build_layout` (the fp32 values, before the masters are cut)."""

    def finish_gradient_sync(self) -> None:
        """Stage 1: reduce-scatter every bucket of bf16 gradients from an fp32 copy (averaged) into this rank's fp32
        gradient chunk; stage 2 as :class:`ZeroOptimizer`."""
        if self._synced or self.stage != 1:
            return super().finish_gradient_sync()
        for bk, out in zip(self.buckets, self._grad_shards(), strict=True):
            buf = self.flat_grads[bk.start : bk.start + bk.size].to(self.reduce_dtype)
            if buf.dtype != PARAM_DTYPE:  # a copy: alive while its bucket is reduced
                self.peak_transient_grad_bytes = max(self.peak_transient_grad_bytes, buf.numel() * buf.element_size())
            self._reduce_into(out, buf)
        self._synced = True

    def _reduce_into(self, out: torch.Tensor, buf: torch.Tensor) -> None:
        """This rank's chunk of the sum of ``buf`` over the group (in ``buf``'s dtype), averaged into ``out``."""
        if self.size == 1:
            out.copy_(buf)
            return
        mine = out if buf.dtype == out.dtype else torch.empty(out.numel(), dtype=buf.dtype, device=out.device)
        comm.reduce_scatter(mine, buf, group=self.group, op="sum")
        if mine is not out:
            out.copy_(mine)
        out.div_(self.size)

    def _take_gradient(self, b: int, i: int, s: Any) -> None:
        """Stage 2: as :class:`ZeroOptimizer`, into a bucket of ``reduce_dtype``."""
        bk = self.buckets[b]
        if self._bucket_bufs[b] is None:
            self._bucket_bufs[b] = torch.zeros(bk.size, dtype=self.reduce_dtype, device=self.device)
            held = sum(x.numel() * x.element_size() for x in self._bucket_bufs if x is not None)
            self.peak_transient_grad_bytes = max(self.peak_transient_grad_bytes, held)
        if s.param.grad is not None:
            self._bucket_bufs[b][s.offset : s.offset + s.numel].copy_(s.param.grad.reshape(-1))
            s.param.grad = None
        self._ready[b][i] = True

    def _launch_in_order(self) -> None:
        shards = self._grad_shards()
        while self._next_launch < len(self.buckets) and all(self._ready[self._next_launch]):
            b = self._next_launch
            self._reduce_into(shards[b], self._bucket_bufs[b])
            self._bucket_bufs[b] = None
            self._next_launch += 1

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
        """Bytes per rank: the bf16 parameters; the bf16 gradient buffer (stage 1), the fp32 gradient chunk and any
        fp32 bucket alive; the fp32 moments and masters as ``optimizer_state`` — beside
        :func:`~kuangchao_core.parallel.state_memory.zero_formula` for bf16 parameters."""
        params = self.flat_params.numel() * self.flat_params.element_size()
        grads = self.grad_shard.numel() * self._item + sum(
            x.numel() * x.element_size() for x in self.transient_grad_buffers()
        )
        if self.stage == 1:
            grads += self.flat_grads.numel() * self.flat_grads.element_size()
        else:
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
