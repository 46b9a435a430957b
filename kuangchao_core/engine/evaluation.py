"""Held-out loss during training (``train.eval_interval``), logged as ``eval_loss``.

The held-out set is the data's evaluation split: the synthetic corpus' held-out problems (``data.synthetic.num_eval``).
Every ``eval_interval`` steps each DP rank computes the loss of its share of the first held-out micro-batches (TP
ranks of a DP rank compute the same ones together), and the token-weighted mean is summed over the DP group, so
every layout reports the same number. A job the held-out loss cannot be computed for says so once at start:
file data has no evaluation split yet, and a pipeline has no forward-only schedule.
"""

from __future__ import annotations

from typing import Any

import torch

from kuangchao_core.comm import primitives as P
from kuangchao_core.data import build_dataset
from kuangchao_core.errors import DataError
from kuangchao_core.models.llama import IGNORE_INDEX
from kuangchao_core.parallel.forward_backward import model_inputs

#: Held-out micro-batches per evaluation, over all DP ranks (a fixed set, so values compare across steps and runs).
EVAL_MICRO_BATCHES = 8


class HeldOutLoss:
    """The held-out loss of this rank's model part; call it on every rank (collective over TP and DP)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any, dataset: Any, mesh: Any, micro_batch: int, device):
        self.model = model
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.device = device
        n = min(EVAL_MICRO_BATCHES, max(1, len(dataset) // micro_batch))
        mine = range(mesh.dp_rank, n, mesh.dp)
        self.batches = [
            [dataset[j] for j in range(i * micro_batch, min((i + 1) * micro_batch, len(dataset)))] for i in mine
        ]

    @torch.no_grad()
    def __call__(self) -> float:
        """Token-weighted mean loss over the held-out micro-batches of every DP rank."""
        was_training = self.model.training
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # NCCL reduces device tensors
        try:
            for items in self.batches:
                batch = {k: torch.stack([x[k] for x in items]).to(self.device) for k in items[0]}
                labels = batch["labels"]
                count = (labels != IGNORE_INDEX).sum()
                loss = self.loss_fn(self.model(batch["input_ids"], **model_inputs(batch)), labels)
                totals += torch.stack([loss.detach().double() * count, count.double()])
        finally:
            self.model.train(was_training)
        if self.mesh.dp > 1:
            P.all_reduce(totals, group=self.mesh.dp_group, op="sum")
        return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")


def held_out_loss_for(cfg: Any, parts: Any, mesh: Any, vocab_size: int, device) -> tuple[HeldOutLoss | None, str]:
    """The evaluator of this job, or None with the reason it has none (for the start-up warning)."""
    if mesh.pp > 1:
        return None, "pipeline layouts have no forward-only schedule yet"
    if not cfg.data.is_synthetic:
        return None, f"data.path {cfg.data.path} has no evaluation split yet"
    if int(cfg.data.synthetic.num_eval) < 1:
        return None, "data.synthetic.num_eval is 0"
    try:
        dataset = build_dataset(cfg.data, vocab_size, split="eval")
    except DataError as exc:
        return None, f"the held-out split cannot be used ({exc})"
    return HeldOutLoss(parts.model, parts.loss_fn, dataset, mesh, cfg.parallel.micro_batch_size, device), ""
