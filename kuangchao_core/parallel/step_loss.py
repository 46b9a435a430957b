"""The loss of one optimizer step as one process would compute it: the mean over every labelled token of the global
batch, whatever the layout.

Each micro-batch contributes ``sum of its token losses × loss_weight`` with ``loss_weight = dp / N`` (N the labelled
tokens of the whole global batch, counted on every DP rank and summed); the DP average of the gradients then gives
``∇ (Σ token losses) / N``. Averaging per-micro-batch means instead weighs a token by ``1 / (tokens of its
micro-batch)``, which differs from one process as soon as micro-batches hold different numbers of labelled tokens
(masked instruction data, packed documents' boundaries) — under data parallelism and gradient accumulation alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kuangchao_core.comm import primitives as P

IGNORE_INDEX = -100


def weighted_loss(
    loss_fn: Callable, output: torch.Tensor, batch: dict[str, torch.Tensor], n: int, loss_weight: torch.Tensor | None
) -> torch.Tensor:
    """One micro-batch's share of the step loss: ``sum × loss_weight``, or ``mean / n`` without a weight."""
    labels = batch["labels"].to(output.device)
    if loss_weight is None:
        return loss_fn(output, labels) / n
    return loss_fn(output, labels, reduction="sum") * loss_weight.to(output.dtype)


def labelled_tokens(micro_batches: list[dict[str, torch.Tensor]]) -> int:
    """The labelled tokens (labels not ``IGNORE_INDEX``) of ``micro_batches``, counted on the host."""
    return sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro_batches)


def known_global_count(micro_batches: list[dict[str, torch.Tensor]], replicas: Any, mesh: Any) -> int | None:
    """The step's global labelled-token count where the loader counted it for every dp rank from the indices
    (``labelled_per_rank``; the data is known to every rank) and the ``replicas`` the loss is normalised over are
    exactly the dp×cp ranks that read the global batch; checked against this rank's own micro-batches (pass them
    before they are cut into context-parallel shards). None otherwise: :func:`step_loss_weight` then all-reduces."""
    per_rank = getattr(micro_batches, "labelled_per_rank", None)
    size = replicas.size if replicas is not None else 1
    if per_rank is None or size != mesh.dp * getattr(mesh, "cp", 1):
        return None
    mine = labelled_tokens(micro_batches)
    if mine != per_rank[mesh.dp_rank]:
        raise RuntimeError(
            f"the loader counted {per_rank[mesh.dp_rank]} labelled tokens for dp rank {mesh.dp_rank}'s micro-batches,"
            f" which hold {mine}: the dataset's labelled_tokens disagrees with its windows"
        )
    return int(sum(per_rank))


class CountedBatches(list):
    """Micro-batches (a CP rank's shards) carrying the step's ``global_labelled`` count (see
    :func:`known_global_count`)."""

    global_labelled: int | None = None


def with_global_count(micro_batches: list[dict[str, torch.Tensor]], count: int | None) -> list:
    """``micro_batches`` carrying ``count`` as ``global_labelled`` for :func:`step_loss_weight` (unchanged if None)."""
    if count is None:
        return micro_batches
    out = CountedBatches(micro_batches)
    out.global_labelled = count
    return out


def step_loss_weight(micro_batches: list[dict[str, torch.Tensor]], dp_group: Any, device: Any) -> torch.Tensor:
    """``dp / N`` as a float64 tensor on ``device``, N the labelled tokens (labels not ``IGNORE_INDEX``) of the step's
    global batch: this rank's micro-batches counted on the host, summed over the DP group (one scalar all-reduce; it
    stays on the device, no host sync) — or, where the micro-batches carry it (``global_labelled``, the loader's
    count of every rank's windows, issue 39), N without communication. Under context parallelism the trainer passes
    the dp×cp group and each rank's shards: ``dp`` is then that group's size. A global batch without a labelled token
    weighs 0."""
    known = getattr(micro_batches, "global_labelled", None)
    dp = 1
    if dp_group is not None and dp_group.size > 1:
        dp = dp_group.size
    if dp > 1 and known is not None:
        count = torch.tensor([float(known)], dtype=torch.float64, device=device)
    else:
        count = torch.tensor([float(labelled_tokens(micro_batches))], dtype=torch.float64, device=device)
        if dp > 1:
            P.all_reduce(count, group=dp_group, op="sum")
    return torch.where(count[0] > 0, dp / count[0].clamp(min=1.0), torch.zeros((), dtype=torch.float64, device=device))


class _Done:
    """The handle of a reduction that had nothing to wait for."""

    def wait(self) -> None:
        """Nothing to wait for."""


def reduce_loss(local_loss: torch.Tensor, pp_group: Any, replicas: Any, device: Any) -> tuple[torch.Tensor, Any]:
    """The step's loss summed over the pipeline stages (it lives on the last, 0 elsewhere) and, started without
    blocking, over the dp×cp ``replicas``: returns the float64 tensor on ``device`` and the handle whose ``wait()``
    makes it the global sum (the caller divides by the replicas)."""
    loss_t = local_loss.detach().reshape(1).to(device=device, dtype=torch.float64)  # NCCL reduces device tensors
    if pp_group is not None and pp_group.size > 1:
        P.all_reduce(loss_t, group=pp_group, op="sum")
    if replicas is not None and replicas.size > 1:
        return loss_t, P.all_reduce(loss_t, group=replicas, op="sum", async_op=True)
    return loss_t, _Done()
