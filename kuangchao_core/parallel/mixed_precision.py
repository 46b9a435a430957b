"""Mixed precision of a job's step (``train.dtype``, SPEC RT.3): compute dtype, fp32 master weights, loss scaling.

- ``fp32`` / ``fp64``: nothing changes (the parameters' own dtype; a plain step, bit-exact with a job that knows
  nothing of mixed precision).
- ``bf16``: forwards run under ``torch.autocast`` in bfloat16 — matmuls and attention in bf16, norms, softmax and
  the loss in fp32 — while the parameters, their gradients and AdamW's moments stay fp32: the parameters are the
  master weights, so the gradients reduced over data parallelism are fp32 (``parallel.grad_reduce_dtype: bf16``
  sums them in 16 bits instead).
- ``fp16``: the same in float16, with dynamic loss scaling: the loss is multiplied by the scale before backward,
  the gradients are divided by it before clipping; after a skipped step (below) the scale is multiplied by
  ``backoff_factor`` (after ``hysteresis`` such steps); after ``growth_interval`` clean steps in a row it is
  multiplied by ``growth_factor``. Its state travels in checkpoints, so a resumed run continues bitwise.

In every dtype a step whose loss or global gradient norm is not finite is skipped by every rank (the trainer reads
both, equal on every rank, before the optimizer runs; the parameters and AdamW's state stay as they were) and
counted here (``skipped_steps``, checkpointed).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from kuangchao_core.config.settings import PrecisionSettings

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
    """The step's precision policy for one rank."""

    def __init__(self, dtype: str, device_type: str, scaling: LossScaling | None = None):
        self.compute_dtype = HALF_DTYPES.get(dtype)
        self.device_type = device_type
        self.dynamic = dtype == "fp16"
        self.scaling = scaling or LossScaling()
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

    def unscale(self, grads: list[torch.Tensor]) -> None:
        """Divide ``grads`` (this rank's, after their reduction) by the loss scale (fp16; nothing otherwise). An
        overflow shows as a non-finite global gradient norm, which the trainer checks before the optimizer runs."""
        if not self.dynamic:
            return
        inv = 1.0 / self.loss_scale
        for g in grads:
            g.mul_(inv)

    @property
    def at_min_scale(self) -> bool:
        """Whether backing off can no longer help (always True without loss scaling): only then does a
        non-finite step count towards ``train.max_bad_steps``."""
        return not self.dynamic or self.loss_scale <= self.scaling.min_scale

    def update(self, found_inf: bool) -> None:
        """Count a skipped step (every dtype) and move the scale (fp16 only): back off after ``hysteresis``
        overflowing steps, grow after ``growth_interval`` clean ones in a row."""
        if found_inf:
            self.skipped_steps += 1
        if not self.dynamic:
            return
        s = self.scaling
        if found_inf:
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
        """Per-step metrics: ``skipped_steps`` (steps not applied because their loss or gradients were not
        finite), and ``loss_scale`` under fp16."""
        if not self.dynamic:
            return {"skipped_steps": float(self.skipped_steps)}
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
        if not state:
            return
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if not self.dynamic:
            return
        self.loss_scale = float(state["loss_scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_left = int(state["hysteresis_left"])


def mixed_precision_for(precision: PrecisionSettings, device: torch.device) -> MixedPrecision:
    """The job's policy from ``train.dtype`` and ``train.loss_scaling`` (:class:`PrecisionSettings`)."""
    scaling = LossScaling(
        initial_scale=precision.initial_scale,
        growth_interval=precision.growth_interval,
        hysteresis=precision.hysteresis,
    )
    return MixedPrecision(precision.dtype, device.type, scaling)
