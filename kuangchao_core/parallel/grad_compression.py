"""Gradient compression for the data-parallel exchange (SPEC L2.6): ``parallel.grad_compression``.

A compressor replaces the sum of one flat gradient tensor over a group (the cross-node step of a hierarchical
all-reduce, or the whole DP group when the reduction is flat):

- ``fp16`` / ``bf16``: the tensor travels in 16 bits (half the bytes) and is summed in that type, then cast back.
  fp16 keeps 11 significant bits and flushes magnitudes below ~6e-8 to zero; bf16 keeps fp32's range with 8 bits.
- ``topk``: each member sends only the ``k = ceil(ratio · numel)`` entries of largest magnitude as (int32 index,
  value) pairs, all-gathered over the group and summed into a dense tensor (every member adds the same pairs in
  the same order, so replicas stay identical). **Error feedback** (Seide et al. 2014; Lin et al., *Deep Gradient
  Compression*, 2018): what was not sent is kept as a residual and added to the next step's gradient, so every
  gradient is applied eventually — the applied updates' running sum differs from the dense one by exactly the
  current residual. The ratio warms up geometrically from dense to ``ratio`` over ``topk_warmup_steps``
  (``ratio^(t/W)``), as DGC does, so the first steps are not starved. Residuals and step counts are part of the
  checkpoint (:meth:`TopKCompressor.state_tensors`), so a resume continues bitwise.

Bytes sent per member and step are counted in ``bytes_sent`` (for the benchmark's byte ratio).
"""

from __future__ import annotations

import math

import torch

from kuangchao_core.comm import primitives as P
from kuangchao_core.errors import ConfigError

COMPRESSIONS = ("none", "fp16", "bf16", "topk")


class CastCompressor:
    """Sum in a 16-bit type (``fp16`` or ``bf16``)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.dtype = torch.float16 if kind == "fp16" else torch.bfloat16
        self.bytes_sent = 0

    def exchange(self, key: int, t: torch.Tensor, group) -> torch.Tensor:
        """The sum of ``t`` over ``group`` (``key``: the bucket, unused here)."""
        low = t.to(self.dtype)
        self.bytes_sent += low.nbytes
        P.all_reduce(low, group=group, op="sum")
        return low.to(t.dtype)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """No state."""
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """No state."""


class TopKCompressor:
    """Top-k sparsification with error feedback; one residual per bucket ``key``."""

    kind = "topk"

    def __init__(self, ratio: float, warmup_steps: int = 0):
        if not 0 < ratio <= 1:
            raise ConfigError([("parallel.topk_ratio", f"must be in (0, 1], got {ratio}")])
        self.ratio = float(ratio)
        self.warmup_steps = int(warmup_steps)
        self.residual: dict[int, torch.Tensor] = {}
        self.steps: dict[int, int] = {}
        self.bytes_sent = 0

    def ratio_at(self, step: int) -> float:
        """The ratio used at exchange number ``step`` (0-based) of a bucket: ``ratio^(min(step, W)/W)``."""
        if self.warmup_steps <= 0 or step >= self.warmup_steps:
            return self.ratio
        return self.ratio ** (step / self.warmup_steps)

    def exchange(self, key: int, t: torch.Tensor, group) -> torch.Tensor:
        """The sum over ``group`` of every member's top-k entries of ``t`` + its residual; keeps the new residual."""
        step = self.steps.get(key, 0)
        acc = t + self.residual[key] if key in self.residual else t.clone()
        k = max(1, min(acc.numel(), math.ceil(self.ratio_at(step) * acc.numel())))
        idx = torch.topk(acc.abs(), k, sorted=False).indices
        vals = acc[idx]
        acc[idx] = 0
        self.residual[key] = acc
        self.steps[key] = step + 1
        idx32 = idx.to(torch.int32)
        self.bytes_sent += idx32.nbytes + vals.nbytes
        all_idx = P.all_gather(None, idx32, group=group)
        all_vals = P.all_gather(None, vals, group=group)
        out = torch.zeros_like(t)
        for i, v in zip(all_idx, all_vals, strict=True):  # group order: the same additions on every member
            out.index_add_(0, i.long(), v)
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Residuals (``b<key>.residual``) and exchange counts (``b<key>.steps``) for the checkpoint."""
        out: dict[str, torch.Tensor] = {}
        for key, r in self.residual.items():
            out[f"b{key}.residual"] = r.detach().clone()
            out[f"b{key}.steps"] = torch.tensor([self.steps.get(key, 0)], dtype=torch.int64)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_tensors` gave."""
        self.residual.clear()
        self.steps.clear()
        for name, value in tensors.items():
            key_s, _, what = name.partition(".")
            key = int(key_s.removeprefix("b"))
            if what == "residual":
                self.residual[key] = value.clone()
            elif what == "steps":
                self.steps[key] = int(value.reshape(-1)[0])


def make_compressor(kind: str, ratio: float = 0.01, warmup_steps: int = 0):
    """The compressor for ``parallel.grad_compression`` (None for ``none``)."""
    if kind == "none":
        return None
    if kind in ("fp16", "bf16"):
        return CastCompressor(kind)
    if kind == "topk":
        return TopKCompressor(ratio, warmup_steps)
    raise ConfigError([("parallel.grad_compression", f"{kind!r}: use one of {', '.join(COMPRESSIONS)}")])
