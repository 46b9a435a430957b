"""The forward and backward of one optimizer step, chosen once per job (as Megatron's ``get_forward_backward_func``).

:func:`get_forward_backward` returns a function ``(sync, micro_batches, loss_weight) -> local loss`` that runs every
micro-batch's forward and backward and completes the gradient reduction through the job's
:class:`~kuangchao_core.parallel.grad_sync.GradSync`:

- without a pipeline: each micro-batch's loss backward under ``no_sync`` except the last, whose backward overlaps the
  reduction;
- with a pipeline: the executor runs the schedule's whole step under ``no_sync`` (its backwards interleave with
  forwards), then the reduction runs once;
- with ``partial_sums`` (:mod:`~kuangchao_core.parallel.partial_sums`: gradients some parameters hold only in part,
  the vision encoder's under TP): every backward under ``no_sync``, then those sums, then the reduction.

A micro-batch's loss is the *sum* over its labelled tokens times ``loss_weight`` — the trainer passes
``dp / (labelled tokens of the whole global batch)`` (:mod:`kuangchao_core.parallel.step_loss`), so that, with the DP
average of the gradients, the step minimises the mean over every labelled token of the global batch, as one process
would. (The mean of per-micro-batch means differs as soon as micro-batches hold different numbers of labelled tokens:
masked instruction data, packed documents.) ``loss_weight`` None keeps the mean of per-micro-batch means.

``aux_loss`` (MoE models, issue 40: ``models.moe.MoeStep.micro_batch_loss``), called after each micro-batch's forward,
gives the auxiliary losses of that forward (or None); each is backpropagated with the micro-batch's loss, weighted
``1 / micro-batches`` (the step's auxiliary loss is the mean over its micro-batches, and the DP average of the
gradients makes it the mean over every rank's), and left out of the loss returned.

The loss returned is this rank's, a float64 scalar tensor on the batches' device (read by the trainer once per step,
with the gradient norm): its share of the step's loss on the last pipeline stage, 0 on other stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from kuangchao_core.parallel.grad_sync import GradSync, maybe_no_sync
from kuangchao_core.parallel.step_loss import weighted_loss

ForwardBackward = Callable[[GradSync, list[dict[str, torch.Tensor]], torch.Tensor | None], torch.Tensor]
#: what a micro-batch may carry to the device: tokens, labels, packed documents' positions and segments, and the
#: images of a vision-language model (issue 31)
BATCH_KEYS = ("input_ids", "labels", "position_ids", "segment_ids", "pixel_values")
MODEL_KEYS = ("position_ids", "segment_ids", "pixel_values")


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword inputs of the model besides ``input_ids`` that ``batch`` has (packed documents)."""
    return {k: batch[k] for k in MODEL_KEYS if k in batch}


def get_forward_backward(
    model: torch.nn.Module,
    loss_fn: Callable,
    executor: Any = None,
    precision: Any = None,
    partial_sums: Any = None,
    aux_loss: Callable[[], torch.Tensor | None] | None = None,
) -> ForwardBackward:
    """The step function for this rank: pipelined when ``executor`` (a PipelineExecutor) is given, else plain.

    ``precision``: the job's :class:`~kuangchao_core.parallel.mixed_precision.MixedPrecision` (forwards under its
    autocast, backward of its scaled loss); None runs in the parameters' dtype. The loss returned is unscaled.
    ``partial_sums``: called once the step's backwards ran, before GradSync's reduction (None: nothing to sum).
    ``aux_loss``: the auxiliary losses of the last forward (see the module docstring); not with ``executor``."""
    if aux_loss is not None and executor is not None:
        raise ValueError("auxiliary losses (MoE) are not collected by the pipeline executor")
    autocast = precision.autocast if precision is not None else contextlib.nullcontext
    scale = precision.scale if precision is not None else (lambda loss: loss)

    def micro_batches(sync: GradSync, batches: list[dict[str, torch.Tensor]], loss_weight: Any) -> torch.Tensor:
        if executor is not None:
            with sync.no_sync():
                loss = executor.run(batches, precision=precision, loss_weight=loss_weight)
            return torch.zeros((), dtype=torch.float64, device=batches[0]["input_ids"].device) if loss is None else loss
        n = len(batches)
        local = torch.zeros((), dtype=torch.float64, device=batches[0]["input_ids"].device)
        for i, batch in enumerate(batches):
            with maybe_no_sync(sync, last=i == n - 1 and partial_sums is None):
                with autocast():
                    loss = weighted_loss(
                        loss_fn, model(batch["input_ids"], **model_inputs(batch)), batch, n, loss_weight
                    )
                extra = aux_loss() if aux_loss is not None else None
                scale(loss if extra is None else loss + extra.to(loss.dtype) / n).backward()
            local += loss.detach().double()  # summed in float64 as Python floats were: read once per step
        return local

    def step(
        sync: GradSync, batches: list[dict[str, torch.Tensor]], loss_weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        local = micro_batches(sync, batches, loss_weight)
        if partial_sums is not None:
            partial_sums()
        sync.finish(accumulated=executor is not None or partial_sums is not None)
        return local.detach().double()

    return step
