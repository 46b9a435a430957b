"""ZeRO optimizer-state sharding across the data-parallel group (SPEC L3.5), AdamW in fp32 (fp64 for fp64 models).

Layout. Trainable parameters are laid out in *reverse registration order* (roughly the order backward produces
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
- :meth:`step` runs ``torch.optim.AdamW`` (``foreach=False``) on this rank's chunks, then all-gathers every bucket
  so all replicas hold equal parameters again.

Typical step::

    opt = ZeroOptimizer(model.named_parameters(), dp_group, stage=2, lr=1e-3)
    for i, (x, y) in enumerate(micro_batches):
        with opt.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss_fn(model(x), y) / len(micro_batches)).backward()
    total_norm = opt.clip_grad_norm(1.0)
    opt.step()
    opt.zero_grad()

Checkpoints: :meth:`state_dict_for_checkpoint` gives this rank's pieces (``optim.<name>.exp_avg`` …, each a 1-D range
of the flattened parameter, with writer slice metadata); :meth:`full_state_dict` (collective) gives the unsharded
state in :func:`kuangchao_core.parallel.optim_state.flatten_optimizer_state` format; :meth:`load_full_state` and
:meth:`load_sharded_states` rebuild this rank's shard from either. :func:`merge_shards_to_full` works offline.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kuangchao_core.errors import CheckpointError, KuangchaoError

_MB = 1024 * 1024
_STATE_KEYS = ("exp_avg", "exp_avg_sq")
ZERO_META_FORMAT = 1


def _comm():
    from kuangchao_core.comm import primitives

    return primitives


@dataclass
class _Slot:
    name: str
    param: torch.nn.Parameter
    bucket: int
    offset: int  # start inside the bucket
    numel: int
    index: int  # position inside the bucket's slot list


@dataclass
class _Bucket:
    start: int  # start inside the flat buffer
    size: int  # padded size (multiple of N)
    slots: list[_Slot]
    chunk: int  # size // N; DP rank r owns [r * chunk, (r + 1) * chunk) of the bucket


def _named(params) -> list[tuple[str, torch.nn.Parameter]]:
    items = list(params)
    if not items:
        raise KuangchaoError("ZeroOptimizer: got no parameters; pass model.parameters() or model.named_parameters()")
    if isinstance(items[0], tuple):
        named = [(str(n), p) for n, p in items]
    else:
        named = [(f"param_{i}", p) for i, p in enumerate(items)]
    seen: set[int] = set()
    out = []
    for n, p in named:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        out.append((n, p))
    if not out:
        raise KuangchaoError("ZeroOptimizer: none of the given parameters requires a gradient; nothing to optimize")
    return out


class ZeroOptimizer:
    """AdamW whose state (stage 1) and gradients (stage 2) are sharded across ``dp_group``.

    Args:
        params: ``model.named_parameters()`` (names are used by checkpoints) or plain parameters (named
            ``param_<i>``). Parameters not requiring a gradient are ignored.
        dp_group: the data-parallel ``CommGroup``; every member constructs the optimizer with the same model.
        stage: 1 (optimizer state sharded) or 2 (gradients sharded too).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (the update is the same code, ``foreach=False``).
        bucket_cap_mb: upper bound of one bucket in MiB (the unit of reduce-scatter and all-gather).

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
        self._named = _named(params)
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
        self.optimizer = torch.optim.AdamW(
            self._shard_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )
        self._broadcast_params()

    # ------------------------------------------------------------------ layout
    def _build_layout(self, bucket_cap_mb: float) -> None:
        cap = max(1, int(bucket_cap_mb * _MB) // self._item)
        self.buckets: list[_Bucket] = []
        self._slots: list[_Slot] = []
        current: list[tuple[str, torch.nn.Parameter]] = []
        count = 0
        groups = []
        for name, p in reversed(self._named):
            if current and count + p.numel() > cap:
                groups.append(current)
                current, count = [], 0
            current.append((name, p))
            count += p.numel()
        groups.append(current)
        start = 0
        for params in groups:
            total = sum(p.numel() for _, p in params)
            padded = math.ceil(total / self.size) * self.size
            bucket = _Bucket(start=start, size=padded, slots=[], chunk=padded // self.size)
            off = 0
            for name, p in params:
                slot = _Slot(
                    name=name, param=p, bucket=len(self.buckets), offset=off, numel=p.numel(), index=len(bucket.slots)
                )
                bucket.slots.append(slot)
                self._slots.append(slot)
                off += p.numel()
            self.buckets.append(bucket)
            start += padded
        self._slot_of = {id(s.param): s for s in self._slots}
        self.numel = sum(s.numel for s in self._slots)
        self.padded_numel = start
        self.flat_params = torch.zeros(start, dtype=self.dtype, device=self.device)
        self._copy_back: list[_Slot] = []
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
            self.flat_grads = torch.zeros(start, dtype=self.dtype, device=self.device)
            for b in self.buckets:
                for s in b.slots:
                    if s.param.dtype == self.dtype:
                        s.param.grad = self.flat_grads[b.start + s.offset : b.start + s.offset + s.numel].view_as(
                            s.param
                        )
        else:
            self.grad_shard = torch.zeros(start // self.size, dtype=self.dtype, device=self.device)

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

    def _pieces(self, rank: int | None = None) -> list[tuple[_Slot, int, int, int]]:
        """``(slot, lo, hi, chunk_off)`` for every parameter range ``[lo, hi)`` that DP rank ``rank`` owns;
        ``chunk_off`` is where it starts inside that rank's chunk of the bucket."""
        r = self.rank if rank is None else rank
        out = []
        for bk in self.buckets:
            c_lo, c_hi = r * bk.chunk, (r + 1) * bk.chunk
            for s in bk.slots:
                lo, hi = max(s.offset, c_lo), min(s.offset + s.numel, c_hi)
                if lo < hi:
                    out.append((s, lo - s.offset, hi - s.offset, lo - c_lo))
        return out

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
        comm = _comm()
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
        parameter ``slot.name`` sit at ``offset`` in this rank's shard of bucket ``slot.bucket``."""
        return self._pieces()

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
            _comm().all_reduce(sq, group=self.group, op="sum")
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in self._grad_shards():
            g.mul_(coef)
        return total

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's chunks, then all-gather every bucket so all replicas hold the same parameters."""
        self.finish_gradient_sync()
        self.optimizer.step()
        if self.size > 1:
            comm = _comm()
            for b, bk in enumerate(self.buckets):
                full = self.flat_params[bk.start : bk.start + bk.size]
                chunks = list(full.split(bk.chunk))
                comm.all_gather(chunks, self._param_chunk(b).clone(), group=self.group)
        for s in self._copy_back:
            bk = self.buckets[s.bucket]
            src = self.flat_params[bk.start + s.offset : bk.start + s.offset + s.numel]
            s.param.data.copy_(src.view_as(s.param))
        self._synced = False

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

    def _take_gradient(self, b: int, i: int, s: _Slot) -> None:
        bk = self.buckets[b]
        if self._bucket_bufs[b] is None:
            self._bucket_bufs[b] = torch.zeros(bk.size, dtype=self.dtype, device=self.device)
            held = sum(x.numel() * self._item for x in self._bucket_bufs if x is not None)
            self.peak_transient_grad_bytes = max(self.peak_transient_grad_bytes, held)
        if s.param.grad is not None:
            self._bucket_bufs[b][s.offset : s.offset + s.numel].copy_(s.param.grad.reshape(-1))
            s.param.grad = None
        self._ready[b][i] = True

    def _launch_in_order(self) -> None:
        comm = _comm()
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
            _comm().broadcast(self.flat_params, src=self.group.ranks[0], group=self.group)
            for s in self._copy_back:
                bk = self.buckets[s.bucket]
                src = self.flat_params[bk.start + s.offset : bk.start + s.offset + s.numel]
                s.param.data.copy_(src.view_as(s.param))

    # ------------------------------------------------------------------ memory
    def memory_report(self) -> dict[str, Any]:
        """Bytes per rank held for parameters, gradients and AdamW state: measured tensors and the formulas.

        Formulas (b = 4 bytes per element in fp32, 8 in fp64; Ψ trainable elements, N = DP size): params bΨ, grads bΨ
        (stage 1) or bΨ/N (stage 2), Adam ``exp_avg`` + ``exp_avg_sq`` 2bΨ/N. Measured sizes include the padding of
        each bucket to a multiple of N.
        """
        psi, n, b = self.numel, self.size, self._item
        params = self.flat_params.numel() * b + sum(s.param.numel() * s.param.element_size() for s in self._copy_back)
        if self.stage == 1:
            grads = self.flat_grads.numel() * b
        else:
            grads = self.grad_shard.numel() * b + sum(x.numel() * b for x in self._bucket_bufs if x is not None)
            grads += sum(
                s.param.grad.numel() * s.param.grad.element_size() for s in self._slots if s.param.grad is not None
            )
        optim = 0
        optim_elems = 0
        for st in self.optimizer.state.values():
            for k in _STATE_KEYS:
                if k in st:
                    optim += st[k].numel() * st[k].element_size()
                    optim_elems += st[k].numel()
        return {
            "stage": self.stage,
            "dp_size": n,
            "numel": psi,
            "padded_numel": self.padded_numel,
            "num_buckets": len(self.buckets),
            "measured": {"params": params, "grads": grads, "optimizer_state": optim, "total": params + grads + optim},
            "formula": {
                "params": b * psi,
                "grads": b * psi if self.stage == 1 else b * psi / n,
                "optimizer_state": 2 * b * psi / n,
                "total": b * psi + (b * psi if self.stage == 1 else b * psi / n) + 2 * b * psi / n,
            },
            "optimizer_state_elements": optim_elems,
            "peak_transient_grad_bytes": self.peak_transient_grad_bytes,
        }

    # ------------------------------------------------------------------ checkpoints
    def _hyper(self) -> dict[str, Any]:
        g = self.optimizer.param_groups[0]
        return {k: v for k, v in g.items() if k != "params"}

    def _step_count(self) -> float:
        for st in self.optimizer.state.values():
            if "step" in st:
                return float(st["step"])
        return 0.0

    def state_dict_for_checkpoint(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, Any]]:
        """``(tensors, slices, meta)`` for this rank's shard of the optimizer state.

        ``tensors``: ``optim.<name>.exp_avg`` / ``.exp_avg_sq``, each a 1-D range of the *flattened* parameter;
        ``slices``: per tensor the writer's slice metadata (``full_shape`` = [numel], ``offsets`` = [start]);
        ``meta``: JSON with the step, hyperparameters, stage, DP size/rank and every parameter's shape. Pass
        ``slices`` to ``CheckpointWriter.save(..., slices=...)`` and keep ``meta`` in the manifest extras.
        """
        tensors: dict[str, torch.Tensor] = {}
        slices: dict[str, dict[str, Any]] = {}
        states = [self.optimizer.state.get(sp) for sp in self._shard_params]
        if any(states):
            for s, lo, hi, coff in self._pieces():
                st = states[s.bucket]
                for k in _STATE_KEYS:
                    key = f"optim.{s.name}.{k}"
                    tensors[key] = st[k][coff : coff + hi - lo].detach().clone()
                    slices[key] = {"full_shape": [s.numel], "offsets": [lo], "shape": [hi - lo]}
        hyper = self._hyper()
        meta = {
            "format": ZERO_META_FORMAT,
            "optimizer": "AdamW",
            "zero_stage": self.stage,
            "dp_size": self.size,
            "dp_rank": self.rank,
            "step": self._step_count(),
            "hyper": {k: (list(v) if isinstance(v, tuple) else v) for k, v in hyper.items() if _jsonable(v)},
            "param_shapes": {s.name: list(s.param.shape) for s in self._slots},
            "param_order": self.parameter_names(),
        }
        return tensors, slices, meta

    def full_state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Collective over the DP group: the unsharded state as ``flatten_optimizer_state`` of a plain AdamW.

        The result loads into ``torch.optim.AdamW(model.parameters(), foreach=False)`` with
        ``kuangchao_core.parallel.optim_state.load_optimizer_state`` (names as given to this optimizer).
        """
        full: dict[str, dict[str, torch.Tensor]] = {}
        states = [self.optimizer.state.get(sp) for sp in self._shard_params]
        if any(states):
            comm = _comm()
            for b, bk in enumerate(self.buckets):
                for k in _STATE_KEYS:
                    mine = states[b][k].detach().clone()
                    if self.size > 1:
                        parts = comm.all_gather(None, mine, group=self.group)
                        whole = torch.cat(parts)
                    else:
                        whole = mine
                    for s in bk.slots:
                        full.setdefault(s.name, {})[k] = whole[s.offset : s.offset + s.numel].view_as(s.param).clone()
        return _as_flat_adamw(full, self._step_count(), self._hyper(), self._named)

    def load_full_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Keep this rank's ranges of an unsharded AdamW state (``flatten_optimizer_state`` format).

        Parameters without state in the checkpoint (never stepped) reset the whole optimizer to fresh.
        """
        if meta.get("optimizer") != "AdamW":
            raise CheckpointError(
                f"ZeroOptimizer can load AdamW state only; the checkpoint holds {meta.get('optimizer')!r} state"
            )
        groups = meta.get("param_groups") or []
        if len(groups) != 1:
            raise CheckpointError(f"ZeroOptimizer expects one optimizer param group, the checkpoint has {len(groups)}")
        names = set(groups[0].get("param_names", []))
        mine = set(self.parameter_names())
        if names != mine:
            raise CheckpointError(
                f"optimizer checkpoint parameters differ: only in checkpoint {sorted(names - mine)[:3]}, "
                f"only in the model {sorted(mine - names)[:3]}"
            )
        for k in ("lr", "eps", "weight_decay", "betas"):
            if k in groups[0]:
                v = groups[0][k]
                self.optimizer.param_groups[0][k] = tuple(v) if isinstance(v, list) else v
        state_keys = meta.get("state_keys", {})
        self.optimizer.state.clear()
        if not state_keys:
            return
        missing = sorted(mine - set(state_keys))
        if missing:
            raise CheckpointError(f"optimizer checkpoint has no state for {missing[:3]}; it cannot seed ZeRO shards")
        first = next(iter(sorted(state_keys)))
        step_t = tensors.get(f"optim.{first}.step")
        step = float(step_t) if step_t is not None else float(meta.get("state_scalars", {}).get(first, {}).get("step"))
        new = [
            {
                "step": torch.tensor(step, dtype=torch.float32),
                **{k: torch.zeros(bk.chunk, dtype=self.dtype, device=self.device) for k in _STATE_KEYS},
            }
            for bk in self.buckets
        ]
        for s, lo, hi, coff in self._pieces():
            for k in _STATE_KEYS:
                key = f"optim.{s.name}.{k}"
                if key not in tensors:
                    raise CheckpointError(f"optimizer state tensor {key} is missing from the checkpoint")
                src = tensors[key].reshape(-1)
                if src.numel() != s.numel:
                    raise CheckpointError(f"{key} has {src.numel()} elements, the parameter has {s.numel}")
                new[s.bucket][k][coff : coff + hi - lo].copy_(src[lo:hi])
        for sp, st in zip(self._shard_params, new, strict=True):
            self.optimizer.state[sp] = st

    def load_sharded_states(
        self, shards: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, Mapping[str, Any]], Mapping[str, Any]]]
    ) -> None:
        """Rebuild this rank's shard from every rank's :meth:`state_dict_for_checkpoint` of any DP size/stage."""
        tensors, meta = merge_shards_to_full(shards)
        self.load_full_state(tensors, meta)


