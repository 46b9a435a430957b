"""Tolerances of the layout-equivalence tests, derived from the arithmetic rather than measured on one machine.

A parallel layout computes the same sums as one process in another order (TP partial sums, DP averaging,
micro-batch accumulation, pipeline stages), and a CPU's kernels may block a matmul differently (SIMD width).
Either changes each reduction by rounding only: for a sum of ``n`` terms the difference is at most ``n·u`` of the
sum of magnitudes, and ~``sqrt(n)·u`` in practice, with ``u`` the unit roundoff.

float64 (``FP64_REL``). ``u = 2**-53 ≈ 1.1e-16``. The tiny test models reduce over at most ``n ≈ 10^4`` terms
(hidden 64, vocabulary 256, 8 sequences of 16-32 tokens), so one step's gradients differ by ≲ ``sqrt(n)·u ≈ 1e-14``
relative. AdamW divides by ``sqrt(v) + eps``; its derivative in the gradient is at most ``1/eps``, so an
element whose gradient is near ``eps`` turns a gradient difference ``d`` into an update difference up to
``lr·d/eps``. In fp32 that saturates (rounding-level gradients of ~1e-9 sit at ``eps = 1e-8``, so signs flip and
single elements move by O(lr): the 1e-5-relative failures of issue 8); in fp64 rounding-level gradients are
~1e-18, ten orders below ``eps``, so the amplification stays linear and small. Over 5-8 steps the differences
therefore stay near 1e-13. ``FP64_REL = 1e-10`` leaves three orders of magnitude above that on any CPU, and it is
six orders below what a real bug gives: a missing all-reduce, an unreduced bucket or a skipped micro-batch moves
losses and parameters by ≥ 1e-4 relative (the negative controls assert ``≥ NEGATIVE_MIN``).

float32 (``FP32_LOSS_REL``, ``FP32_GRAD_REL``). ``u = 2**-24 ≈ 6e-8``. A loss is a mean of log-softmaxes over a
vocabulary of 256: ``sqrt(256)·u ≈ 1e-6`` per token, and the parameters after a few steps differ only on the few
elements AdamW amplifies (whose effect on the loss is second order), so losses stay within ``FP32_LOSS_REL =
1e-5`` (10x). The first step's gradients come from a chain of ≈ 20 matmuls/reductions of ≤ 256 terms each
(4 layers × attention, MLP, norm, plus head and loss): ``sqrt(20)·sqrt(256)·u ≈ 4e-6`` relative per tensor;
``FP32_GRAD_REL = 1e-4`` leaves 25x. Parameters after several AdamW steps are never compared in fp32.

Against transformers (``HF_REL``). Both models run in float64, but transformers computes every RMSNorm in fp32
whatever the dtype (and both compute the rotary tables in fp32). Each of the 2L+1 norms rounds its output at
``u32·sqrt(hidden) ≈ 5e-7`` relative, so logits differ by ≲ (2L+1)·5e-7 ≈ 3.5e-6 of their largest magnitude
for L ≤ 3 layers; the fp64 remainder adds ~1e-15. ``HF_REL = 2e-5`` of the largest logit bounds it; a wrong
weight, a swapped head or a missing norm moves logits by ≥ 1e-2 of it.
"""

from __future__ import annotations

import numpy as np

FP64_REL = 1e-10
FP32_LOSS_REL = 1e-5
FP32_GRAD_REL = 1e-4
HF_REL = 2e-5
#: The smallest relative difference a negative control (a deliberately broken reduction) must produce.
NEGATIVE_MIN = 1e-4


def rel_norm(a, b) -> float:
    """``||a - b|| / ||b||`` in float64 (0 when both are zero)."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    den = np.linalg.norm(b64)
    num = np.linalg.norm(a64 - b64)
    return float(num / den) if den > 0 else float(num)


def worst_rel(got: dict, want: dict) -> tuple[str, float]:
    """The tensor of ``want`` with the largest relative-norm difference from ``got``, and that difference."""
    assert set(got) == set(want), set(got) ^ set(want)
    return max(((n, rel_norm(got[n], w)) for n, w in want.items()), key=lambda kv: kv[1])


def assert_logits_match(got, want, rel: float = HF_REL) -> None:
    """``max |got - want|`` within ``rel`` of ``max |want|`` (logits of two implementations)."""
    scale = float(want.abs().max())
    diff = float((got.to(want.dtype) - want).abs().max())
    assert scale > 0.1, f"logits near zero (max |logit| {scale:.2e}): the comparison would see nothing"
    assert diff <= rel * scale, f"logits differ by {diff:.2e}, more than {rel:.0e} of max |logit| {scale:.2e}"


def max_rel_diff(got, want) -> float:
    """The largest element-wise ``|got - want| / |want|`` of two sequences of scalars (losses)."""
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert g.shape == w.shape, (g.shape, w.shape)
    return float(np.max(np.abs(g - w) / np.abs(w)))
