"""The one place that decides the gradient reductions beyond GradSync's average over the replicas (issue 43): the
sums of what the :class:`~kuangchao_core.parallel.placement.PlacementRecord` holds as ``Partial("sum")``.

``in_backward`` partials (sequence parallelism's norms, LoRA's adapters under TP) are summed by their layer's
autograd function (``parallel.sequence``) in each backward: ZeRO-3 runs blocks on gathered views of the parameters
(a parameter hook never sees their gradient) and reduce-scatters each micro-batch, and a sum after the backwards
would hold every DP bucket until the step ends. The others (the vision encoder, where a rank may encode no image,
so a per-backward sum could not pair up) are summed by :class:`PartialSums` once the step's backwards ran under
``no_sync``, before GradSync's reduction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kuangchao_core.comm import primitives as P
from kuangchao_core.parallel.placement import Partial, PlacementRecord


class PartialSums:
    """Sums the step-time partial gradients over ``groups[axis]`` (``placement`` read at every call)."""

    def __init__(self, model: torch.nn.Module, placement: PlacementRecord, groups: Mapping[str, Any]) -> None:
        self.model, self.placement, self.groups = model, placement, dict(groups)

    def sums(self) -> dict[str, list[str]]:
        """Axis -> the trainable parameters summed over it (axes of one rank left out)."""
        out: dict[str, list[str]] = {}
        for name, p in self.model.named_parameters():
            for axis, where in self.placement.params.get(name, {}).items():
                if p.requires_grad and where == Partial("sum") and self.placement.sizes[axis] > 1:
                    out.setdefault(axis, []).append(name)
        return out

    def __call__(self) -> None:
        params = dict(self.model.named_parameters())
        for axis, names in self.sums().items():
            _sum_over(self.groups[axis], [params[n] for n in names])


def step_partial_sums(model: torch.nn.Module, placement: PlacementRecord, groups: Mapping[str, Any]):
    """A :class:`PartialSums` when some trainable parameter needs one, else None (the last backward then overlaps
    GradSync's reduction)."""
    sums = PartialSums(model, placement, groups)
    return sums if sums.sums() else None


def _sum_over(group: Any, params: list[torch.Tensor]) -> None:
    """Sum ``params``' gradients over ``group`` in one all-reduce; a rank without a gradient (it encoded no image
    this step) joins with zeros."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    P.all_reduce(flat, group=group, op="sum")
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()
