"""Image data and evaluation of the vision-language model in the engine (issue 31).

:func:`vision_datasets` opens ``data.path`` (and ``data.eval_path``) through the image gate
(:func:`~kuangchao_core.data.image_data.build_image_dataset`): every rank runs the gate itself before any model
compute — the records and images are read and decoded on each rank (deterministic, so every rank refuses the same
records or none); with ``data.cache_dir`` the ranks share the decoded pixels on disk.

:class:`ImageHeldOutLoss` is the held-out loss over the held-out image rows (micro-batches through the dataset's
``collate``, so their images travel with them); :class:`ImageExactMatch` answers the held-out questions
(``ds.question(i)``) greedily — every rank the same questions, TP ranks gathering the vocabulary-split logits; under a
pipeline each decoding step runs the stages in order with the question's image riding to the first stage, and the
last stage's choice is broadcast to every stage (:class:`~kuangchao_core.engine.samples.PipelinedNextTokens`) — and
scores exact match on the ids; :func:`sample_images` renders the first few answers' images for MLflow.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kuangchao_core.data import get_tokenizer
from kuangchao_core.data.image_data import build_image_dataset, gate_settings, placeholder_settings
from kuangchao_core.engine.evaluation import EVAL_MICRO_BATCHES, HeldOutLoss, PipelinedHeldOutLoss
from kuangchao_core.engine.samples import PipelinedNextTokens, greedy_decode
from kuangchao_core.hal.dtypes import param_dtype

#: held-out questions answered at each evaluation, and how many are shown (text and image) in MLflow
QUESTIONS = 128
SHOWN = 4
MAX_ANSWER_TOKENS = 16
_WINDOWS = EVAL_MICRO_BATCHES  # held-out micro-batches of image rows per evaluation


def vision_datasets(data: Any, vision: Any, vocab_size: int, dtype: str) -> tuple[Any, Any, Any]:
    """``(train, eval or None, tokenizer)``: the gated image datasets of ``data.path`` and ``data.eval_path``."""
    tokenizer = get_tokenizer(data.tokenizer, vocab_size)
    keywords = {
        **placeholder_settings(vision, vocab_size),
        **gate_settings(data),
        "seq_len": int(data.seq_len),
        "dtype": param_dtype(dtype),
    }
    train = build_image_dataset(data.path, tokenizer, **keywords)
    held_out = build_image_dataset(data.eval_path, tokenizer, **keywords) if data.eval_path else None
    return train, held_out, tokenizer


class ImageHeldOutLoss(HeldOutLoss):
    """:class:`HeldOutLoss` over image rows: each held-out micro-batch is the dataset's ``collate`` of its rows."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any, dataset: Any, mesh: Any, micro_batch: int, device):
        super().__init__(model, loss_fn, _Rows(len(dataset)), mesh, micro_batch, device, _WINDOWS * micro_batch)
        self.batches = [([dataset.collate(list(rows))], counted) for rows, counted in self.batches]

    def _batch(self, rows: Any) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in rows[0].items()}  # the micro-batch collated once, at set-up


class PipelinedImageHeldOutLoss(PipelinedHeldOutLoss):
    """:class:`PipelinedHeldOutLoss` over image rows (the images ride with the micro-batch to the first stage)."""

    def __init__(self, executor: Any, model: torch.nn.Module, dataset: Any, mesh: Any, micro_batch: int, device):
        super().__init__(executor, model, _Rows(len(dataset)), mesh, micro_batch, device, _WINDOWS * micro_batch)
        self.batches = [([dataset.collate(list(rows))], counted) for rows, counted in self.batches]

    def _batch(self, rows: Any) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in rows[0].items()}


