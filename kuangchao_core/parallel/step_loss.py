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


def step_loss_weight(
    micro_batches: list[dict[str, torch.Tensor]], dp_group: Any, device: Any, known: int | None = None
) -> torch.Tensor:
    """``dp / N`` as a float64 tensor on ``device``, N the labelled tokens (labels not ``IGNORE_INDEX``) of the step's
    global batch: this rank's micro-batches counted on the host, summed over the DP group (one scalar all-reduce; it
    stays on the device, no host sync) — or, where it is ``known`` (:func:`known_global_count`, the loader's count
    of every rank's windows, issue 39), N without communication. Under context parallelism the trainer passes
    the dp×cp group and each rank's shards: ``dp`` is then that group's size. A global batch without a labelled token
    weighs 0."""
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
