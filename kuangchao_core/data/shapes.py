"""A small image set the project generates itself (issue 31's demo): coloured shapes on a white canvas, with
questions and one-word answers about their colour, shape, position and count.

An image (``size`` x ``size`` pixels, the vision tower's ``image_size``) is cut into a 2 x 2 grid of cells; 1 to 4
copies of one shape (square, circle, triangle) in one colour (red, green, blue, yellow) sit in distinct cells, each
drawn with a seeded side (half a cell up to a cell less one pixel) centred in its cell. Centring makes a shape's pixels
fall the same way on the patch grid whatever its size (the demo's tower cuts a 32 px image into 8 px patches: a cell
is 2 x 2 patches, each holding about a quarter of the shape); with random offsets a small tower trained for minutes did
not learn shape or count (issue 31, docs/architecture.md). Every image is asked four questions, one record each, in
LLaVA's form (``{"image": ..., "conversations": [human "<image>\\n<question>", gpt "<answer>"]}``):

- ``What colour are the shapes?`` -> ``red`` | ``green`` | ``blue`` | ``yellow``
- ``What shape are they?`` -> ``square`` | ``circle`` | ``triangle``
- ``How many shapes are there?`` -> ``one`` .. ``four``
- ``Where is the first shape?`` -> ``top left`` | ``top right`` | ``bottom left`` | ``bottom right`` (the first
  occupied cell in reading order)

Everything follows from ``seed``: image ``i`` of a split is drawn from ``numpy.random.default_rng([seed, split,
i])``. The held-out split holds images whose pixels equal no training image's (an identical draw is redrawn), so
held-out questions are about unseen images. :func:`make_shape_set` writes ``images/<split>_<i>.png``,
``train.jsonl``, ``heldout.jsonl`` and ``meta.json`` under a directory.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from kuangchao_core.errors import DataError

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("square", "circle", "triangle")
CELLS = ("top left", "top right", "bottom left", "bottom right")
COUNTS = ("one", "two", "three", "four")
QUESTIONS = {
    "colour": "What colour are the shapes?",
    "shape": "What shape are they?",
    "count": "How many shapes are there?",
    "position": "Where is the first shape?",
}
SPLITS = {"train": 0, "heldout": 1}


def draw_scene(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict[str, str]]:
    """One image (``(size, size, 3)`` uint8) and its answers, from ``rng``."""
    from PIL import Image, ImageDraw

    if size < 8:
        raise DataError(f"shape images need at least 8 x 8 pixels, got {size}")
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    count = int(rng.integers(1, len(CELLS) + 1))
    cells = sorted(int(c) for c in rng.choice(len(CELLS), size=count, replace=False))
    img = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    half = size // 2
    for c in cells:
        side = int(rng.integers(max(3, half // 2), half - 1 + 1))
        x0 = (c % 2) * half + (half - side) // 2
        y0 = (c // 2) * half + (half - side) // 2
        box = (x0, y0, x0 + side - 1, y0 + side - 1)
        fill = COLOURS[colour]
        if shape == "square":
            draw.rectangle(box, fill=fill)
        elif shape == "circle":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon([(x0 + (side - 1) / 2, y0), (x0, y0 + side - 1), (x0 + side - 1, y0 + side - 1)], fill=fill)
    answers = {"colour": colour, "shape": shape, "count": COUNTS[count - 1], "position": CELLS[cells[0]]}
    return np.asarray(img, dtype=np.uint8), answers


def _split(n: int, split: str, seed: int, size: int, avoid: set[str]) -> list[tuple[np.ndarray, dict[str, str]]]:
    out, seen = [], set(avoid)
    for i in range(n):
        for attempt in range(1000):
            pixels, answers = draw_scene(np.random.default_rng([seed, SPLITS[split], i, attempt]), size)
            digest = hashlib.sha256(pixels.tobytes()).hexdigest()
            if split == "train" or digest not in seen:
                break
        else:
            raise DataError(f"could not draw {n} held-out images unlike the training ones at size {size}")
        seen.add(digest)
        out.append((pixels, answers))
    return out


def shape_records(image: str, answers: dict[str, str]) -> list[dict[str, Any]]:
    """The four question records of one image (LLaVA's conversation form)."""
    return [
        {
            "image": image,
            "conversations": [
                {"from": "human", "value": f"<image>\n{QUESTIONS[kind]}"},
                {"from": "gpt", "value": answers[kind]},
            ],
            "kind": kind,
        }
        for kind in QUESTIONS
    ]


def make_shape_set(
    out_dir: str | Path, num_train: int = 2048, num_heldout: int = 64, seed: int = 0, size: int = 32
) -> dict[str, Any]:
    """Write the set under ``out_dir`` (module docstring); returns ``meta.json``'s content (the files, counts)."""
    from PIL import Image

    if num_train < 1 or num_heldout < 0:
        raise DataError(f"shape set: num_train must be >= 1 and num_heldout >= 0, got {num_train}, {num_heldout}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    train = _split(num_train, "train", seed, size, set())
    train_digests = {hashlib.sha256(p.tobytes()).hexdigest() for p, _ in train}
    heldout = _split(num_heldout, "heldout", seed, size, train_digests)
    meta: dict[str, Any] = {"seed": seed, "size": size, "images": {}, "records": {}}
    for split, items in (("train", train), ("heldout", heldout)):
        lines = []
        for i, (pixels, answers) in enumerate(items):
            rel = f"images/{split}_{i:05d}.png"
            Image.fromarray(pixels).save(out / rel)
            lines += [json.dumps(r) for r in shape_records(rel, answers)]
        (out / f"{split}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        meta["images"][split], meta["records"][split] = len(items), len(lines)
    meta["files"] = {"train": str(out / "train.jsonl"), "heldout": str(out / "heldout.jsonl")}
    (out / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return meta
