"""One gradient-synchronisation interface for the engine (SPEC L3.1, L3.5): replicated AdamW or ZeRO.

The trainer holds one :class:`GradSync` and never asks which kind it is:

- :class:`ReplicatedAdamW`: :class:`~kuangchao_core.parallel.data.DataParallel` (bucketed all-reduce during
  backward) and a plain ``torch.optim.AdamW`` on every DP replica;
- :class:`ShardedAdamW`: :class:`~kuangchao_core.parallel.zero.ZeroOptimizer` (ZeRO-1/2: reduce-scatter, AdamW on
  this rank's shard, all-gather) or :class:`~kuangchao_core.parallel.zero3.Zero3Optimizer` (ZeRO-3: parameters
  sharded too, gathered per block for its forward and backward; a frozen LoRA base as well: ``zero3_lora``).

Both clip with the global gradient norm over every group of the mesh, each element counted once (``norm_weight``:
1 / number of TP ranks holding the same region), and both give their optimizer state for a checkpoint as
``optim.<name>.exp_avg|exp_avg_sq`` tensors with slice metadata, so a checkpoint of either loads into the other.
:func:`make_grad_sync` picks the implementation from ``parallel.zero_stage``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kuangchao_core.comm import primitives as comm
from kuangchao_core.config.settings import GradSyncSettings
from kuangchao_core.errors import CheckpointError
from kuangchao_core.hal.dtypes import adamw_kernel
from kuangchao_core.parallel.bucket_reduce import BucketReducer
from kuangchao_core.parallel.data import DataParallel
from kuangchao_core.parallel.grad_compression import make_compressor
from kuangchao_core.parallel.grad_sync_protocol import GradSync
from kuangchao_core.parallel.precision_policy import PrecisionPolicy, cast_parameters, precision_policy
from kuangchao_core.parallel.weight_decay import decays, param_groups
from kuangchao_core.parallel.zero import ZeroOptimizer
from kuangchao_core.parallel.zero3 import Zero3Optimizer, block_units
from kuangchao_core.parallel.zero3_lora import LoraZero3Optimizer

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the optimizer updates (LoRA freezes the base: only its adapters)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _sum_over(t: torch.Tensor, *groups: Any) -> torch.Tensor:
    for group in groups:
        if group is not None and group.size > 1:
            comm.all_reduce(t, group=group, op="sum")
    return t


def _model_bytes(model: torch.nn.Module) -> tuple[int, int, int]:
    """Bytes of the model's trainable parameters, its frozen ones (a LoRA base) and the gradients it holds."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return trainable, frozen, grads


