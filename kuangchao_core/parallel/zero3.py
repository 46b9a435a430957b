"""ZeRO-3: parameters, gradients and AdamW state sharded across the data-parallel group (SPEC L3.5).

The model is cut into *units* — the token embedding, each decoder layer, the final norm, the output head
(:func:`block_units`) — and each unit's parameters are laid end to end in one bucket, padded to a multiple of the
DP size ``N``. DP rank ``r`` keeps chunk ``r`` of every bucket, and nothing else: the module's own parameters are
emptied (their names and shapes stay in the layout), so per rank (fp32 AdamW, Ψ elements) parameters 4Ψ/N,
gradients 4Ψ/N and AdamW state 8Ψ/N — 16Ψ/N bytes plus the padding.

A unit's forward (the module's ``forward`` is wrapped in place, names unchanged):

1. waits for its all-gather if one was prefetched, else gathers the bucket now (``all_gather_into``);
2. issues the *next* unit's all-gather asynchronously (prefetch), so it overlaps this unit's compute;
3. runs the module with its parameters replaced by views of the gathered bucket. The views come out of
   :class:`_GatherUnit`, an autograd function of this rank's chunk: its backward reduce-scatters the unit's
   gradient (sum, then ÷N) straight into the chunk's gradient;
4. drops the gathered bucket (reshard after forward). What autograd saves of the parameters for the backward is
   packed as a reference (unit, offset, shape, stride) by saved-tensor hooks; the backward's first use of a unit
   gathers it again and prefetches the unit before it. Layers under activation checkpointing keep nothing: their
   recomputation runs the wrapped forward, which gathers.

Gradient accumulation reduce-scatters every micro-batch (``no_sync`` cannot keep full gradients without their
memory); the sum of per-micro-batch averages is the average of the sums. Under pipeline parallelism each stage
shards its own units over its DP group and its schedule's forwards and backwards gather them per micro-batch.
Layout: :mod:`~kuangchao_core.parallel.zero3_shards`; a frozen LoRA base: :mod:`~kuangchao_core.parallel.zero3_lora`.

Checkpoints: this rank's AdamW pieces as ZeRO-1/2 write them (:mod:`kuangchao_core.parallel.zero_state`), and
the full parameters gathered inside :meth:`Zero3Optimizer.full_parameters` — layout-independent, so a ZeRO-3 run
resumes at any DP size or ZeRO stage. Under autocast the half-precision copies autocast makes of the weights are
new tensors and are saved for the backward as usual (2 bytes per element of every unit until its backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kuangchao_core.comm import primitives as comm
from kuangchao_core.errors import KuangchaoError
from kuangchao_core.hal.dtypes import adamw_kernel
from kuangchao_core.parallel import zero_state
from kuangchao_core.parallel.precision_policy import PrecisionPolicy
from kuangchao_core.parallel.state_memory import zero_formula
from kuangchao_core.parallel.weight_decay import apply_decay
from kuangchao_core.parallel.zero3_shards import shard_units


def block_units(model: nn.Module) -> list[nn.Module]:
    """The units a Llama-shaped model is sharded and gathered by: embedding, each decoder layer, final norm, head
    (those this pipeline stage holds); any other module is one unit."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        return [model]
    units: list[nn.Module] = []
    if getattr(inner, "embed_tokens", None) is not None:
        units.append(inner.embed_tokens)
    units += [m for m in inner.layers if any(True for _ in m.parameters())]
    if getattr(inner, "norm", None) is not None:
        units.append(inner.norm)
    if getattr(model, "lm_head", None) is not None:
        units.append(model.lm_head)
    return units


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True)
class _ParamRef:
    """What the backward needs to find a saved parameter view again in a re-gathered unit."""

    unit: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _GatherUnit(torch.autograd.Function):
    """Chunk of unit ``i`` -> the unit's full parameters (views of its gathered bucket); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, chunk: torch.Tensor, owner: Zero3Optimizer, i: int):  # noqa: D102
        ctx.owner, ctx.unit = owner, i
        ctx.set_materialize_grads(False)
        full = owner._full_for_forward(i)
        return tuple(full[s.offset : s.offset + s.numel].view(s.param.shape) for s in owner.buckets[i].slots)

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        return ctx.owner._reduce_unit(ctx.unit, grads), None, None


class Zero3Optimizer(zero_state.ShardedState):
    """AdamW with parameters, gradients and state sharded across ``dp_group`` by unit (see the module docstring).

    Args:
        model: the module to shard; its parameters are emptied and live in this optimizer's chunks afterwards.
        units: the modules whose forward gathers their parameters (:func:`block_units`); every trainable parameter
            belongs to exactly one.
        dp_group: the data-parallel ``CommGroup``.
        recomputed: indices into ``units`` whose forward runs under activation checkpointing (nothing is packed).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``; ``no_decay``: parameter names without decay.
        policy: with master weights (``train.param_dtype: bf16``) this rank's chunk of every unit is kept twice:
            the fp32 master (``flat_shard``, what AdamW steps and what each unit's gather function takes, so the
            reduce-scattered gradient, summed in ``reduce_dtype``, lands on it in fp32) and its rounding
            (``param_shard``), which forwards and backwards gather — half the bytes of an fp32 gather. Built while
            the model is still fp32.
    """

    stage = 3

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[nn.Module],
        dp_group,
        recomputed: Iterable[int] = (),
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        no_decay: Iterable[str] = (),
        policy: PrecisionPolicy = PrecisionPolicy(),
    ):
        if dp_group.rank is None:
            raise KuangchaoError(f"ZeRO-3: this process (global rank {dp_group.global_rank}) is not in {dp_group}")
        self.group = dp_group
        self.size = dp_group.size
        self.rank = dp_group.rank
        self._recomputed = set(recomputed)
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        dtypes = {p.dtype for _, p in self._named}
        devices = {p.device for _, p in self._named}
        if len(dtypes) != 1 or len(devices) != 1:
            raise KuangchaoError(
                f"ZeRO-3: parameters must share one dtype and device, got {sorted(map(str, dtypes))} on "
                f"{sorted(map(str, devices))}"
            )
        self.dtype, self.device = dtypes.pop(), devices.pop()
        self._item = torch.empty((), dtype=self.dtype).element_size()
        self._units = list(units)
        self.policy, self._gather_master = policy, False
        self.reduce_dtype = policy.reduce_dtype or self.dtype
        self._build_layout(model)
        self.param_shard = self.flat_shard.to(policy.param_dtype) if policy.masters else self.flat_shard
        if policy.masters:
            self._empty_params()
        self._no_decay = set(no_decay)
        self.weight_decay = float(weight_decay)
        self.shard_params = [nn.Parameter(self._chunk_view(b), requires_grad=True) for b in range(len(self.buckets))]
        self.optimizer = torch.optim.AdamW(
            self.shard_params, lr=lr, betas=betas, eps=eps, weight_decay=0.0, **adamw_kernel(self.shard_params)
        )
        self._inflight: dict[int, tuple[Any, torch.Tensor]] = {}  # unit -> (handle, buffer being gathered)
        self._forward_full: dict[int, torch.Tensor] = {}
        self._backward_full: dict[int, torch.Tensor] = {}
        self._packed: set[int] = set()  # units with parameter references awaiting the backward
        self.trace: list[tuple[str, int]] | None = None  # set to [] to record gathers and forward ends
        self.peak_gathered_bytes = 0
        for i, module in enumerate(self._units):
            self._wrap_forward(i, module)

    # ------------------------------------------------------------------ layout
    def _build_layout(self, model: nn.Module) -> None:
        self.numel = sum(p.numel() for _, p in self._named)  # before the module's parameters are emptied
        shards = shard_units(self._units, self._named, self.group, self.dtype, self.device)
        self.buckets, self._attrs, self._params = shards.buckets, shards.attrs, shards.params
        self.flat_shard, self._shard_offsets = shards.flat, shards.offsets
        self.padded_numel = sum(bk.size for bk in self.buckets)

    def _chunk_view(self, b: int) -> torch.Tensor:
        return self.flat_shard[self._shard_offsets[b] : self._shard_offsets[b] + self.buckets[b].chunk]

    def _trainable_chunk(self, i: int) -> torch.Tensor:
        """What unit ``i`` is gathered from: this rank's chunk (the rounded one under masters, except inside
        :meth:`full_parameters`, which gathers the masters)."""
        if self._gather_master or not self.policy.masters:
            return self.shard_params[i].detach()
        return self.param_shard[self._shard_offsets[i] :][: self.buckets[i].chunk]

    def _empty_params(self) -> None:
        for params in self._params:
            for _, p in params:
                p.data = torch.empty(0, dtype=self.param_shard.dtype, device=self.device)

    # ------------------------------------------------------------------ gathering
    def _record(self, event: str, i: int) -> None:
        if self.trace is not None:
            self.trace.append((event, i))

    def _issue_gather(self, i: int, async_op: bool) -> tuple[Any, torch.Tensor]:
        bk, chunk = self.buckets[i], self._trainable_chunk(i)
        full = torch.empty(bk.size, dtype=chunk.dtype, device=self.device)
        self._record("gather", i)
        if self.size == 1:
            full.copy_(chunk)
            return None, full
        handle = comm.all_gather_into(full, chunk, group=self.group, async_op=async_op)
        return (handle if async_op else None), full

    def _gathered(self, i: int) -> torch.Tensor:
        """Unit ``i``'s full bucket: the prefetched one (waited for) or gathered now."""
        if i in self._inflight:
            handle, full = self._inflight.pop(i)
            if handle is not None:
                handle.wait()
        else:
            _, full = self._issue_gather(i, async_op=False)
        held = sum(t.numel() for t in (*self._forward_full.values(), *self._backward_full.values(), full))
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, held * full.element_size())
        return full

    def _prefetch(self, i: int) -> None:
        if 0 <= i < len(self.buckets) and i not in self._inflight:
            self._inflight[i] = self._issue_gather(i, async_op=True)

    def _full_for_forward(self, i: int) -> torch.Tensor:
        full = self._gathered(i)
        self._forward_full[i] = full
        if not _in_backward():  # a recomputation inside the backward gathers on demand
            self._prefetch(i + 1)
        return full

    def _full_for_backward(self, i: int) -> torch.Tensor:
        if i not in self._backward_full:
            self._backward_full[i] = self._gathered(i)
            earlier = [j for j in self._packed if j < i and j not in self._backward_full]
            if earlier:
                self._prefetch(max(earlier))
        return self._backward_full[i]

    def _saved_tensor_hooks(self, i: int, full: torch.Tensor):
        ptr = full.untyped_storage().data_ptr()

        def pack(t: torch.Tensor):
            if t.device == full.device and t.untyped_storage().data_ptr() == ptr:
                self._packed.add(i)
                return _ParamRef(i, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            return t

        def unpack(x):
            if isinstance(x, _ParamRef):
                return self._full_for_backward(x.unit).as_strided(x.shape, x.stride, x.offset)
            return x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _wrap_forward(self, i: int, module: nn.Module) -> None:
        inner = module.forward

        def forward(*args, **kwargs):
            views = _GatherUnit.apply(self.shard_params[i], self, i)
            full = self._forward_full.pop(i)
            previous = [(sub, attr, sub._parameters[attr]) for sub, attr, _ in self._attrs[i]]
            try:
                for sub, attr, k in self._attrs[i]:
                    sub._parameters[attr] = views[k]
                pack = torch.is_grad_enabled() and i not in self._recomputed
                with self._saved_tensor_hooks(i, full) if pack else contextlib.nullcontext():
                    out = inner(*args, **kwargs)
            finally:
                for sub, attr, p in previous:
                    sub._parameters[attr] = p
            self._record("forward_end", i)
            return out

        module.forward = forward

    def _reduce_unit(self, i: int, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Unit ``i``'s gradient, reduce-scattered (averaged over DP) into this rank's chunk."""
        self._backward_full.pop(i, None)
        self._packed.discard(i)
        bk = self.buckets[i]
        flat = torch.zeros(bk.size, dtype=self.reduce_dtype, device=self.device)
        for s, g in zip(bk.slots, grads, strict=True):
            if g is not None:
                flat[s.offset : s.offset + s.numel].copy_(g.reshape(-1))
        out = torch.empty(bk.chunk, dtype=self.reduce_dtype, device=self.device)
        if self.size > 1:
            comm.reduce_scatter(out, flat, group=self.group, op="sum")
        else:
            out.copy_(flat)
        return out.to(self.dtype).div_(self.size)

    def _drain(self) -> None:
        for handle, _ in self._inflight.values():
            if handle is not None:
                handle.wait()
        self._inflight.clear()
        self._backward_full.clear()
        self._packed.clear()

    # ------------------------------------------------------------------ torch.optim-like surface
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accepted for the interface; ZeRO-3 reduce-scatters every micro-batch's gradient (see module docstring)."""
        yield

    def finish_gradient_sync(self) -> None:
        """Every unit's gradient was reduce-scattered by its backward; wait for any gather still in flight."""
        self._drain()

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's averaged gradient chunks, one per unit (zeros for a unit that got no gradient)."""
        out = []
        for sp in self.shard_params:
            if sp.grad is None:
                sp.grad = torch.zeros_like(sp)
            out.append(sp.grad)
        return out

    @torch.no_grad()
    def step(self) -> None:
        """Decay the decayed ranges, then AdamW on this rank's chunks (gathered again by the next forward)."""
        self._drain()
        self.grad_shards()
        decayed = [
            self.shard_params[s.bucket].data[coff : coff + hi - lo]
            for s, lo, hi, coff in self.owned_pieces()
            if s.name not in self._no_decay
        ]
        apply_decay(decayed, self.optimizer.param_groups[0]["lr"], self.weight_decay)
        self.optimizer.step()
        if self.policy.masters:  # rounded into the chunks the next forward gathers
            self.param_shard.copy_(self.flat_shard)

    def set_weight_decay(self, value: float) -> None:
        """Change the decoupled weight decay (of the decayed parameters)."""
        self.weight_decay = float(value)

    def zero_grad(self) -> None:
        """Drop the gradient chunks."""
        for sp in self.shard_params:
            sp.grad = None

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[None]:
        """Collective over the DP group: the module's parameters hold their full values inside the block (for
        checkpoints and inspection; the fp32 masters under a master policy); with ``writeback`` what was written
        into them is kept (each rank its chunk, rounded into the gathered chunks)."""
        self._drain()
        fulls = []
        self._gather_master = True
        with torch.no_grad():
            for i, params in enumerate(self._params):
                _, full = self._issue_gather(i, async_op=False)
                fulls.append(full)
                for s, (_, p) in zip(self.buckets[i].slots, params, strict=True):
                    p.data = full[s.offset : s.offset + s.numel].view(s.param.shape)
        self._gather_master = False
        try:
            yield
        finally:
            with torch.no_grad():
                for i, bk in enumerate(self.buckets):
                    if writeback:
                        self._chunk_view(i).copy_(fulls[i][self.rank * bk.chunk : (self.rank + 1) * bk.chunk])
                if writeback and self.policy.masters:
                    self.param_shard.copy_(self.flat_shard)
                self._empty_params()

    # ------------------------------------------------------------------ memory
    def memory_report(self) -> dict[str, Any]:
        """Bytes per rank held now for parameters (chunks, plus gathered buckets alive), gradient chunks and AdamW
        state (with the fp32 masters under a master policy), beside the formulas 4Ψ/N, 4Ψ/N, 8Ψ/N (fp32;
        :func:`~kuangchao_core.parallel.state_memory.zero_formula`; padding included in the measured sizes)."""
        psi, n, b = self.numel, self.size, self._item
        gathered = sum(t.numel() for t in (*self._forward_full.values(), *self._backward_full.values()))
        params = (self.param_shard.numel() + gathered) * self.param_shard.element_size()
        grads = sum(sp.grad.numel() * b for sp in self.shard_params if sp.grad is not None)
        optim = sum(
            st[k].numel() * st[k].element_size()
            for st in self.optimizer.state.values()
            for k in zero_state.STATE_KEYS
            if k in st
        ) + (self.flat_shard.numel() * b if self.policy.masters else 0)
        return {
            "stage": 3,
            "dp_size": n,
            "numel": psi,
            "padded_numel": self.padded_numel,
            "num_buckets": len(self.buckets),
            "measured": {"params": params, "grads": grads, "optimizer_state": optim, "total": params + grads + optim},
            "formula": zero_formula(psi, n, 3, *self.policy.formula_dtypes(b)),
            "peak_gathered_bytes": self.peak_gathered_bytes,
        }

    # ------------------------------------------------------------------ checkpoints (as ZeroOptimizer)
    @property
    def named_params(self) -> list[tuple[str, torch.Tensor]]:
        """Parameter names with shape placeholders (meta tensors), in registration order."""
        shapes = {s.name: s.param for bk in self.buckets for s in bk.slots}
        return [(n, shapes[n]) for n, _ in self._named]
