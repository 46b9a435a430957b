"""bf16 parameters with fp32 master weights held by the optimizer (``train.param_dtype: bf16``, issue 29 item 1).

The model is built and initialised in fp32 as for any job; the job's :class:`~kuangchao_core.parallel.grad_sync.
GradSync` copies the trainable parameters into fp32 master weights (sharded under ZeRO-1/2/3, replicated without
ZeRO), then turns every parameter of the model into bf16 (:func:`to_bf16_parameters`). From then on:

- forward and backward run on the bf16 parameters (under bf16 autocast, so norms, softmax and the loss are fp32),
  so the gradients the model produces are bf16;
- each backward's bf16 gradient is added into an fp32 gradient at once (Megatron-Core's ``main_grad``, FSDP2's
  fp32 ``reduce_dtype``), so the micro-batches of a step (``grad_accum`` > 1, every pipeline schedule) are summed
  in fp32, never in bf16: zero_stage 0 and ZeRO-1 keep a full fp32 gradient buffer (the parameter's hook adds into
  its slot and drops the bf16 ``param.grad``), ZeRO-2 adds each micro-batch's reduce-scattered buckets into its
  fp32 gradient shard (:mod:`~kuangchao_core.parallel.zero_master`), ZeRO-3 each micro-batch's reduced unit;
- the gradients are reduced over data parallelism in fp32 (``parallel.grad_reduce_dtype: bf16``: summed in bf16,
  at every ZeRO stage), clipped and handed to AdamW as fp32 gradients of the fp32 masters;
- AdamW (fp32 moments) updates the masters, and each master is rounded into its bf16 parameter after every step.

A master absorbs updates far below a bf16 parameter's resolution (2^-8 of its value), which an update applied to
the bf16 parameter itself would lose. Checkpoints hold the masters as ``param.<name>`` (``full_parameters`` shows
the fp32 masters in the model's parameters), so a checkpoint is the same as an fp32 job's and resumes bitwise.

:class:`MasterReplicatedAdamW` is the ``zero_stage: 0`` implementation;
:class:`~kuangchao_core.parallel.zero_master.MasterZeroOptimizer` and
:class:`~kuangchao_core.parallel.zero3_master.MasterZero3Optimizer` are ZeRO's (:func:`master_grad_sync` picks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kuangchao_core.comm import primitives as comm
from kuangchao_core.hal.dtypes import adamw_kernel
from kuangchao_core.parallel.bucket_reduce import BucketReducer
from kuangchao_core.parallel.data import DataParallel
from kuangchao_core.parallel.grad_compression import make_compressor
from kuangchao_core.parallel.weight_decay import param_groups

PARAM_DTYPE = torch.bfloat16
MASTER_DTYPE = torch.float32


@torch.no_grad()
def to_bf16_parameters(model: torch.nn.Module) -> None:
    """Every floating-point parameter of ``model`` still in fp32 becomes bf16 (in place: the same Parameter
    objects; buffers, such as the rotary tables, keep their dtype)."""
    for p in model.parameters():
        if p.dtype == MASTER_DTYPE:
            p.data = p.data.to(PARAM_DTYPE)


def master_grad_sync(
    par: Any, model: torch.nn.Module, groups: Any, norm_weight: dict, hyper: dict, stage: int, sharded: type
) -> Any:
    """The GradSync of a bf16-parameter job at ZeRO ``stage`` (0 replicated, 1/2/3 sharded: ``sharded`` is
    ``grad_sync.ShardedAdamW``, passed in because grad_sync imports this module), built while ``model`` is still
    fp32 (its values become the masters); afterwards the model's parameters are bf16."""
    from kuangchao_core.parallel.zero3_master import MasterZero3Optimizer
    from kuangchao_core.parallel.zero_master import MasterZeroOptimizer

    exclude = tuple(par.weight_decay_exclude)
    if stage:
        classes = (MasterZeroOptimizer, MasterZero3Optimizer)
        sync = sharded(model, groups, norm_weight, hyper, par.bucket_size_mb, stage, exclude, classes)
        if par.grad_reduce_dtype == "bf16":
            sync.optimizer.reduce_dtype = PARAM_DTYPE
    else:
        sync = MasterReplicatedAdamW(
            model, groups, norm_weight, hyper, par.bucket_size_mb, par.grad_reduce_dtype, exclude
        )
    to_bf16_parameters(model)
    return sync


