"""The forward and backward of one optimizer step, chosen once per job (as Megatron's ``get_forward_backward_func``).

:func:`get_forward_backward` returns a function ``(sync, micro_batches) -> local mean loss`` that runs every
micro-batch's forward and backward and completes the gradient reduction through the job's
:class:`~kuangchao_core.parallel.grad_sync.GradSync`:

- without a pipeline: micro-batch ``i`` runs ``loss / n`` backward under ``no_sync`` except the last, whose
  backward overlaps the reduction;
- with a pipeline: the executor runs the schedule's whole step under ``no_sync`` (its backwards interleave with
  forwards), then the reduction runs once.

The loss returned is this rank's, a float64 scalar tensor on the batches' device (read by the trainer once per step,
with the gradient norm): the mean over micro-batches on the last pipeline stage, 0 on other stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from kuangchao_core.parallel.grad_sync import GradSync, maybe_no_sync

ForwardBackward = Callable[[GradSync, list[dict[str, torch.Tensor]]], torch.Tensor]
#: what a micro-batch may carry to the device: tokens, labels, and packed documents' positions and segments
BATCH_KEYS = ("input_ids", "labels", "position_ids", "segment_ids")
MODEL_KEYS = ("position_ids", "segment_ids")


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword inputs of the model besides ``input_ids`` that ``batch`` has (packed documents)."""
    return {k: batch[k] for k in MODEL_KEYS if k in batch}


def get_forward_backward(
    model: torch.nn.Module, loss_fn: Callable, executor: Any = None, precision: Any = None
) -> ForwardBackward:
    """The step function for this rank: pipelined when ``executor`` (a PipelineExecutor) is given, else plain.

    ``precision``: the job's :class:`~kuangchao_core.parallel.mixed_precision.MixedPrecision` (forwards under its
    autocast, backward of its scaled loss); None runs in the parameters' dtype. The loss returned is unscaled."""
    if executor is not None:

        def pipelined(sync: GradSync, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
            with sync.no_sync():
                loss = executor.run(batches, precision=precision)
            sync.finish(accumulated=True)
            if loss is None:
                return torch.zeros((), dtype=torch.float64, device=batches[0]["input_ids"].device)
            return loss.detach().double()

        return pipelined

    autocast = precision.autocast if precision is not None else contextlib.nullcontext
    scale = precision.scale if precision is not None else (lambda loss: loss)

    def plain(sync: GradSync, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        n = len(batches)
        local = torch.zeros((), dtype=torch.float64, device=batches[0]["input_ids"].device)
        for i, batch in enumerate(batches):
            with maybe_no_sync(sync, last=i == n - 1):
                with autocast():
                    loss = loss_fn(model(batch["input_ids"], **model_inputs(batch)), batch["labels"]) / n
                scale(loss).backward()
            local += loss.detach().double()  # summed in float64 as Python floats were: read once per step
        sync.finish()
        return local

    return plain
