"""ZeRO-3 with bf16 parameters and fp32 master weights (``train.param_dtype: bf16``; see
:mod:`~kuangchao_core.parallel.master_weights`).

:class:`~kuangchao_core.parallel.zero3.Zero3Optimizer`'s units and chunks, with two copies of this rank's chunk of
every unit: the fp32 master (``flat_shard``, what AdamW steps and what each unit's gather function takes as its
input, so the reduce-scattered fp32 gradient lands on the master) and its bf16 rounding (``param_shard``), which
the forward and backward gather — half the bytes of an fp32 gather. Per rank (Ψ elements, N = DP size): bf16
parameters 2Ψ/N, fp32 gradients 4Ψ/N, fp32 masters 4Ψ/N and moments 8Ψ/N, plus the gathered bf16 units.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kuangchao_core.comm import primitives as comm
from kuangchao_core.parallel.state_memory import zero_formula
from kuangchao_core.parallel.zero3 import Zero3Optimizer
from kuangchao_core.parallel.zero_state import STATE_KEYS

PARAM_DTYPE = torch.bfloat16


class MasterZero3Optimizer(Zero3Optimizer):
    """:class:`Zero3Optimizer` whose units are gathered in bf16 from fp32 master chunks (module docstring). Built
    while the model is still fp32; the module's (emptied) parameters are bf16 afterwards. ``reduce_dtype``: what a
    unit's gradient is summed in (fp32; bf16 for ``parallel.grad_reduce_dtype: bf16``, widened into the chunk)."""

    reduce_dtype = torch.float32

    def __init__(self, *args: Any, **kwargs: Any):
        self._gather_master = False
        super().__init__(*args, **kwargs)
        self.param_shard = self.flat_shard.to(PARAM_DTYPE)
        self._empty_params()

    def _empty_params(self) -> None:
        for params in self._params:
            for _, p in params:
                p.data = torch.empty(0, dtype=PARAM_DTYPE, device=self.device)

    def _issue_gather(self, i: int, async_op: bool) -> tuple[Any, torch.Tensor]:
        """Unit ``i`` gathered from the bf16 chunks (the fp32 masters inside :meth:`full_parameters`)."""
        bk = self.buckets[i]
        lo = self._shard_offsets[i]
        chunk = self._chunk_view(i) if self._gather_master else self.param_shard[lo : lo + bk.chunk]
        full = torch.empty(bk.size, dtype=chunk.dtype, device=self.device)
        self._record("gather", i)
        if self.size == 1:
            full.copy_(chunk)
            return None, full
        handle = comm.all_gather_into(full, chunk, group=self.group, async_op=async_op)
        return (handle if async_op else None), full

    def _reduce_unit(self, i: int, grads: Any) -> torch.Tensor:
        """Unit ``i``'s bf16 gradients summed over DP in ``reduce_dtype``, averaged into an fp32 chunk (the master's
        gradient)."""
        if self.reduce_dtype == self.dtype:
            return super()._reduce_unit(i, grads)
        self._backward_full.pop(i, None)
        self._packed.discard(i)
        bk = self.buckets[i]
        flat = torch.zeros(bk.size, dtype=self.reduce_dtype, device=self.device)
        for s, g in zip(bk.slots, grads, strict=True):
            if g is not None:
                flat[s.offset : s.offset + s.numel].copy_(g.reshape(-1))
        mine = torch.empty(bk.chunk, dtype=self.reduce_dtype, device=self.device)
        if self.size > 1:
            comm.reduce_scatter(mine, flat, group=self.group, op="sum")
        else:
            mine.copy_(flat)
        return mine.to(self.dtype).div_(self.size)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the fp32 master chunks, then the chunks rounded into the bf16 ones the next forward gathers."""
        super().step()
        self.param_shard.copy_(self.flat_shard)

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[None]:
        """Collective: inside the block the module's parameters hold the full fp32 masters (what checkpoints save
        and load); with ``writeback`` what was written is kept in the masters and rounded into the bf16 chunks."""
        self._gather_master = True
        try:
            with super().full_parameters(writeback):
                self._gather_master = False
                yield
        finally:
            self._gather_master = False
            if writeback:
                self.param_shard.copy_(self.flat_shard)
            self._empty_params()

    def memory_report(self) -> dict[str, Any]:
        """Bytes per rank: bf16 chunks plus gathered units alive, fp32 gradient chunks, fp32 moments and masters
        (``optimizer_state``), beside :func:`~kuangchao_core.parallel.state_memory.zero_formula` for bf16
        parameters."""
        half = self.param_shard.element_size()
        gathered = sum(t.numel() for t in (*self._forward_full.values(), *self._backward_full.values()))
        params = (self.param_shard.numel() + gathered) * half
        grads = sum(sp.grad.numel() * self._item for sp in self.shard_params if sp.grad is not None)
        moments = sum(
            st[k].numel() * st[k].element_size() for st in self.optimizer.state.values() for k in STATE_KEYS if k in st
        )
        optim = moments + self.flat_shard.numel() * self._item
        return {
            "stage": 3,
            "dp_size": self.size,
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "num_buckets": len(self.buckets),
            "measured": {"params": params, "grads": grads, "optimizer_state": optim, "total": params + grads + optim},
            "formula": zero_formula(self.numel, self.size, 3, "bf16", "bf16"),
            "peak_gathered_bytes": self.peak_gathered_bytes,
        }
