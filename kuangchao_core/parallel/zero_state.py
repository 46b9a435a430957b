"""ZeRO's sharded AdamW state (SPEC L3.5, L4.4): what each rank holds (:func:`memory_report`) and its checkpoints —
this rank's pieces, the gathered full state, loading either into a
:class:`~kuangchao_core.parallel.zero.ZeroOptimizer`, and the offline merge of every rank's pieces.

- :func:`sharded_state` gives this rank's pieces (``optim.<name>.exp_avg`` …, each a 1-D range of the flattened
  parameter, with writer slice metadata) — what the checkpoint writer stores without any communication.
- :func:`gather_full_state` (collective) gives the unsharded state in
  :func:`kuangchao_core.parallel.optim_state.flatten_optimizer_state` format, the format a plain AdamW saves.
- :func:`load_full_state` keeps this rank's ranges of a full state; :func:`merge_shards_to_full` joins every rank's
  pieces offline (any DP size or stage), so a ZeRO checkpoint resumes in any layout.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kuangchao_core.comm import primitives as comm
from kuangchao_core.errors import CheckpointError
from kuangchao_core.parallel.state_memory import zero_formula
from kuangchao_core.parallel.zero_layout import owned_sum_of_squares, pieces_of

if TYPE_CHECKING:
    from kuangchao_core.parallel.zero import ZeroOptimizer

STATE_KEYS = ("exp_avg", "exp_avg_sq")
ZERO_META_FORMAT = 1


class ShardedState:
    """What the ZeRO optimizers (stages 1/2 and 3) share: the torch.optim-like surface over the wrapped AdamW and
    this rank's pieces, and the checkpoint methods of this module. A subclass sets ``_named``, ``optimizer``,
    ``buckets``, ``rank``, ``weight_decay``, ``_item`` and ``shard_params`` and defines ``finish_gradient_sync``
    and ``grad_shards``."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner AdamW's param groups (set ``lr`` here, as for any torch optimizer)."""
        return self.optimizer.param_groups

    def parameter_names(self) -> list[str]:
        """Names of the optimized parameters, in registration order."""
        return [n for n, _ in self._named]

    def _pieces(self, rank: int | None = None) -> list[tuple[Any, int, int, int]]:
        return pieces_of(self.buckets, self.rank if rank is None else rank)

    def owned_pieces(self) -> list[tuple[Any, int, int, int]]:
        """``(slot, lo, hi, offset)`` of every parameter range this rank owns: elements ``[lo, hi)`` of the flattened
        parameter ``slot.name`` sit at ``offset`` in this rank's shard of bucket ``slot.bucket``."""
        return self._pieces()

    def grad_norm_sq(self, weight: Mapping[str, float]) -> torch.Tensor:
        """This rank's share of the squared global gradient norm: the sum of squares of the averaged gradient
        elements it owns, parameter ``name`` weighted by ``weight[name]`` (float64 scalar; sum it over the DP group
        and any other group of the mesh)."""
        self.finish_gradient_sync()
        return owned_sum_of_squares(self.grad_shards(), self._pieces(), weight)

    @property
    def item_bytes(self) -> int:
        """Bytes per element of the master dtype (4 in fp32, 8 in fp64)."""
        return self._item

    def state_tensors(self) -> list[torch.Tensor]:
        """The AdamW moments this rank holds (its chunks' ``exp_avg``, ``exp_avg_sq``)."""
        return [v for st in self.optimizer.state.values() for k, v in st.items() if k != "step"]

    def hyperparameters(self) -> dict[str, Any]:
        """AdamW's settings (lr, betas, eps …) with the decoupled weight decay of the decayed parameters."""
        return adamw_hyperparameters(self.optimizer, self.weight_decay)

    def step_count(self) -> float:
        """Optimizer steps taken (AdamW's ``step``), 0 before the first."""
        return adamw_step_count(self.optimizer)

    def shard_states(self) -> list[dict[str, torch.Tensor] | None]:
        """AdamW state of this rank's chunk of every bucket (None for a bucket never stepped)."""
        return [self.optimizer.state.get(sp) for sp in self.shard_params]

    def state_dict_for_checkpoint(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, Any]]:
        """This rank's shard of the optimizer state: :func:`sharded_state`."""
        return sharded_state(self)

    def full_state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Collective over the DP group: :func:`gather_full_state`."""
        return gather_full_state(self)

    def load_full_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Keep this rank's ranges of an unsharded AdamW state: :func:`load_full_state`."""
        load_full_state(self, tensors, meta)

    def load_sharded_states(
        self, shards: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, Mapping[str, Any]], Mapping[str, Any]]]
    ) -> None:
        """Rebuild this rank's shard from every rank's :meth:`state_dict_for_checkpoint` of any DP size/stage."""
        load_full_state(self, *merge_shards_to_full(shards))


