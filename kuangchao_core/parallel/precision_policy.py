"""How a job stores its parameters, reduces its gradients and keeps master weights (issue 43 item 2): a policy
the optimizers are given, not a class per precision.

``train.param_dtype: bf16`` (issue 29 item 1) is :func:`precision_policy`'s ``PrecisionPolicy(bf16, reduce, fp32)``.
The model is built and initialised in fp32 as for any job; its GradSync's optimizer (one class per ZeRO stage:
``ReplicatedAdamW``, ``ZeroOptimizer``, ``Zero3Optimizer``, ``LoraZero3Optimizer`` for a frozen LoRA base) copies
the trainable parameters into fp32 masters (sharded under ZeRO-1/2/3, replicated without ZeRO) and then turns every
parameter of the model into bf16 (:func:`cast_parameters`). From then on:

- forward and backward run on the bf16 parameters (under bf16 autocast, so norms, softmax and the loss are fp32),
  so the gradients the model produces are bf16;
- each backward's bf16 gradient is added into an fp32 gradient at once (Megatron-Core's ``main_grad``, FSDP2's
  fp32 ``reduce_dtype``), so the micro-batches of a step (``grad_accum`` > 1, every pipeline schedule) are summed
  in fp32, never in bf16: zero_stage 0 and ZeRO-1 keep a full fp32 gradient buffer (the parameter's hook adds into
  its slot and drops the bf16 ``param.grad``), ZeRO-2 adds each micro-batch's reduce-scattered buckets into its
  fp32 gradient shard, ZeRO-3 each micro-batch's reduced unit;
- the gradients are reduced over data parallelism in ``reduce_dtype`` (fp32; ``parallel.grad_reduce_dtype: bf16``
  sums them in bf16, at every ZeRO stage), clipped and handed to AdamW as fp32 gradients of the fp32 masters;
- AdamW (fp32 moments) updates the masters, and each master is rounded into its bf16 parameter after every step.

A master absorbs updates far below a bf16 parameter's resolution (2^-8 of its value), which an update applied to
the bf16 parameter itself would lose. Checkpoints hold the masters as ``param.<name>`` (``full_parameters`` shows
the fp32 masters in the model's parameters), so a checkpoint is the same as an fp32 job's and resumes bitwise.
Without masters (the default policy) the parameters are what AdamW steps, in their own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kuangchao_core.config.settings import GradSyncSettings

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class PrecisionPolicy:
    """``param_dtype``: what the model's parameters are stored in (None: as built); ``reduce_dtype``: what DP sums
    gradients in (None: the gradients' own dtype); ``master_dtype``: the dtype of the master weights AdamW steps
    (None: no masters, AdamW steps the parameters themselves)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None

    @property
    def masters(self) -> bool:
        """Whether the optimizer keeps master weights apart from the parameters."""
        return self.master_dtype is not None

    def formula_dtypes(self, item_bytes: int) -> tuple[str, str | None]:
        """``(dtype, param_dtype)`` of :func:`~kuangchao_core.parallel.state_memory.zero_formula` for an optimizer
        whose master (or parameter) elements take ``item_bytes``."""
        if not self.masters:
            return ("fp64" if item_bytes == 8 else "fp32"), None
        name = next(k for k, v in DTYPES.items() if v == self.param_dtype)
        return name, name


def precision_policy(par: GradSyncSettings) -> PrecisionPolicy:
    """The job's policy from ``train.param_dtype`` and ``parallel.grad_reduce_dtype`` (which the policy carries
    for bf16 parameters only: zero_stage 0 of fp32 parameters sums in bf16 through its bucket compressor, and ZeRO
    of fp32 parameters does not use it)."""
    if par.param_dtype == "bf16":
        return PrecisionPolicy(torch.bfloat16, DTYPES[par.grad_reduce_dtype], torch.float32)
    return PrecisionPolicy()


@torch.no_grad()
def cast_parameters(model: torch.nn.Module, policy: PrecisionPolicy) -> None:
    """Under a policy with masters, every parameter of ``model`` still in the master dtype becomes ``param_dtype``
    (in place: the same Parameter objects; buffers, such as the rotary tables, keep their dtype)."""
    if not policy.masters:
        return
    for p in model.parameters():
        if p.dtype == policy.master_dtype:
            p.data = p.data.to(policy.param_dtype)
