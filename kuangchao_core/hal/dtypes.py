"""Training dtypes by their config names, and the rule for where reductions are computed.

``train.dtype`` names the dtype of the parameters a job trains. ``fp64`` exists for verification: every layout
trained in float64 must equal one process to ~1e-13, far below what any CPU's fp32 kernel differences produce,
which is what the layout-equivalence suite relies on.
"""

from __future__ import annotations

import torch

#: Config name -> torch dtype of the trained parameters.
TRAIN_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp64": torch.float64,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def param_dtype(name: str) -> torch.dtype:
    """The parameter dtype for a ``train.dtype`` value (``fp32`` for the half types, whose master weights are fp32)."""
    dtype = TRAIN_DTYPES[name]
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """``torch.optim.AdamW`` implementation flags for ``params``: the fused kernel on CUDA, the multi-tensor
    (``foreach``) one elsewhere. Both are element-wise, so an element's update does not depend on how parameters are
    grouped into tensors: replicated parameters and ZeRO's flat shards round alike (the layout-equivalence and
    bitwise-resume suites rely on that)."""
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    return {"fused": True} if on_cuda else {"foreach": True}


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 when it is a lower-precision float, else unchanged (fp64 stays fp64)."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.float()
    return t
