"""The values of a training step that every rank needs summed over the ranks that saw other tokens: the loss and,
for a MoE model (issue 40), each MoE layer's tokens per expert, in one all-reduce.

The loss lives on the last pipeline stage (0 elsewhere) and each dp×cp replica holds its own share: the sum over
the pipeline group, then over the replicas (dp×cp), is the global batch's. The experts' loads (``MoeStep
.step_loads``: assignments per expert, a row per MoE layer of the whole model, zeros on a stage that does not hold
the layer) sum over exactly the same ranks to the counts one process would make on the whole batch — under expert
parallelism too, whose ep ranks are data-parallel ranks with other tokens — so they travel in the loss's all-reduce
(float64: a count is exact below 2**53): ``1 + layers × experts`` elements instead of 1, no collective of their own
(the bias update of ``balance: bias`` had one per step before; it now reads these). The reduced values are read
back to the host with the gradient norm, the step's one read of device values; the replicas' sum is started right
after the backward and waited for after clipping (issue 39).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kuangchao_core.comm import primitives as P


@dataclass
class StepValues:
    """The step's summed loss, its global gradient norm and, for a MoE model, ``loads`` (MoE layers × experts,
    float64 on the host) with ``expert_load``: decoder layer -> tokens routed to each expert."""

    loss_sum: float
    grad_norm: float
    loads: torch.Tensor | None = None
    expert_load: dict[int, list[int]] | None = None


@dataclass
class PendingStepValues:
    """The step's sums in flight (:func:`start_step_values`): ``finish`` waits for them."""

    summed: torch.Tensor
    handle: Any
    moe: Any

    def finish(self, norm: torch.Tensor) -> StepValues:
        """Wait for the sums, then read them and the gradient ``norm`` in one host read."""
        if self.handle is not None:
            self.handle.wait()
        values = torch.cat([self.summed, norm.to(device=self.summed.device, dtype=torch.float64).reshape(1)]).tolist()
        if self.moe is None:
            return StepValues(values[0], values[-1])
        moe = self.moe
        loads = torch.tensor(values[1:-1], dtype=torch.float64).view(len(moe.layers), moe.num_experts)
        by_layer = {layer: [int(c) for c in row] for layer, row in zip(moe.layers, loads.tolist(), strict=True)}
        return StepValues(values[0], values[-1], loads, by_layer)


def start_step_values(
    local_loss: torch.Tensor, moe: Any, device: Any, pp_group: Any, replicas: Any
) -> PendingStepValues:
    """Sum ``local_loss`` (and ``moe.step_loads()`` when ``moe`` is not None) on ``device`` over the pipeline group,
    then start its sum over the dp×cp ``replicas`` without blocking (issue 39: it runs while the gradients are
    unscaled and clipped); None or a group of one is skipped (module docstring)."""
    parts = [local_loss.detach().reshape(1).to(device=device, dtype=torch.float64)]  # NCCL reduces device tensors
    if moe is not None:
        parts.append(moe.step_loads(device).reshape(-1))
    summed = torch.cat(parts) if len(parts) > 1 else parts[0]
    if pp_group is not None and pp_group.size > 1:
        P.all_reduce(summed, group=pp_group, op="sum")
    handle = None
    if replicas is not None and replicas.size > 1:
        handle = P.all_reduce(summed, group=replicas, op="sum", async_op=True)
    return PendingStepValues(summed, handle, moe)
