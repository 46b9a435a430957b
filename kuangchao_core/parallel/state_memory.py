"""Bytes of state a rank holds per parameter, by dtype choice × ZeRO stage × LoRA: the one memory model that
``kc plan``, ``kc recommend`` and the engine's own memory report (``GradSync.memory_report``) share.

What the engine allocates (``train.dtype``, ``train.param_dtype``; without bf16 parameters the model's parameters
are fp64 for ``fp64``, else fp32: ``hal.dtypes.param_dtype``), in bytes per element:

=========  ===========  =====  =====  ======  =======  =====  ===========
dtype      param_dtype  param  grad   master  moments  cast   master_grad
=========  ===========  =====  =====  ======  =======  =====  ===========
fp32       fp32         4      4      0       8        0      0
fp64       fp64         8      8      0       16       0      0
bf16       fp32         4      4      0       8        2      0
fp16       fp32         4      4      0       8        2      0
bf16       bf16         2      0      4       8        0      4
=========  ===========  =====  =====  ======  =======  =====  ===========

- *param*, *grad*: the model's parameters and their gradients. Under bf16/fp16 **autocast** the parameters stay
  fp32 — they are the master weights, so there is no separate master copy (*master* 0) — and so do the gradients.
- *moments*: AdamW's ``exp_avg`` and ``exp_avg_sq`` in the master dtype.
- *cast*: autocast's half-precision copy of every weight a matmul reads, which autograd saves for the backward:
  2 bytes per element of those weights, per micro-batch in flight (each forward runs in its own autocast region,
  so each has its own copies). It is not sharded by ZeRO: ZeRO-3 gathers a unit, autocast casts the gathered
  weights and the copies stay until the unit's backward.
- **bf16 parameters** (``train.param_dtype: bf16``, :mod:`~kuangchao_core.parallel.precision_policy`): bf16
  parameters, no casts (the weights already are bf16), and the optimizer's fp32 *master* weights and fp32
  *master_grad*, in which every backward's bf16 gradient is summed at once and dropped (*grad* 0: no bf16
  gradient is kept) — a full fp32 buffer without ZeRO and at stage 1 (whose rank's chunk is a view of it, as
  Megatron-Core's 2 + 4 + 12/N), the rank's chunk at stages 2 and 3.

ZeRO over a DP group of N ranks (:func:`state_bytes`): stage 1 divides the moments and the master copy by N;
stage 2 the gradients (and the master gradient) too; stage 3 the trainable parameters too. With LoRA the base is frozen: its
parameters have no gradients and no optimizer state and are held whole by every rank below stage 3, 1/N per rank
at stage 3 (:mod:`~kuangchao_core.parallel.zero3_lora`); the adapters are the trainable parameters. The engine runs
the stage asked for in every layout (under pipeline parallelism each stage shards over its own DP group).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of each kind of state under one dtype choice (module docstring)."""

    param: int
    grad: int
    master: int
    moments: int
    cast: int
    master_grad: int = 0


#: (train.dtype, parameter dtype) -> bytes per element: fp32 parameters, fp64 ones for fp64, and bf16 parameters
#: with fp32 master weights (``train.param_dtype: bf16``, which needs ``train.dtype: bf16``).
PRECISIONS: dict[tuple[str, str], PrecisionBytes] = {
    ("fp32", "fp32"): PrecisionBytes(param=4, grad=4, master=0, moments=8, cast=0),
    ("fp64", "fp64"): PrecisionBytes(param=8, grad=8, master=0, moments=16, cast=0),
    ("bf16", "fp32"): PrecisionBytes(param=4, grad=4, master=0, moments=8, cast=2),
    ("fp16", "fp32"): PrecisionBytes(param=4, grad=4, master=0, moments=8, cast=2),
    ("bf16", "bf16"): PrecisionBytes(param=2, grad=0, master=4, moments=8, cast=0, master_grad=4),
}


def default_param_dtype(dtype: str) -> str:
    """The dtype the engine keeps a job's parameters in: fp64 for ``fp64``, else fp32."""
    return "fp64" if dtype == "fp64" else "fp32"


def precision_bytes(dtype: str, param_dtype: str | None = None) -> PrecisionBytes:
    """Bytes per element for ``train.dtype`` ``dtype`` with parameters in ``param_dtype`` (None: the engine's
    default, :func:`default_param_dtype`); ValueError for a combination the engine does not run."""
    key = (dtype, param_dtype or default_param_dtype(dtype))
    if key not in PRECISIONS:
        known = ", ".join(f"{d}/{p}" for d, p in PRECISIONS)
        raise ValueError(
            f"no memory model for train.dtype {key[0]!r} with parameters in {key[1]!r} (the engine runs {known})"
        )
    return PRECISIONS[key]


def state_bytes(
    trainable: float,
    dp: int,
    zero_stage: int,
    dtype: str = "fp32",
    frozen: float = 0.0,
    param_dtype: str | None = None,
) -> dict[str, float]:
    """Bytes of ``params`` (trainable and ``frozen``), ``grads`` and ``optimizer`` state (moments and a master
    copy) of a rank holding ``trainable`` + ``frozen`` parameter elements, over a DP group of ``dp`` ranks at
    ``zero_stage``, under ``dtype`` (module docstring)."""
    b = precision_bytes(dtype, param_dtype)
    shard = max(1, dp)
    trainable_params = b.param * trainable / (shard if zero_stage >= 3 else 1)
    grads = (b.grad + b.master_grad) * trainable / (shard if zero_stage >= 2 else 1)
    return {
        "params": trainable_params + b.param * frozen / (shard if zero_stage >= 3 else 1),
        "grads": grads,
        "optimizer": (b.moments + b.master) * trainable / (shard if zero_stage >= 1 else 1),
    }


def cast_bytes(cast_elements: float, copies: float, dtype: str = "fp32", param_dtype: str | None = None) -> float:
    """Bytes of the half-precision weight copies autocast keeps for the backward: ``cast_elements`` (the weights a
    matmul reads whose copy autograd saves) × ``copies`` (micro-batches in flight) × the cast bytes of ``dtype``."""
    return precision_bytes(dtype, param_dtype).cast * cast_elements * copies


def zero_formula(
    trainable: float, dp: int, zero_stage: int, dtype: str, param_dtype: str | None = None
) -> dict[str, float]:
    """The ZeRO optimizer's formula bytes (``params``, ``grads``, ``optimizer_state``, ``total``) for its
    ``trainable`` elements: :func:`state_bytes` in the keys the optimizers' ``memory_report`` uses."""
    s = state_bytes(trainable, dp, zero_stage, dtype, param_dtype=param_dtype)
    return {
        "params": s["params"],
        "grads": s["grads"],
        "optimizer_state": s["optimizer"],
        "total": s["params"] + s["grads"] + s["optimizer"],
    }