class _Rows:
    """Row indices as items (what :class:`HeldOutLoss` splits into micro-batches), so the images are collated once
    per batch."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"row": i}


class ImageExactMatch:
    """Greedy answers to the first :data:`QUESTIONS` held-out questions; call on every rank (collective over TP, and
    over PP when ``next_tokens``, a :class:`PipelinedNextTokens`, is given). Returns ``(exact match, text)``;
    ``shown`` holds the rows the text shows, ``dataset`` their images."""

    def __init__(self, model: torch.nn.Module, dataset: Any, tokenizer: Any, device: torch.device, next_tokens=None):
        self.model, self.dataset, self.tokenizer, self.device = model, dataset, tokenizer, device
        self.next_tokens = next_tokens
        self.rows = list(range(min(QUESTIONS, len(dataset))))
        self.stop_id = int(tokenizer.sep_id)

    def _logits(self, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        logits = self.model(ids, pixel_values=pixels)
        lm = self.model.language_model
        return lm.gather_logits(logits) if hasattr(lm, "gather_logits") else logits

    @torch.no_grad()
    def __call__(self) -> tuple[float, str, list[int]]:
        was_training = self.model.training
        self.model.eval()
        right, lines = 0, []
        try:
            for row in self.rows:
                prompt, answer, pixels = self.dataset.question(row)
                pixels = pixels.to(self.device)
                got = greedy_decode(
                    lambda ids, _p=pixels: self._logits(ids, _p),
                    [prompt],
                    max_new=min(MAX_ANSWER_TOKENS, len(answer) + 2),
                    stop_id=self.stop_id,
                    device=self.device,
                    next_fn=None if self.next_tokens is None else self._pipelined(pixels),
                )[0]
                right += int(got == list(answer))
                if row < SHOWN:
                    lines.append(
                        f"[{row}] {self._text(prompt)!r} -> {self._text(got)!r} (expected {self._text(answer)!r})"
                    )
        finally:
            self.model.train(was_training)
        self.shown = self.rows[:SHOWN]
        return right / max(1, len(self.rows)), "\n".join(lines)

    def _pipelined(self, pixels: torch.Tensor):
        return lambda ids: self.next_tokens(ids, {"pixel_values": pixels})

    def _text(self, ids: list[int]) -> str:
        placeholder = int(self.model.vision_config.image_token_id)
        shown = [t for t in ids if t != placeholder]
        try:
            return self.tokenizer.decode(shown)
        except Exception as exc:  # rendering never ends a job
            return f"<not rendered: {exc}>"


def sample_images(dataset: Any, rows: list[int]) -> list[np.ndarray]:
    """The uint8 images (H, W, 3) of ``rows``' first image, as decoded by the gate."""
    out = []
    for row in rows:
        pixels = dataset.pixels[[dataset.image_rows[row][0]]] if dataset.pixels is not None else None
        if pixels is not None:
            out.append(np.asarray(pixels[0], dtype=np.uint8))
    return out


def log_sample_images(sink: Any, samples: Any, step: int) -> None:
    """The images of the shown greedy answers as MLflow artifacts ``samples/step_<N>_<row>.png`` (vision jobs)."""
    if sink is None or not hasattr(sink, "log_image") or not isinstance(samples, ImageExactMatch):
        return
    for row, image in zip(samples.shown, sample_images(samples.dataset, samples.shown), strict=False):
        sink.log_image(image, f"samples/step_{step:08d}_row{row}.png")


def held_out_for_vision(parts: Any, mesh: Any, dataset: Any, tokenizer: Any, micro: int, device) -> tuple[Any, Any]:
    """``(held-out loss, exact match)`` evaluators of the vision-language model over ``dataset``."""
    if parts.executor is not None:
        lm = parts.model.language_model
        head = lm.gather_logits if mesh.tp > 1 and hasattr(lm, "gather_logits") else (lambda logits: logits)
        loss = PipelinedImageHeldOutLoss(parts.executor, parts.model, dataset, mesh, micro, device)
        next_tokens = PipelinedNextTokens(parts.executor, head)
        return loss, ImageExactMatch(parts.model, dataset, tokenizer, device, next_tokens)
    loss = ImageHeldOutLoss(parts.model, parts.loss_fn, dataset, mesh, micro, device)
    return loss, ImageExactMatch(parts.model, dataset, tokenizer, device)


__all__ = [
    "EVAL_MICRO_BATCHES",
    "log_sample_images",
    "ImageExactMatch",
    "ImageHeldOutLoss",
    "held_out_for_vision",
    "vision_datasets",
]