def adamw_hyperparameters(optimizer: torch.optim.Optimizer, weight_decay: float) -> dict[str, Any]:
    """The wrapped AdamW's settings, with the decoupled ``weight_decay`` the sharded optimizer applies itself."""
    g = optimizer.param_groups[0]
    return {k: v for k, v in g.items() if k != "params"} | {"weight_decay": weight_decay}


def adamw_step_count(optimizer: torch.optim.Optimizer) -> float:
    """Optimizer steps the wrapped AdamW took (its ``step`` state), 0 before the first."""
    for st in optimizer.state.values():
        if "step" in st:
            return float(st["step"])
    return 0.0


def memory_report(opt: ZeroOptimizer) -> dict[str, Any]:
    """Bytes per rank held for parameters, gradients and AdamW state: measured tensors and the formulas.

    Formulas: :func:`~kuangchao_core.parallel.state_memory.zero_formula` (the memory model ``kc plan`` and
    ``kc recommend`` use; b = 4 bytes per element in fp32, 8 in fp64; Ψ trainable elements, N = DP size): params
    bΨ, grads bΨ (stage 1) or bΨ/N (stage 2), Adam ``exp_avg`` + ``exp_avg_sq`` 2bΨ/N. Measured sizes include the
    padding of each bucket to a multiple of N.
    """
    psi, n, b = opt.numel, opt.size, opt.item_bytes
    masters = opt.master is not None  # bf16 parameters; fp32 masters counted in ``optimizer_state``
    params = opt.flat_params.numel() * opt.flat_params.element_size() + sum(
        s.param.numel() * s.param.element_size() for s in opt.copied_back_params()
    )
    if opt.stage == 1:
        grads = opt.flat_grads.numel() * b
    else:
        grads = opt.grad_shard.numel() * b + sum(x.numel() * b for x in opt.transient_grad_buffers())
    if opt.stage == 2 or masters:  # the gradients a parameter holds outside the buffers
        grads += sum(p.grad.numel() * p.grad.element_size() for _, p in opt.named_params if p.grad is not None)
    optim = 0
    optim_elems = 0
    for st in opt.optimizer.state.values():
        for k in STATE_KEYS:
            if k in st:
                optim += st[k].numel() * st[k].element_size()
                optim_elems += st[k].numel()
    if masters:
        optim += opt.master.numel() * b
    return {
        "stage": opt.stage,
        "dp_size": n,
        "numel": psi,
        "padded_numel": opt.padded_numel,
        "num_buckets": len(opt.buckets),
        "measured": {"params": params, "grads": grads, "optimizer_state": optim, "total": params + grads + optim},
        "formula": zero_formula(psi, n, opt.stage, *opt.policy.formula_dtypes(b)),
        "optimizer_state_elements": optim_elems,
        "peak_transient_grad_bytes": opt.peak_transient_grad_bytes,
    }


def sharded_state(opt: ZeroOptimizer) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, Any]]:
    """``(tensors, slices, meta)`` for this rank's shard of the optimizer state.

    ``tensors``: ``optim.<name>.exp_avg`` / ``.exp_avg_sq``, each a 1-D range of the *flattened* parameter;
    ``slices``: per tensor the writer's slice metadata (``full_shape`` = [numel], ``offsets`` = [start]);
    ``meta``: JSON with the step, hyperparameters, stage, DP size/rank and every parameter's shape. Pass
    ``slices`` to ``CheckpointWriter.save(..., slices=...)`` and keep ``meta`` in the manifest extras.
    """
    tensors: dict[str, torch.Tensor] = {}
    slices: dict[str, dict[str, Any]] = {}
    states = opt.shard_states()
    if any(states):
        for s, lo, hi, coff in opt.owned_pieces():
            st = states[s.bucket]
            for k in STATE_KEYS:
                key = f"optim.{s.name}.{k}"
                tensors[key] = st[k][coff : coff + hi - lo].detach().clone()
                slices[key] = {"full_shape": [s.numel], "offsets": [lo], "shape": [hi - lo]}
    hyper = opt.hyperparameters()
    meta = {
        "format": ZERO_META_FORMAT,
        "optimizer": "AdamW",
        "zero_stage": opt.stage,
        "dp_size": opt.size,
        "dp_rank": opt.rank,
        "step": opt.step_count(),
        "hyper": {k: (list(v) if isinstance(v, tuple) else v) for k, v in hyper.items() if _jsonable(v)},
        "param_shapes": {name: list(p.shape) for name, p in opt.named_params},
        "param_order": opt.parameter_names(),
    }
    return tensors, slices, meta


