"""Image-text training data (issue 31): the data gate over image records and the dataset the trainer reads.

:func:`build_image_dataset` is the one entry point. Before any compute it

1. reads every record (``kuangchao_core.data.image_records``: the fields, the paths — missing ones, absolute ones
   and ones that leave the data directory through ``..`` or a symlink — and the placeholder count against the
   images), then
2. decodes every distinct image once on the decode pool (:func:`~kuangchao_core.data.image_pool.ordered_map`),
   through the content cache when ``cache_dir`` is set: the header first (its pixels, its aspect ratio and its size
   once resized to the tower's: decompression bombs and strips that the resize would stretch, issue 38), then
   the format, the mode and the full decode (truncated or corrupt files, a text file named ``.png``).

Every refusal names its record (``file:line``) and the reason; the gate collects them all and raises one
``DataError`` listing the first few and the count, so nothing is trained on a refused record. The decoded pixels
live in one uint8 array ``(images, S, S, 3)``; a row of the dataset is a ``packing: none`` SFT row (``input_ids``,
``labels`` -100 wherever the loss is not taken, placeholders included) plus its images normalised as CLIP's
processor does (``pixel_values``, ``(images, 3, S, S)``). With ``keep_pixels=False`` and a cache, the gate keeps
no pixels: each micro-batch reads its images back from the decode cache on the pool (:class:`CachedPixels`), in the
loader's prefetch thread, so memory does not grow with the data set. :meth:`ImageTextDataset.collate` stacks the rows of a
micro-batch and concatenates their images in row order — the order :func:`~kuangchao_core.models.vlm.
merge_image_features` fills the placeholders in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kuangchao_core.data.image_cache import ImageCache
from kuangchao_core.data.image_pool import ordered_map
from kuangchao_core.data.image_records import ImageExample, encode_image_record
from kuangchao_core.data.images import DEFAULT_MAX_ASPECT_RATIO, DEFAULT_MAX_PIXELS, ImageRefused, normalise
from kuangchao_core.data.sft import iter_sft_records
from kuangchao_core.errors import DataError

#: refusals named in the gate's error (the rest are counted)
NAMED = 8


@dataclass
class ImageReport:
    """What the gate read, refused, dropped and decoded."""

    records: int = 0
    examples: int = 0
    images: int = 0
    dropped_too_long: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    refused: list[str] = field(default_factory=list)


def _rows(path: str | Path, image_root: str | Path | None):
    for record, where in iter_sft_records(path):
        source = re.sub(r"(:\d+|#row\d+)$", "", where)  # file:line (JSON lines) or file#rowN (parquet)
        root = Path(image_root) if image_root is not None else Path(source).parent
        yield record, where, root


def gate_image_records(
    path: str | Path,
    tokenizer: Any,
    image_token_id: int,
    per_image: int,
    image_size: int,
    seq_len: int,
    image_root: str | Path | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
    workers: int = 4,
    cache_dir: str | Path | None = None,
    keep_pixels: bool = True,
) -> tuple[list[ImageExample], list[list[int]], Any, ImageReport]:
    """The gate (module docstring): ``(examples, each example's image rows, pixels, report)``; raises ``DataError``
    naming every refused record (the first :data:`NAMED`). A record longer than ``seq_len + 1`` tokens is dropped
    and counted (``report.dropped_too_long``; never truncated, which could cut an image's placeholders). ``pixels`` is the uint8 array of every image, or with
    ``keep_pixels=False`` (``cache_dir`` needed) a :class:`CachedPixels` reading them back from the cache per batch."""
    from PIL import ImageFile

    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise DataError(
            "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set in this process: a truncated image would decode with its "
            "missing rows filled in and pass the data gate; unset it"
        )
    if not keep_pixels and cache_dir is None:
        raise DataError("image data: keep_pixels=False reads the images back from the cache; set data.cache_dir")
    report, examples, refused, order = ImageReport(), [], [], {}
    for record, where, root in _rows(path, image_root):
        report.records += 1
        order[where] = report.records
        try:
            ex = encode_image_record(record, where, root, tokenizer, image_token_id, per_image)
        except DataError as exc:
            refused.append((report.records, str(exc)))
            continue
        if ex.ids[:seq_len].count(image_token_id) != per_image * len(ex.images) or len(ex.ids) > seq_len + 1:
            report.dropped_too_long += 1  # a row holds seq_len + 1 tokens and every placeholder is an input
            continue
        examples.append(ex)
    files = sorted({p for ex in examples for p in ex.images})
    cache = ImageCache(cache_dir, image_size)
    pixels = np.zeros((len(files) if keep_pixels else 0, image_size, image_size, 3), dtype=np.uint8)
    bad: dict[Path, str] = {}
    for i, (arr, err) in enumerate(ordered_map(lambda p: cache.load(p, max_pixels, max_aspect_ratio), files, workers)):
        if err is None:
            if keep_pixels:
                pixels[i] = arr
        elif isinstance(err, ImageRefused):
            bad[files[i]] = err.reason
        else:
            raise err
    for ex in examples:
        for p in ex.images:
            if p in bad:
                refused.append((order[ex.where], f"{ex.where}: image {p} refused: {bad[p]}"))
    report.refused = [msg for _, msg in sorted(refused, key=lambda r: r[0])]  # in the records' order
    if report.refused:
        more = len(report.refused) - NAMED
        raise DataError(
            f"data gate: {len(report.refused)} of {report.records} image records refused, nothing trained:\n  "
            + "\n  ".join(report.refused[:NAMED])
            + (f"\n  ... and {more} more" if more > 0 else "")
        )
    if not examples:
        raise DataError(f"data gate: none of {report.records} image records fits data.seq_len {seq_len}")
    row = {p: i for i, p in enumerate(files)}
    report.examples, report.images = len(examples), len(files)
    report.cache_hits, report.cache_misses = cache.hits, cache.misses
    store = pixels if keep_pixels else CachedPixels(files, cache, max_pixels, workers, max_aspect_ratio)
    return examples, [[row[p] for p in ex.images] for ex in examples], store, report


class CachedPixels:
    """The gated images read back from the decode cache on the decode pool, a batch at a time: ``store[rows]`` is
    the ``(len(rows), S, S, 3)`` uint8 array, in ``rows``' order whatever the number of workers."""

    def __init__(
        self,
        files: list[Path],
        cache: ImageCache,
        max_pixels: int,
        workers: int,
        max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
    ):
        self.files, self.cache, self.max_pixels, self.workers = files, cache, max_pixels, workers
        self.max_aspect_ratio = max_aspect_ratio

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, rows: list[int]) -> np.ndarray:
        out = np.zeros((len(rows), self.cache.size, self.cache.size, 3), dtype=np.uint8)
        for i, (arr, err) in enumerate(
            ordered_map(
                lambda r: self.cache.load(self.files[r], self.max_pixels, self.max_aspect_ratio), rows, self.workers
            )
        ):
            if err is not None:  # changed on disk since the gate passed it
                raise DataError(f"image {self.files[rows[i]]} no longer passes the data gate: {err}") from err
            out[i] = arr
        return out


class ImageTextDataset:
    """``packing: none`` rows of image examples: ``input_ids``, ``labels`` (seq_len) and ``pixel_values``."""

    def __init__(self, examples, image_rows, pixels, seq_len: int, pad_id: int, report=None, dtype=None):
        self.examples, self.image_rows, self.pixels = examples, image_rows, pixels
        self.seq_len, self.pad_id, self.report, self.dtype = seq_len, pad_id, report, dtype

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**self._text(index), "pixel_values": self.pixel_values([index])}

    def _text(self, index: int) -> dict[str, torch.Tensor]:
        ex = self.examples[index]
        width = self.seq_len + 1
        ids = torch.full((width,), self.pad_id, dtype=torch.long)
        trained = torch.zeros(width, dtype=torch.bool)
        ids[: len(ex.ids)] = torch.tensor(ex.ids, dtype=torch.long)
        trained[: len(ex.ids)] = torch.tensor(ex.trained, dtype=torch.bool)
        labels = torch.where(trained[1:], ids[1:], torch.full_like(ids[1:], -100))
        return {"input_ids": ids[:-1], "labels": labels}

    def pixel_values(self, indices: list[int]) -> torch.Tensor:
        """The images of rows ``indices``, in row order, normalised: ``(images, 3, S, S)``."""
        return normalise(self.pixels[[r for i in indices for r in self.image_rows[i]]], self.dtype)

    def question(self, index: int) -> tuple[list[int], list[int], torch.Tensor]:
        """Row ``index`` as an exact-match case: the prompt's ids (up to the first trained token, placeholders
        included), the trained ids after it (the answer and its end) and the row's ``pixel_values``."""
        ex = self.examples[index]
        start = ex.trained.index(True)
        answer = [t for t, on in zip(ex.ids[start:], ex.trained[start:], strict=True) if on]
        return ex.ids[:start], answer, self.pixel_values([index])

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The micro-batch of rows ``indices``: ids and labels stacked, images concatenated in row order (one read
        of the batch's images: from memory, or from the cache on the decode pool)."""
        items = [self._text(i) for i in indices]
        out = {k: torch.stack([it[k] for it in items]) for k in ("input_ids", "labels")}
        out["pixel_values"] = self.pixel_values(indices)
        return out


def gate_settings(data_cfg: Any) -> dict[str, Any]:
    """:func:`build_image_dataset`'s gate keywords from a ``data`` config section (``data.images``,
    ``data.cache_dir``)."""
    return {
        "max_pixels": int(data_cfg.images.max_pixels),
        "max_aspect_ratio": float(data_cfg.images.max_aspect_ratio),
        "workers": int(data_cfg.images.decode_workers),
        "cache_dir": data_cfg.cache_dir or None,
    }


def placeholder_settings(vision: Any, vocab_size: int) -> dict[str, int]:
    """``image_token_id``, ``per_image`` and ``image_size`` of :func:`build_image_dataset` from a ``model.vision``
    section (or the model's ``VisionConfig``): an unset placeholder id is the vocabulary's last, as the model's."""
    from kuangchao_core.config.vision_schema import image_tokens_per_image

    token = vision.image_token_id if vision.image_token_id is not None else vocab_size - 1
    return {"image_token_id": int(token), "per_image": image_tokens_per_image(vision), "image_size": vision.image_size}


def build_image_dataset(
    path: str | Path,
    tokenizer: Any,
    image_token_id: int,
    per_image: int,
    image_size: int,
    seq_len: int,
    **gate: Any,
) -> ImageTextDataset:
    """The gated :class:`ImageTextDataset` of the records under ``path`` (``gate``: :func:`gate_image_records`'s
    keywords ``image_root``, ``max_pixels``, ``max_aspect_ratio``, ``workers``, ``cache_dir``; ``dtype`` of ``pixel_values``)."""
    dtype = gate.pop("dtype", None)
    examples, rows, pixels, report = gate_image_records(
        path, tokenizer, image_token_id, per_image, image_size, seq_len, **gate
    )
    return ImageTextDataset(examples, rows, pixels, seq_len, int(tokenizer.sep_id), report, dtype)
