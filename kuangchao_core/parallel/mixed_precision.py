"""Mixed precision of a job's step (``train.dtype``, SPEC RT.3): compute dtype, fp32 master weights, loss scaling.

- ``fp32`` / ``fp64``: nothing changes (the parameters' own dtype; a plain step, bit-exact with a job that knows
  nothing of mixed precision).
- ``bf16``: forwards run under ``torch.autocast`` in bfloat16 — matmuls and attention in bf16, norms, softmax and
  the loss in fp32 — while the parameters, their gradients and AdamW's moments stay fp32: the parameters are the
  master weights, so the gradients reduced over data parallelism are fp32 (``parallel.grad_reduce_dtype: bf16``
  sums them in 16 bits instead).
- ``fp16``: the same in float16, with dynamic loss scaling: the loss is multiplied by the scale before backward,
  the gradients are divided by it before clipping; a step whose gradients hold inf or nan on any rank is skipped
  by every rank (the parameters and AdamW's state stay as they were), counted, and the scale multiplied by
  ``backoff_factor`` (after ``hysteresis`` such steps); after ``growth_interval`` clean steps in a row it is
  multiplied by ``growth_factor``. Its state travels in checkpoints, so a resumed run continues bitwise.

The collective that agrees on skipping runs over every rank of the job, on the device of the gradients.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from kuangchao_core.comm import primitives as P

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss-scale settings (fp16)."""

    initial_scale: float = 2.0**16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    hysteresis: int = 1
    min_scale: float = 1.0


class MixedPrecision:
    """The step's precision policy for one rank; ``group``: every rank of the job (skips are agreed over it)."""

    def __init__(self, dtype: str, device_type: str, scaling: LossScaling | None = None, group: Any = None):
        self.compute_dtype = HALF_DTYPES.get(dtype)
        self.device_type = device_type
        self.dynamic = dtype == "fp16"
        self.scaling = scaling or LossScaling()
        self.group = group
        self.loss_scale = float(self.scaling.initial_scale) if self.dynamic else 1.0
        self.growth_tracker = 0
        self.hysteresis_left = int(self.scaling.hysteresis)
        self.skipped_steps = 0

    @property
    def enabled(self) -> bool:
        """Whether forwards run in a half dtype."""
        return self.compute_dtype is not None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a forward (and its loss) runs in: autocast to the half dtype, or nothing."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the loss scale under fp16, else ``loss`` itself."""
        return loss * self.loss_scale if self.dynamic else loss

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` (this rank's, after their reduction) by the loss scale; True when any rank's gradients
        hold inf or nan, so that every rank skips the step. Always False without loss scaling (no sync)."""
        if not self.dynamic:
            return False
        inv = 1.0 / self.loss_scale
        device = grads[0].device if grads else torch.device("cpu")
        bad = torch.zeros(1, device=device)
        for g in grads:
            g.mul_(inv)
            bad += (~torch.isfinite(g)).any().to(bad.dtype)
        if self.group is not None and self.group.size > 1:
            P.all_reduce(bad, group=self.group, op="max")
        return bool(bad.item() > 0)

    def update(self, found_inf: bool) -> None:
        """Count the step and move the scale (fp16 only): back off after ``hysteresis`` overflowing steps, grow
        after ``growth_interval`` clean ones in a row."""
        if not self.dynamic:
            return
        s = self.scaling
        if found_inf:
            self.skipped_steps += 1
            self.growth_tracker = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.loss_scale = max(self.loss_scale * s.backoff_factor, s.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker >= s.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_left = int(s.hysteresis)
            self.loss_scale *= s.growth_factor

    def metrics(self) -> dict[str, float]:
        """Per-step metrics: ``loss_scale`` and ``skipped_steps`` under fp16, nothing otherwise."""
        if not self.dynamic:
            return {}
        return {"loss_scale": self.loss_scale, "skipped_steps": float(self.skipped_steps)}

    def state_dict(self) -> dict[str, Any]:
        """The scaler state a checkpoint carries."""
        return {
            "loss_scale": self.loss_scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_left": self.hysteresis_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (a checkpoint without one leaves the initial state)."""
        if not state or not self.dynamic:
            return
        self.loss_scale = float(state["loss_scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])


def mixed_precision_for(cfg: Any, device: torch.device, group: Any) -> MixedPrecision:
    """The job's policy from ``train.dtype`` and ``train.loss_scaling``."""
    ls = cfg.train.loss_scaling
    scaling = LossScaling(
        initial_scale=float(ls.initial_scale),
        growth_interval=int(ls.growth_interval),
        hysteresis=int(ls.hysteresis),
    )
    return MixedPrecision(cfg.train.dtype, device.type, scaling, group)
