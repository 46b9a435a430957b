"""ZeRO-3 with LoRA (issue 29 item 2): the frozen base sharded over the DP group beside the adapters.

:class:`LoraZero3Optimizer` is :class:`~kuangchao_core.parallel.zero3.Zero3Optimizer` over the trainable adapters
(their chunks, gradients reduce-scattered by each unit's backward, AdamW state 1/N per rank — sharded, not
replicated: it is ZeRO-3's own path, its checkpoint pieces are ZeRO-1/2/3's, and the adapters are gathered with
the base anyway, so replicating them would save no traffic) plus a second layout of the same units for the frozen
base (:func:`~kuangchao_core.parallel.zero3_shards.shard_units`): each rank keeps 1/N of every unit's base
weights, no gradient and no optimizer state.

A unit's gather fills one buffer, ``[adapters' bucket | base's bucket]`` (two all-gathers into the two halves), so
the forward binds the base's weights as views of the same storage the adapters' views come from, and the
saved-tensor hooks pack both kinds as references and re-gather them for the backward exactly as ZeRO-3 does. The
base's views are made outside the gather function: they do not require a gradient, so autograd computes no
gradient for a frozen weight and nothing of the base is reduce-scattered.

Per rank (Ψ_a adapter elements, Ψ_b base elements, b bytes each): parameters b(Ψ_a + Ψ_b)/N, gradients bΨ_a/N,
AdamW 2bΨ_a/N, plus the padding and the gathered units alive. Checkpoints are a ZeRO-2 LoRA run's: the adapters
(gathered in :meth:`full_parameters`) and their AdamW pieces; the base is its identity and is loaded again from
``model.checkpoint`` (or the seed) through :meth:`full_parameters` with ``writeback``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kuangchao_core.comm import primitives as comm
from kuangchao_core.parallel.zero3 import Zero3Optimizer
from kuangchao_core.parallel.zero3_shards import shard_units


class _Both:
    """Waits for several handles."""

    def __init__(self, handles: list[Any]):
        self.handles = handles

    def wait(self) -> None:
        for h in self.handles:
            if h is not None:
                h.wait()


class LoraZero3Optimizer(Zero3Optimizer):
    """:class:`Zero3Optimizer` of a model whose parameters that need no gradient (a LoRA base) are sharded too
    (module docstring); same arguments. Under a master policy the adapters have fp32 master chunks, gathered
    rounded, and the base's chunks are in ``param_dtype`` only (never updated, so without a master)."""

    def __init__(self, model: nn.Module, *args: Any, **kwargs: Any):
        self._bound: dict[int, torch.Tensor] = {}  # unit -> the buffer its running forward binds the base from
        self._base_in_gathers = True
        super().__init__(model, *args, **kwargs)
        frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        self.base_numel = sum(p.numel() for _, p in frozen)
        self.base = shard_units(self._units, frozen, self.group, self.dtype, self.device)
        self.base.flat = self.base.flat.to(self.param_shard.dtype)  # bf16 parameters: the base has no master

    def _issue_gather(self, i: int, async_op: bool) -> tuple[Any, torch.Tensor]:
        """Unit ``i``'s adapters and base into one buffer, ``[adapters | base]``."""
        if not self._base_in_gathers:
            return super()._issue_gather(i, async_op)
        bk, fb = self.buckets[i], self.base.buckets[i]
        full = torch.empty(bk.size + fb.size, dtype=self.base.flat.dtype, device=self.device)
        self._record("gather", i)
        pairs = [(full[: bk.size], self._trainable_chunk(i)), (full[bk.size :], self.base.chunk(i))]
        if self.size == 1:
            for out, chunk in pairs:
                out.copy_(chunk)
            return None, full
        handles = [comm.all_gather_into(out, chunk, group=self.group, async_op=async_op) for out, chunk in pairs]
        return (_Both(handles) if async_op else None), full

    def _full_for_forward(self, i: int) -> torch.Tensor:
        full = super()._full_for_forward(i)
        self._bound[i] = full
        return full

    def _wrap_forward(self, i: int, module: nn.Module) -> None:
        """The base's weights bound as views of the unit's gathered buffer (its second half) around the module's
        own forward; ZeRO-3's wrapper, outside it, binds the adapters and packs what autograd saves."""
        inner = module.forward

        def forward(*args, **kwargs):
            full = self._bound.pop(i)
            start = self.buckets[i].size
            slots = self.base.buckets[i].slots
            previous = [(sub, attr, sub._parameters[attr]) for sub, attr, _ in self.base.attrs[i]]
            try:
                for sub, attr, k in self.base.attrs[i]:
                    s = slots[k]
                    sub._parameters[attr] = full[start + s.offset : start + s.offset + s.numel].view(s.param.shape)
                return inner(*args, **kwargs)
            finally:
                for sub, attr, p in previous:
                    sub._parameters[attr] = p

        module.forward = forward
        super()._wrap_forward(i, module)

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[None]:
        """Collective: inside the block the adapters and the base hold their full values; with ``writeback`` what
        was written into either is kept (each rank its chunks)."""
        self._drain()
        fulls = []
        with torch.no_grad():
            for i, params in enumerate(self.base.params):
                full = torch.empty(self.base.buckets[i].size, dtype=self.base.flat.dtype, device=self.device)
                if self.size > 1:
                    comm.all_gather_into(full, self.base.chunk(i), group=self.group)
                else:
                    full.copy_(self.base.chunk(i))
                fulls.append(full)
                for s, (_, p) in zip(self.base.buckets[i].slots, params, strict=True):
                    p.data = full[s.offset : s.offset + s.numel].view(s.param.shape)
        self._base_in_gathers = False
        try:
            with super().full_parameters(writeback):
                yield
        finally:
            self._base_in_gathers = True
            with torch.no_grad():
                for i, params in enumerate(self.base.params):
                    bk = self.base.buckets[i]
                    if writeback:
                        self.base.chunk(i).copy_(fulls[i][self.rank * bk.chunk : (self.rank + 1) * bk.chunk])
                    for _, p in params:
                        p.data = torch.empty(0, dtype=self.base.flat.dtype, device=self.device)

    def memory_report(self) -> dict[str, Any]:
        """The ZeRO-3 optimizer's report with the base's chunks in ``params`` (measured and formula: ``b·Ψ_b/N``
        more, ``b`` the base's bytes per element); ``base_numel``: the frozen elements."""
        report = super().memory_report()
        item = self.base.flat.element_size()
        base = self.base.flat.numel() * item
        measured = {**report["measured"], "params": report["measured"]["params"] + base}
        measured["total"] += base
        formula = dict(report["formula"])
        share = item * self.base_numel / self.size
        formula["params"] += share
        formula["total"] += share
        return {**report, "measured": measured, "formula": formula, "base_numel": self.base_numel}