def _master_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """fp64 when every parameter is fp64, else fp32 (the master dtype of fp32 and half-precision parameters)."""
    found = set(dtypes)
    return torch.float64 if found == {torch.float64} else torch.float32


def _jsonable(v: Any) -> bool:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return True
    return isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v)


def _as_flat_adamw(
    full: Mapping[str, Mapping[str, torch.Tensor]],
    step: float,
    hyper: Mapping[str, Any],
    named: Sequence[tuple[str, Any]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Express per-parameter AdamW state as ``flatten_optimizer_state`` output of an equivalent plain AdamW."""
    from kuangchao_core.parallel.optim_state import flatten_optimizer_state

    shapes = [(n, list(p.shape) if hasattr(p, "shape") else list(p)) for n, p in named]
    placeholders = [torch.empty(shape, device="meta", requires_grad=True) for _, shape in shapes]
    keep = {k: hyper[k] for k in ("lr", "betas", "eps", "weight_decay") if k in hyper}
    betas = keep.get("betas")
    if isinstance(betas, list):
        keep["betas"] = tuple(betas)
    opt = torch.optim.AdamW(placeholders, foreach=False, **keep)
    for k, v in hyper.items():
        if k in opt.param_groups[0] and k not in keep and k != "params":
            opt.param_groups[0][k] = tuple(v) if isinstance(v, list) else v
    if full:
        for (name, _), ph in zip(shapes, placeholders, strict=True):
            opt.state[ph] = {"step": torch.tensor(float(step), dtype=torch.float32), **full[name]}
    return flatten_optimizer_state(opt, [n for n, _ in shapes])


def merge_shards_to_full(
    shards: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, Mapping[str, Any]], Mapping[str, Any]]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Offline: join every rank's ``(tensors, slices, meta)`` into one unsharded AdamW state.

    Returns ``flatten_optimizer_state``-format ``(tensors, meta)``; every element of every parameter must be
    covered by some shard (a missing rank is reported).
    """
    if not shards:
        raise CheckpointError("merge_shards_to_full: no shards given")
    meta0 = shards[0][2]
    if meta0.get("format") != ZERO_META_FORMAT:
        raise CheckpointError(f"ZeRO shard meta has format {meta0.get('format')!r}, expected {ZERO_META_FORMAT}")
    shapes = {n: list(s) for n, s in meta0["param_shapes"].items()}
    order = list(meta0.get("param_order", shapes))
    has_state = any(t for t, _, _ in shards)
    dtype = next((v.dtype for t, _, _ in shards for v in t.values()), torch.float32)
    full: dict[str, dict[str, torch.Tensor]] = {}
    if has_state:
        covered: dict[str, torch.Tensor] = {}
        for name in order:
            numel = math.prod(shapes[name])
            full[name] = {k: torch.zeros(numel, dtype=dtype) for k in _STATE_KEYS}
            covered[name] = torch.zeros(numel, dtype=torch.bool)
        for tensors, slices, _ in shards:
            for key, t in tensors.items():
                name, k = key.removeprefix("optim.").rsplit(".", 1)
                sl = slices[key]
                lo = int(sl["offsets"][0])
                full[name][k][lo : lo + t.numel()].copy_(t.reshape(-1))
                if k == _STATE_KEYS[0]:
                    covered[name][lo : lo + t.numel()] = True
        holes = [n for n, c in covered.items() if not bool(c.all())]
        if holes:
            raise CheckpointError(
                f"ZeRO shards do not cover {len(holes)} parameters (first {holes[0]}); "
                f"got {len(shards)} shards of dp_size {meta0.get('dp_size')}: pass every rank's shard"
            )
        for name in order:
            for k in _STATE_KEYS:
                full[name][k] = full[name][k].view(shapes[name])
    return _as_flat_adamw(full, float(meta0.get("step", 0.0)), meta0.get("hyper", {}), [(n, shapes[n]) for n in order])
