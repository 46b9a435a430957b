"""Held-out loss during training (``train.eval_interval``), logged as ``eval_loss``.

The held-out set is the data's evaluation split: the synthetic corpus' held-out problems (``data.synthetic.num_eval``)
or the files of ``data.eval_path``.
Every ``eval_interval`` steps each DP rank computes the loss of its share of the held-out micro-batches (TP ranks
of a DP rank compute the same ones together), and the token-weighted mean is summed over the DP group, so every
layout reports the same number. Where the tokenizer's tokens are byte strings
(:mod:`~kuangchao_core.data.token_bytes`) the bytes and characters the labelled tokens spell are summed the same way,
so the loss restates as nats per character and bits per byte of the text evaluated (issue 39 item 5). The
micro-batches cover the whole held-out split, or its first
``train.eval_tokens`` tokens (whole windows; issue 39 item 1: before, the first 8 micro-batches only, a share
that shrank as the held-out data grew); each evaluation states the windows and labelled tokens it covered; a pipeline runs its stages forward only, one micro-batch after another. A job
without held-out data says so once at start. Under context parallelism every CP rank of a DP rank takes its shard
of the same micro-batches (``parallel.context.shard_inputs``) and the sums are added over CP as well.
"""

from __future__ import annotations

from typing import Any

import torch

from kuangchao_core.comm import diag
from kuangchao_core.comm import primitives as P
from kuangchao_core.data import build_dataset
from kuangchao_core.data.token_bytes import labelled_text_sizes, token_text_sizes
from kuangchao_core.errors import DataError
from kuangchao_core.models.llama import IGNORE_INDEX
from kuangchao_core.parallel.context import shard_inputs
from kuangchao_core.parallel.forward_backward import model_inputs
from kuangchao_core.parallel.pp_executor import stage_inputs

#: Held-out micro-batches per evaluation of a vision-language job, over all DP ranks (its image rows; text jobs
#: cover the whole held-out split or ``train.eval_tokens``)
EVAL_MICRO_BATCHES = 8


class HeldOutLoss:
    """The held-out loss of this rank's model part over the first ``windows`` held-out windows (None: all); call it
    on every rank (collective over TP and DP). After a call ``tokens`` holds the labelled tokens it covered (all DP
    ranks), and ``text_bytes``/``text_chars`` the bytes and characters they spell (None: the tokenizer cannot say)."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Any,
        dataset: Any,
        mesh: Any,
        micro_batch: int,
        device,
        windows: int | None = None,
    ):
        self.model = model
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.device = device
        self.dataset = dataset
        self.windows = total = len(dataset) if windows is None else min(int(windows), len(dataset))
        self.tokens = 0
        self.text_bytes: int | None = None
        self.text_chars: int | None = None
        tokenizer = getattr(dataset, "tokenizer", None)
        self._sizes = token_text_sizes(tokenizer, tokenizer.vocab_size) if tokenizer is not None else None
        n = -(-total // micro_batch)  # the last one may be short

        def rows(i: int) -> range:
            return range(i * micro_batch, min((i + 1) * micro_batch, total))

        mine = range(mesh.dp_rank, n, mesh.dp)
        rounds = -(-n // mesh.dp)
        # every DP rank runs the same number of forwards (ZeRO-3 gathers its blocks collectively in each): a rank
        # with fewer micro-batches repeats the first one, and its result is not counted. The rows are read when
        # evaluated, so a large held-out split is never held in memory whole
        self.batches: list[tuple[Any, bool]] = [(rows(i), True) for i in mine] + [(rows(0), False)] * (
            rounds - len(mine)
        )

    def _batch(self, rows: Any) -> dict[str, torch.Tensor]:
        """The micro-batch of held-out ``rows`` on the device."""
        items = [self.dataset[j] for j in rows]
        return {k: torch.stack([x[k] for x in items]).to(self.device) for k in items[0]}

    @torch.no_grad()
    def __call__(self) -> float:
        """Token-weighted mean loss over the held-out micro-batches of every DP rank."""
        was_training = self.model.training
        self.model.eval()
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)  # NCCL reduces device tensors
        try:
            for rows, counted in self.batches:
                diag.beat()  # progress for comm.watchdog: a peer waiting on this rank is not hung while it evaluates
                batch = self._batch(rows)
                if getattr(self.mesh, "cp", 1) > 1:
                    batch = shard_inputs(batch, self.mesh.cp, self.mesh.cp_rank)
                value = self._loss_sum_and_count(batch)
                if counted:
                    totals += value
        finally:
            self.model.train(was_training)
        # the loss lives on the last stage: sum over PP, then over the replicas (dp, and cp: each holds a shard)
        for group in (self.mesh.pp_group, getattr(self.mesh, "dp_cp_group", self.mesh.dp_group)):
            if group is not None and group.size > 1:
                P.all_reduce(totals, group=group, op="sum")
        self.tokens = int(totals[1])
        if self._sizes is not None:
            self.text_bytes, self.text_chars = int(totals[2]), int(totals[3])
        return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")

    def _token_weighted(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        count = (labels != IGNORE_INDEX).sum()
        loss = self.loss_fn(logits, labels)
        text = (
            labelled_text_sizes(self._sizes, labels, IGNORE_INDEX)
            if self._sizes is not None
            else torch.zeros(2, dtype=torch.float64, device=labels.device)
        )
        return torch.cat([torch.stack([loss.detach().double() * count, count.double()]), text.to(labels.device)])

    def _loss_sum_and_count(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(loss × tokens, tokens, bytes, characters) of one micro-batch, float64 on the device."""
        return self._token_weighted(self.model(batch["input_ids"], **model_inputs(batch)), batch["labels"])