def _apply_clip(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scale by ``min(1, max_norm / (total + 1e-6))`` on the device (×1 leaves a gradient bitwise unchanged)."""
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)


class ReplicatedAdamW:
    """Data parallel with a full AdamW on every replica (``parallel.zero_stage: 0``).

    Under a master policy (``train.param_dtype: bf16``) AdamW steps fp32 copies of the trainable parameters (built
    while the model is fp32, which then becomes bf16) and the DataParallel buckets are fp32 main gradients
    (``main_grads=True``, one DP rank too): every backward's bf16 gradient is added into its parameter's fp32 slot
    and dropped, the buckets are all-reduced (with ``grad_reduce_dtype`` bf16 the sum travels in bf16), and the
    masters' gradients are the buckets' fp32 views; after each step the masters are rounded into the parameters.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        groups: Any,
        norm_weight: dict[str, float],
        hyper: dict,
        bucket_mb: float,
        compressor: Any = None,
        exclude: tuple[str, ...] = (),
        policy: PrecisionPolicy = PrecisionPolicy(),
    ):
        self.model = model
        self.groups = groups
        self.norm_weight = norm_weight
        self.policy = policy
        self.named = _trainable(model)
        self.masters = {}  # name -> its master, under a master policy
        if policy.masters:
            self.masters = {n: torch.nn.Parameter(p.detach().to(policy.master_dtype).clone()) for n, p in self.named}
        self.stepped = self.masters or dict(self.named)  # what AdamW steps, by name
        cast_parameters(model, policy)
        self.reducer = BucketReducer(groups.replicas, groups.intra, groups.inter, compressor)
        self.dp = DataParallel(
            model, groups.replicas, bucket_mb, policy.master_dtype, self.reducer, policy.masters, groups.apart
        )
        hyper = dict(hyper)
        params = list(self.stepped.values())
        groups = param_groups(list(self.stepped.items()), hyper.pop("weight_decay"), exclude)
        self.optimizer = torch.optim.AdamW(groups, **adamw_kernel(params), **hyper)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The AdamW param groups (set ``lr`` here)."""
        return self.optimizer.param_groups

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """See :meth:`GradSync.no_sync`."""
        return self.dp.no_sync()

    def zero_grad(self) -> None:
        """See :meth:`GradSync.zero_grad`: the model's gradients, the buckets (and the masters' gradients)."""
        self.dp.zero_grad()
        for m in self.masters.values():
            m.grad = None

    def finish(self, accumulated: bool = False) -> None:
        """See :meth:`GradSync.finish`; masters get the reduced buckets' fp32 views as their gradients."""
        if accumulated:
            self.dp.sync_accumulated()
        else:
            self.dp.finish_gradient_sync()
        for name, p in self.named if self.masters else ():
            self.stepped[name].grad = self.dp.main_grad(p)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """See :meth:`GradSync.clip_grad_norm`; without TP, PP and masters, ``torch.nn.utils.clip_grad_norm_``."""
        g = self.groups
        if g.tp_group.size == 1 and g.pp_group.size == 1 and not self.masters and not g.norm_groups:
            params = [p for p in self.model.parameters() if p.grad is not None]
            if max_norm > 0:
                return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
            return torch.nn.utils.get_total_norm([p.grad for p in params])
        total = _sum_over(self.grad_norm_sq(), g.tp_group, g.pp_group, *g.norm_groups).sqrt()
        _apply_clip(self.local_grads(), total, max_norm)
        return total

    def grad_norm_sq(self) -> torch.Tensor:
        """See :meth:`GradSync.grad_norm_sq`: every gradient AdamW reads (all replicas hold the same)."""
        sq = torch.zeros((), dtype=torch.float64, device=next(self.model.parameters()).device)
        for name, p in self.stepped.items():
            if p.grad is not None:
                sq += p.grad.double().pow(2).sum() * self.norm_weight[name]
        return sq

    @torch.no_grad()
    def step(self) -> None:
        """See :meth:`GradSync.step` (masters rounded into the parameters after AdamW)."""
        self.optimizer.step()
        self._round_into_params()

    def local_grads(self) -> list[torch.Tensor]:
        """See :meth:`GradSync.local_grads`."""
        return [p.grad for p in self.stepped.values() if p.grad is not None]

    def prepare(self) -> None:
        """Broadcast DP rank 0's parameters (and masters) to the other replicas."""
        self.dp.sync_parameters()
        if self.masters and (replicas := self.groups.replicas).size > 1:
            with torch.no_grad():
                flat = torch.cat([m.detach().reshape(-1) for m in self.masters.values()])
                comm.broadcast(flat, src=replicas.ranks[0], group=replicas)
                torch.nn.utils.vector_to_parameters(flat, list(self.masters.values()))
        self._round_into_params()

    @torch.no_grad()
    def _round_into_params(self) -> None:
        for name, p in self.named if self.masters else ():
            p.copy_(self.stepped[name])

    def checkpoint_tensors(self, regions: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The first DP replica's AdamW moments (a parameter held apart: its group's first), sliced like them."""
        tensors: dict[str, torch.Tensor] = {}
        slices: dict[str, Any] = {}
        for name, p in self.stepped.items():
            st = (
                self.optimizer.state.get(p) or {} if self.groups.apart.get(name, self.groups.replicas).rank == 0 else {}
            )
            for key in ADAM_KEYS:
                if key in st:
                    tensors[f"optim.{name}.{key}"] = st[key].detach().cpu().clone()
                    slices[f"optim.{name}.{key}"] = regions[name].to_meta()
        return tensors, slices

    def load_state(self, optim: dict[str, torch.Tensor], steps: int) -> None:
        """See :meth:`GradSync.load_state`."""
        for name, p in self.stepped.items():
            self.optimizer.state[p] = {
                "step": torch.tensor(float(steps), dtype=torch.float32),
                "exp_avg": optim[f"optim.{name}.exp_avg"].to(p.dtype).clone(),
                "exp_avg_sq": optim[f"optim.{name}.exp_avg_sq"].to(p.dtype).clone(),
            }

    def state_tensors(self) -> list[torch.Tensor]:
        """See :meth:`GradSync.state_tensors` (the masters are counted by :meth:`tensor_bytes`)."""
        return [v for st in self.optimizer.state.values() for k, v in st.items() if torch.is_tensor(v) and k != "step"]

    def memory_report(self) -> None:
        """See :meth:`GradSync.memory_report`: none (:meth:`tensor_bytes` counts what the rank holds)."""
        return None

    def tensor_bytes(self) -> dict[str, int]:
        """See :meth:`GradSync.tensor_bytes`: the model's parameters and gradients, and AdamW's moments; under
        masters the fp32 gradient buckets too, and the masters as ``optimizer``."""
        trainable, frozen, grads = _model_bytes(self.model)
        optim = sum(t.numel() * t.element_size() for t in self.state_tensors())
        if self.masters:
            grads += sum(b.buffer.numel() * b.buffer.element_size() for b in self.dp._buckets)
            optim += sum(m.numel() * m.element_size() for m in self.masters.values())
        return {"params": trainable + frozen, "grads": grads, "optimizer": optim}

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[None]:
        """See :meth:`GradSync.full_parameters`: every replica always holds the full parameters; under masters the
        trainable ones hold their fp32 masters inside the block (what checkpoints save and load), and with
        ``writeback`` what was written stays in the masters and is rounded into the parameters."""
        kept = {name: p.data for name, p in self.named}
        for name, p in self.named if self.masters else ():
            p.data = self.stepped[name].data
        try:
            yield
        finally:
            for name, p in self.named if self.masters else ():
                p.data = kept[name]
            if writeback:
                self._round_into_params()

    def comm_state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's gradient-compression state (top-k residuals), saved per rank with the checkpoint."""
        return self.reducer.state_tensors()

    def load_comm_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`comm_state_tensors`."""
        self.reducer.load_state_tensors(tensors)


class ShardedAdamW:
    """ZeRO-1/2/3 over the DP group (``parallel.zero_stage: 1|2|3``), with or without TP (and PP at 1/2)."""

    def __init__(
        self,
        model: torch.nn.Module,
        groups: Any,
        norm_weight: dict[str, float],
        hyper: dict,
        bucket_mb: float,
        stage: int,
        exclude: tuple[str, ...] = (),
        policy: PrecisionPolicy = PrecisionPolicy(),
    ):
        self.model = model
        self.groups = groups
        self.norm_weight = norm_weight
        named = _trainable(model)
        self.names = [n for n, _ in named]
        hyper = {**hyper, "no_decay": [n for n, p in named if not decays(n, p.shape, exclude)], "policy": policy}
        if stage == 3:
            frozen = any(not p.requires_grad for p in model.parameters())  # a LoRA base, sharded beside the adapters
            zero3 = LoraZero3Optimizer if frozen else Zero3Optimizer
            units = block_units(model)
            checkpointed = getattr(model, "activation_checkpointing", "none") != "none"
            recomputed = [i for i, u in enumerate(units) if checkpointed and u in set(model.model.layers)]
            self.optimizer = zero3(model, units, groups.replicas, recomputed, **hyper)
        else:
            self.optimizer = ZeroOptimizer(named, groups.replicas, stage=stage, bucket_cap_mb=bucket_mb, **hyper)
        cast_parameters(model, policy)  # the optimizer took the fp32 values as its masters

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner AdamW's param groups (set ``lr`` here)."""
        return self.optimizer.param_groups

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """See :meth:`GradSync.no_sync`."""
        return self.optimizer.no_sync()

    def zero_grad(self) -> None:
        """See :meth:`GradSync.zero_grad`."""
        self.optimizer.zero_grad()

    def finish(self, accumulated: bool = False) -> None:
        """See :meth:`GradSync.finish` (ZeRO reduces what is left either way)."""
        self.optimizer.finish_gradient_sync()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Sum of squares over the owned pieces of the shards, weighted per TP replication, over dp×tp×pp."""
        g = self.groups
        total = _sum_over(self.grad_norm_sq(), g.replicas, g.tp_group, g.pp_group).sqrt()
        _apply_clip(self.optimizer.grad_shards(), total, max_norm)
        return total

    def grad_norm_sq(self) -> torch.Tensor:
        """See :meth:`GradSync.grad_norm_sq`: the gradient elements this rank's shards own."""
        return self.optimizer.grad_norm_sq(self.norm_weight)

    def step(self) -> None:
        """See :meth:`GradSync.step`."""
        self.optimizer.step()

    def local_grads(self) -> list[torch.Tensor]:
        """See :meth:`GradSync.local_grads`: this rank's gradient shards."""
        self.optimizer.finish_gradient_sync()
        return list(self.optimizer.grad_shards())

    def prepare(self) -> None:
        """Nothing to do: ZeRO broadcast rank 0's parameters when it was built and all-gathers after every step."""

    def checkpoint_tensors(self, regions: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Each rank's flat ranges without TP; under TP (a ZeRO range of a TP slice has no slice description) the
        state gathered over DP and saved per TP slice by the first DP replica."""
        if self.groups.tp_group.size == 1:
            tensors, slices, _ = self.optimizer.state_dict_for_checkpoint()
            return tensors, slices
        full, _ = self.optimizer.full_state_dict()
        tensors: dict[str, torch.Tensor] = {}
        slices: dict[str, Any] = {}
        if self.groups.replicas.rank == 0:
            for name in self.names:
                for key in ADAM_KEYS:
                    k = f"optim.{name}.{key}"
                    if k in full:
                        tensors[k] = full[k].detach().cpu().clone()
                        slices[k] = regions[name].to_meta()
        return tensors, slices

    def load_state(self, optim: dict[str, torch.Tensor], steps: int) -> None:
        """See :meth:`GradSync.load_state`."""
        names = self.names
        tensors = {f"optim.{n}.{k}": optim[f"optim.{n}.{k}"] for n in names for k in ADAM_KEYS}
        tensors.update({f"optim.{n}.step": torch.tensor(float(steps)) for n in names})
        meta = {
            "format": 1,
            "optimizer": "AdamW",
            "param_groups": [{"param_names": names}],
            "state_keys": {n: ["exp_avg", "exp_avg_sq", "step"] for n in names},
            "state_scalars": {},
        }
        self.optimizer.load_full_state(tensors, meta)

    def state_tensors(self) -> list[torch.Tensor]:
        """See :meth:`GradSync.state_tensors`."""
        return self.optimizer.state_tensors()

    def memory_report(self) -> dict[str, Any]:
        """The ZeRO optimizer's measured and formula bytes per rank."""
        return self.optimizer.memory_report()

    def tensor_bytes(self) -> dict[str, int]:
        """See :meth:`GradSync.tensor_bytes`: ZeRO's flat buffers and shards (a LoRA base's at ZeRO-3), plus a
        frozen LoRA base it does not hold (below ZeRO-3)."""
        measured = self.optimizer.memory_report()["measured"]
        _, frozen, _ = _model_bytes(self.model)
        return {
            "params": measured["params"] + frozen,
            "grads": measured["grads"],
            "optimizer": measured["optimizer_state"],
        }

    def full_parameters(self, writeback: bool = False) -> contextlib.AbstractContextManager[None]:
        """See :meth:`GradSync.full_parameters` (ZeRO-3 gathers; at stages 1/2 the parameters are always full)."""
        return self.optimizer.full_parameters(writeback)

    def comm_state_tensors(self) -> dict[str, torch.Tensor]:
        """See :meth:`GradSync.comm_state_tensors`: none (ZeRO's exchange is uncompressed, so it keeps no state)."""
        return {}

    def load_comm_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """See :meth:`GradSync.load_comm_state_tensors`: there is nothing to restore; state offered is an error."""
        if tensors:
            raise CheckpointError(
                f"gradient-exchange state {sorted(tensors)[:3]} offered to ZeRO, which keeps none "
                "(parallel.grad_compression works only with parallel.zero_stage 0)"
            )


def make_grad_sync(par: GradSyncSettings, model: torch.nn.Module, groups: Any, norm_weight: dict) -> GradSync:
    """The implementation ``parallel.zero_stage`` asks for, reducing over ``groups`` (``mesh.ReduceGroups``)."""
    hyper = {"lr": par.lr, "betas": tuple(par.betas), "eps": par.eps, "weight_decay": par.weight_decay}
    exclude = tuple(par.weight_decay_exclude)
    stage = int(par.zero_stage)  # ZeRO-3 under pp: each stage's units over its DP group
    policy = precision_policy(par)  # bf16 parameters: fp32 master weights held by the optimizer (issue 29, 43)
    if stage:
        return ShardedAdamW(model, groups, norm_weight, hyper, par.bucket_size_mb, stage, exclude, policy)
    kind = par.grad_compression
    if kind == "none" and par.grad_reduce_dtype == "bf16":
        kind = "bf16"  # the same exchange: buckets summed in bfloat16
    compressor = make_compressor(kind, par.topk_ratio, par.topk_warmup_steps) if groups.replicas.size > 1 else None
    return ReplicatedAdamW(model, groups, norm_weight, hyper, par.bucket_size_mb, compressor, exclude, policy)


def require_full_state(optim: dict[str, torch.Tensor], names: list[str], where: str) -> bool:
    """Whether ``optim`` holds AdamW moments for every parameter (False when it holds none: moments start from
    zero); raises CheckpointError when only some are there."""
    have = [n for n in names if all(f"optim.{n}.{k}" in optim for k in ADAM_KEYS)]
    if not have:
        return False
    if len(have) != len(names):
        missing = sorted(set(names) - set(have))[:3]
        raise CheckpointError(f"{where}: optimizer state missing for {missing}")
    return True


@contextlib.contextmanager
def maybe_no_sync(sync: GradSync, last: bool) -> Iterator[None]:
    """``sync.no_sync()`` except for the last micro-batch of a step, whose backward communicates."""
    if last:
        yield
    else:
        with sync.no_sync():
            yield
