"""The generated image set of the vision demo (issue 31, item 4): deterministic, answers true of the pixels, held-out
images unseen, and the records pass the image gate.

Answers are checked against the pixels, not against the generator's bookkeeping: shapes are drawn without
antialiasing, so every non-white pixel has exactly the answer's colour; the occupied cells of the 2 x 2 grid give the
count and the first position; the fill of each shape's bounding box gives its kind (a square fills it, a circle
about pi/4 of it, a triangle about half); each bounding box is centred in its cell (within the half pixel an odd
margin leaves). The controls feed the same checker another image's answers, and the images shifted by two pixels.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from kuangchao_core.data.image_data import build_image_dataset
from kuangchao_core.data.shapes import CELLS, COLOURS, COUNTS, make_shape_set
from kuangchao_core.data.tokenizer import ByteTokenizer

SIZE = 32


def _answers_hold(pixels: np.ndarray, answers: dict[str, str]) -> bool:
    ink = (pixels != 255).any(axis=-1)
    if not (pixels[ink] == COLOURS[answers["colour"]]).all():
        return False
    half = SIZE // 2
    occupied = [
        c for c in range(4) if ink[(c // 2) * half : (c // 2 + 1) * half, (c % 2) * half : (c % 2 + 1) * half].any()
    ]
    if COUNTS[len(occupied) - 1] != answers["count"] or CELLS[occupied[0]] != answers["position"]:
        return False
    for c in occupied:
        cell = ink[(c // 2) * half : (c // 2 + 1) * half, (c % 2) * half : (c % 2 + 1) * half]
        ys, xs = cell.any(axis=1).nonzero()[0], cell.any(axis=0).nonzero()[0]
        if abs(ys[0] + ys[-1] - (half - 1)) > 1 or abs(xs[0] + xs[-1] - (half - 1)) > 1:
            return False  # not centred: a box from o to o + s - 1 with o = (half - s) // 2 sums to half - 1 or - 2
        fill = cell.sum() / ((ys[-1] - ys[0] + 1) * (xs[-1] - xs[0] + 1))
        kind = "square" if fill > 0.95 else "circle" if fill > 0.68 else "triangle"
        if kind != answers["shape"]:
            return False
    return True


def _load(root, split):
    rows = [json.loads(line) for line in (root / f"{split}.jsonl").read_text().splitlines()]
    by_image: dict[str, dict[str, str]] = {}
    for r in rows:
        by_image.setdefault(r["image"], {})[r["kind"]] = r["conversations"][1]["value"]
    return rows, by_image


@pytest.fixture(scope="module")
def shape_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    make_shape_set(root, num_train=48, num_heldout=16, seed=5, size=SIZE)
    return root


def test_answers_are_true_of_the_pixels(shape_set):
    for split in ("train", "heldout"):
        rows, by_image = _load(shape_set, split)
        assert len(rows) == 4 * len(by_image)
        items = [(np.asarray(Image.open(shape_set / img)), a) for img, a in by_image.items()]
        assert all(_answers_hold(p, a) for p, a in items), split
        wrong = [_answers_hold(items[i][0], items[(i + 1) % len(items)][1]) for i in range(len(items))]
        assert sum(wrong) < len(items) / 4  # control: another image's answers mostly fail the same checks
        assert not any(_answers_hold(np.roll(p, 2, axis=1), a) for p, a in items)  # control: off-centre shapes fail


def test_deterministic_and_heldout_unseen(shape_set, tmp_path):
    again = tmp_path / "again"
    make_shape_set(again, num_train=48, num_heldout=16, seed=5, size=SIZE)
    other = tmp_path / "other"
    make_shape_set(other, num_train=48, num_heldout=16, seed=6, size=SIZE)

    def digests(root, split):
        return [hashlib.sha256(np.asarray(Image.open(root / i)).tobytes()).hexdigest() for i in _load(root, split)[1]]

    for split in ("train", "heldout"):
        assert (shape_set / f"{split}.jsonl").read_bytes() == (again / f"{split}.jsonl").read_bytes()
        assert digests(shape_set, split) == digests(again, split)
        assert digests(shape_set, split) != digests(other, split)  # control: the seed matters
    assert not set(digests(shape_set, "heldout")) & set(digests(shape_set, "train"))


def test_records_pass_the_gate(shape_set):
    ds = build_image_dataset(shape_set / "heldout.jsonl", ByteTokenizer(), 255, 16, SIZE, 96)
    assert len(ds) == 64 and ds.report.images == 16


def test_kc_data_shapes(tmp_path):
    from kuangchao.cli.main import app

    out = CliRunner().invoke(app, ["data", "shapes", str(tmp_path / "s"), "--train", "8", "--heldout", "4"])
    assert out.exit_code == 0, out.output
    assert "8 training images (32 records), 4 held-out images (16 records)" in out.output
    assert (tmp_path / "s" / "images" / "heldout_00003.png").is_file()