class PipelinedHeldOutLoss(HeldOutLoss):
    """The held-out loss through the pipeline, forward only: each micro-batch runs the virtual stages in order,
    every rank its own chunks, activations handed to the next stage's rank with send/recv; the last stage's
    token-weighted loss is summed over PP (zero elsewhere) and DP."""

    def __init__(
        self,
        executor: Any,
        model: torch.nn.Module,
        dataset: Any,
        mesh: Any,
        micro_batch: int,
        device,
        windows: int | None = None,
    ):
        super().__init__(model, executor.loss_fn, dataset, mesh, micro_batch, device, windows)
        self.executor = executor

    def _loss_sum_and_count(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        y = self.executor.forward_only(batch["input_ids"], stage_inputs(batch, self.device))
        if y is None:  # not the last stage: it adds nothing to the sums
            return torch.zeros(4, dtype=torch.float64, device=self.device)
        return self._token_weighted(y, batch["labels"])


def eval_dataset_for(data: Any, no_eval_reason: str, vocab_size: int) -> tuple[Any, str]:
    """The job's held-out data (the synthetic corpus' held-out problems, or ``data.eval_path``) from the ``data``
    section, or None with the reason it has none (``no_eval_reason``, from the run's settings, or the data's)."""
    if no_eval_reason:
        return None, no_eval_reason
    try:
        return build_dataset(data, vocab_size, split="eval"), ""
    except DataError as exc:
        return None, f"the held-out data cannot be used ({exc})"


def eval_windows(eval_tokens: int | None, seq_len: int) -> int | None:
    """Held-out windows of ``seq_len`` tokens an evaluation of ``eval_tokens`` tokens covers (at least one; None:
    every window)."""
    return None if eval_tokens is None else max(1, -(-int(eval_tokens) // int(seq_len)))


def held_out_loss_for(
    micro: int, parts: Any, mesh: Any, dataset: Any, device, windows: int | None = None
) -> HeldOutLoss:
    """The held-out loss evaluator of this rank's model part over the first ``windows`` windows of ``dataset``
    (:func:`eval_dataset_for`; None: all of them), in micro-batches of ``micro`` sequences."""
    if parts.executor is not None:
        return PipelinedHeldOutLoss(parts.executor, parts.model, dataset, mesh, micro, device, windows)
    return HeldOutLoss(parts.model, parts.loss_fn, dataset, mesh, micro, device, windows)