def gather_full_state(opt: ZeroOptimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Collective over the DP group: the unsharded state as ``flatten_optimizer_state`` of a plain AdamW.

    The result loads into ``torch.optim.AdamW(model.parameters(), foreach=False)`` with
    ``kuangchao_core.parallel.optim_state.load_optimizer_state`` (names as given to this optimizer).
    """
    full: dict[str, dict[str, torch.Tensor]] = {}
    states = opt.shard_states()
    if any(states):
        for b, bk in enumerate(opt.buckets):
            for k in STATE_KEYS:
                mine = states[b][k].detach().clone()
                if opt.size > 1:
                    parts = comm.all_gather(None, mine, group=opt.group)
                    whole = torch.cat(parts)
                else:
                    whole = mine
                for s in bk.slots:
                    full.setdefault(s.name, {})[k] = whole[s.offset : s.offset + s.numel].view_as(s.param).clone()
    return _as_flat_adamw(full, opt.step_count(), opt.hyperparameters(), opt.named_params)


def load_full_state(opt: ZeroOptimizer, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
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
    mine = set(opt.parameter_names())
    if names != mine:
        raise CheckpointError(
            f"optimizer checkpoint parameters differ: only in checkpoint {sorted(names - mine)[:3]}, "
            f"only in the model {sorted(mine - names)[:3]}"
        )
    for k in ("lr", "eps", "betas"):
        if k in groups[0]:
            v = groups[0][k]
            opt.optimizer.param_groups[0][k] = tuple(v) if isinstance(v, list) else v
    if "weight_decay" in groups[0]:
        opt.set_weight_decay(groups[0]["weight_decay"])
    state_keys = meta.get("state_keys", {})
    opt.optimizer.state.clear()
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
            **{k: torch.zeros(bk.chunk, dtype=opt.dtype, device=opt.device) for k in STATE_KEYS},
        }
        for bk in opt.buckets
    ]
    for s, lo, hi, coff in opt.owned_pieces():
        for k in STATE_KEYS:
            key = f"optim.{s.name}.{k}"
            if key not in tensors:
                raise CheckpointError(f"optimizer state tensor {key} is missing from the checkpoint")
            src = tensors[key].reshape(-1)
            if src.numel() != s.numel:
                raise CheckpointError(f"{key} has {src.numel()} elements, the parameter has {s.numel}")
            new[s.bucket][k][coff : coff + hi - lo].copy_(src[lo:hi])
    for sp, st in zip(opt.shard_params, new, strict=True):
        opt.optimizer.state[sp] = st


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
            full[name] = {k: torch.zeros(numel, dtype=dtype) for k in STATE_KEYS}
            covered[name] = torch.zeros(numel, dtype=torch.bool)
        for tensors, slices, _ in shards:
            for key, t in tensors.items():
                name, k = key.removeprefix("optim.").rsplit(".", 1)
                sl = slices[key]
                lo = int(sl["offsets"][0])
                full[name][k][lo : lo + t.numel()].copy_(t.reshape(-1))
                if k == STATE_KEYS[0]:
                    covered[name][lo : lo + t.numel()] = True
        holes = [n for n, c in covered.items() if not bool(c.all())]
        if holes:
            raise CheckpointError(
                f"ZeRO shards do not cover {len(holes)} parameters (first {holes[0]}); "
                f"got {len(shards)} shards of dp_size {meta0.get('dp_size')}: pass every rank's shard"
            )
        for name in order:
            for k in STATE_KEYS:
                full[name][k] = full[name][k].view(shapes[name])
    return _as_flat_adamw(full, float(meta0.get("step", 0.0)), meta0.get("hyper", {}), [(n, shapes[n]) for n in order])


@contextlib.contextmanager
def full_masters(opt: ZeroOptimizer, writeback: bool) -> Iterator[None]:
    """Collective: inside the block the trainable parameters of ``opt`` (ZeRO-1/2 with masters) hold the full fp32
    masters (gathered; what checkpoints save and load); with ``writeback`` each rank keeps its chunk of what was
    written, rounded into the parameters."""
    fulls = []
    with torch.no_grad():
        for b, bk in enumerate(opt.buckets):
            full = torch.empty(bk.size, dtype=opt.dtype, device=opt.device)
            if opt.size > 1:
                comm.all_gather(list(full.split(bk.chunk)), opt._param_chunk(b).clone(), group=opt.group)
            else:
                full.copy_(opt._param_chunk(b))
            fulls.append(full)
            for s in bk.slots:
                s.param.data = full[s.offset : s.offset + s.numel].view_as(s.param)
    try:
        yield
    finally:
        with torch.no_grad():
            for b, bk in enumerate(opt.buckets):
                if writeback:
                    opt._param_chunk(b).copy_(fulls[b][opt.rank * bk.chunk : (opt.rank + 1) * bk.chunk])
                    opt.flat_params[bk.start : bk.start + bk.size].copy_(fulls[b])
                for s in bk.slots:
                    view = opt.flat_params[bk.start + s.offset : bk.start + s.offset + s.numel]
                    s.param.data = view.view_as(s.param)