class MasterReplicatedAdamW:
    """Data parallel with bf16 parameters and an fp32 master copy plus AdamW on every replica (``zero_stage: 0``).

    Gradient buckets are fp32 main gradients (``DataParallel(main_grads=True)``, one DP rank too): every
    backward's bf16 gradient is added into its parameter's fp32 slot and dropped, the buckets are all-reduced as
    they are (with ``grad_reduce_dtype`` bf16 the sum travels in bf16), and the masters' gradients are the
    buckets' fp32 views. Per parameter: 2 bytes (bf16) + 4 (fp32 gradient) + 12 (fp32 master and moments).
    """

    def __init__(self, model, groups, norm_weight, hyper: dict, bucket_mb: float, reduce_dtype: str, exclude=()):
        self.model = model
        self.groups = groups
        self.norm_weight = norm_weight
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.masters = {n: torch.nn.Parameter(p.detach().to(MASTER_DTYPE).clone()) for n, p in self.named}
        to_bf16_parameters(model)
        replicas = groups.replicas
        compressor = make_compressor("bf16", 0.0, 0) if reduce_dtype == "bf16" and replicas.size > 1 else None
        self.reducer = BucketReducer(replicas, groups.intra, groups.inter, compressor)
        self.dp = DataParallel(
            model, replicas, bucket_mb, grad_dtype=MASTER_DTYPE, reducer=self.reducer, main_grads=True
        )
        hyper = dict(hyper)
        groups = param_groups(list(self.masters.items()), hyper.pop("weight_decay"), exclude)
        self.optimizer = torch.optim.AdamW(groups, **adamw_kernel(list(self.masters.values())), **hyper)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The AdamW param groups over the masters (set ``lr`` here)."""
        return self.optimizer.param_groups

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """See :meth:`GradSync.no_sync`."""
        return self.dp.no_sync()

    def zero_grad(self) -> None:
        """See :meth:`GradSync.zero_grad`: the model's gradients, the buckets and the masters' gradients."""
        self.dp.zero_grad()
        for m in self.masters.values():
            m.grad = None

    def finish(self, accumulated: bool = False) -> None:
        """Reduce the fp32 buckets, then hand their fp32 views (the averaged sums) to the masters."""
        if accumulated:
            self.dp.sync_accumulated()
        else:
            self.dp.finish_gradient_sync()
        for name, p in self.named:
            self.masters[name].grad = self.dp.main_grad(p)

    def local_grads(self) -> list[torch.Tensor]:
        """See :meth:`GradSync.local_grads`: the masters' fp32 gradients."""
        return [m.grad for m in self.masters.values() if m.grad is not None]

    def grad_norm_sq(self) -> torch.Tensor:
        """See :meth:`GradSync.grad_norm_sq`, over the masters' fp32 gradients."""
        sq = torch.zeros((), dtype=torch.float64, device=next(iter(self.masters.values())).device)
        for name, m in self.masters.items():
            if m.grad is not None:
                sq += m.grad.double().pow(2).sum() * self.norm_weight[name]
        return sq

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """See :meth:`GradSync.clip_grad_norm` (the global norm of the fp32 gradients over tp and pp)."""
        total = self.grad_norm_sq()
        for group in (self.groups.tp_group, self.groups.pp_group):
            if group is not None and group.size > 1:
                comm.all_reduce(total, group=group, op="sum")
        total = total.sqrt()
        if max_norm > 0:  # as grad_sync's clipping: x1 leaves a gradient bitwise unchanged
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).to(MASTER_DTYPE)
            for g in self.local_grads():
                g.mul_(coef)
        return total

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the masters, then each master rounded into its bf16 parameter."""
        self.optimizer.step()
        for name, p in self.named:
            p.copy_(self.masters[name])

    def prepare(self) -> None:
        """Broadcast DP rank 0's masters (and the frozen parameters) and round them into the parameters."""
        self.dp.sync_parameters()
        if (replicas := self.groups.replicas).size > 1:
            with torch.no_grad():
                flat = torch.cat([m.detach().reshape(-1) for m in self.masters.values()])
                comm.broadcast(flat, src=replicas.ranks[0], group=replicas)
                torch.nn.utils.vector_to_parameters(flat, list(self.masters.values()))
        self._round_into_params()

    @torch.no_grad()
    def _round_into_params(self) -> None:
        for name, p in self.named:
            p.copy_(self.masters[name])

    def checkpoint_tensors(self, regions: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The first DP replica's AdamW moments (fp32), sliced like the parameters."""
        tensors: dict[str, torch.Tensor] = {}
        slices: dict[str, Any] = {}
        if self.groups.replicas.rank != 0:
            return tensors, slices
        for name, m in self.masters.items():
            st = self.optimizer.state.get(m) or {}
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    tensors[f"optim.{name}.{key}"] = st[key].detach().cpu().clone()
                    slices[f"optim.{name}.{key}"] = regions[name].to_meta()
        return tensors, slices

    def load_state(self, optim: dict[str, torch.Tensor], steps: int) -> None:
        """See :meth:`GradSync.load_state`."""
        for name, m in self.masters.items():
            self.optimizer.state[m] = {
                "step": torch.tensor(float(steps), dtype=torch.float32),
                "exp_avg": optim[f"optim.{name}.exp_avg"].to(MASTER_DTYPE).clone(),
                "exp_avg_sq": optim[f"optim.{name}.exp_avg_sq"].to(MASTER_DTYPE).clone(),
            }

    def state_tensors(self) -> list[torch.Tensor]:
        """AdamW's moments (the masters are counted by :meth:`tensor_bytes`)."""
        return [v for st in self.optimizer.state.values() for k, v in st.items() if torch.is_tensor(v) and k != "step"]

    def memory_report(self) -> None:
        """None: no ZeRO buffers (:meth:`tensor_bytes` counts what the rank holds)."""
        return None

    def tensor_bytes(self) -> dict[str, int]:
        """The bf16 parameters, the fp32 gradient buckets (and any bf16 gradient a parameter holds), and AdamW's
        moments with the fp32 masters as ``optimizer``."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.model.parameters() if p.grad is not None)
        grads += sum(b.buffer.numel() * b.buffer.element_size() for b in self.dp._buckets)
        optim = sum(t.numel() * t.element_size() for t in self.state_tensors())
        optim += sum(m.numel() * m.element_size() for m in self.masters.values())
        return {"params": params, "grads": grads, "optimizer": optim}

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[None]:
        """Inside the block the trainable parameters hold their fp32 masters (checkpoints save and load those);
        with ``writeback`` what was written into them stays in the masters and is rounded into the parameters."""
        kept = {name: p.data for name, p in self.named}
        for name, p in self.named:
            p.data = self.masters[name].data
        try:
            yield
        finally:
            for name, p in self.named:
                p.data = kept[name]
            if writeback:
                self._round_into_params()

    def comm_state_tensors(self) -> dict[str, torch.Tensor]:
        """None: bf16 parameters run without gradient compression (a config error)."""
        return {}

    def load_comm_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Nothing to restore."""
