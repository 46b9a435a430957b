"""The image data gate (issue 31, item 3): hostile files made here, each refused before any compute, record named.

Every case writes ``data.jsonl`` with a good record on line 1 and the hostile one on line 2; the gate must raise
``DataError`` naming ``data.jsonl:2`` and the reason, and build nothing. The control: the same file without line 2
passes, so each refusal is the hostile record's doing.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from kuangchao_core.data import image_cache
from kuangchao_core.data.image_data import build_image_dataset
from kuangchao_core.data.images import ImageRefused, check_header
from kuangchao_core.data.tokenizer import ByteTokenizer
from kuangchao_core.errors import DataError

SIZE, PER_IMAGE, IMAGE_TOKEN = 32, 16, 255


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header (IHDR) claims ``width`` x ``height`` RGB pixels, with one tiny IDAT: a few dozen bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def _record(image, question="<image>\nWhat colour?", answer="red") -> dict:
    return {"image": image, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


def _noise(path, shape=(64, 64, 3), mode=None) -> None:
    arr = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
    Image.fromarray(arr, mode).save(path) if mode else Image.fromarray(arr).save(path)


@pytest.fixture()
def data_dir(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    _noise(root / "good.png")
    full = (root / "good.png").read_bytes()
    (root / "truncated.png").write_bytes(full[: len(full) // 2])
    (root / "bomb.png").write_bytes(_png_claiming(100_000, 100_000))  # 1e10 pixels, beyond Pillow's own limit
    (root / "bomb20k.png").write_bytes(_png_claiming(20_000, 20_000))
    (root / "big_header.png").write_bytes(_png_claiming(5_000, 5_000))  # under Pillow's limit, over ours
    (root / "text.png").write_text("this is not an image\n")
    Image.fromarray(np.full((16, 16), 40000, np.uint16)).save(root / "deep.png")  # 16-bit grey: mode I;16
    _noise(tmp_path / "outside.png")
    os.symlink(tmp_path / "outside.png", root / "link.png")
    os.symlink(root / "loop.png", root / "loop.png")
    return root


CASES = {
    "truncated": (_record("truncated.png"), "cannot be decoded"),
    "bomb_100k": (_record("bomb.png"), "decompression bomb"),
    "bomb_20k": (_record("bomb20k.png"), "decompression bomb"),
    "header_over_limit": (_record("big_header.png"), "the header says 5000x5000"),
    "text_named_png": (_record("text.png"), "not a PNG or JPEG image"),
    "mode_16bit": (_record("deep.png"), "mode 'I;16'"),
    "missing": (_record("nowhere.png"), "does not exist"),
    "dotdot": (_record("../outside.png"), "outside the data directory"),
    "symlink_out": (_record("link.png"), "outside the data directory"),
    "absolute": (_record("/etc/hostname"), "is absolute"),
    "nul_byte": (_record("good.png\u0000.png"), "cannot be resolved"),
    "symlink_loop": (_record("loop.png"), "cannot be resolved"),
    "two_placeholders": (_record("good.png", "<image> and <image>?"), "2 <image> placeholders for 1 images"),
    "no_placeholder": (_record("good.png", "What colour?"), "0 <image> placeholders for 1 images"),
    "placeholder_in_answer": (_record("good.png", answer="<image>"), "an answer holding <image>"),
}


def _gate(root, records):
    path = root / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return build_image_dataset(path, ByteTokenizer(), IMAGE_TOKEN, PER_IMAGE, SIZE, 96)


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_record_refused_and_named(data_dir, case):
    record, reason = CASES[case]
    with pytest.raises(DataError) as info:
        _gate(data_dir, [_record("good.png"), record])
    msg = str(info.value)
    assert "data.jsonl:2: " in msg and reason in msg, msg
    assert "data.jsonl:1" not in msg
    assert len(_gate(data_dir, [_record("good.png")])) == 1  # control: the good record alone passes


def test_every_refusal_reported_at_once(data_dir):
    hostile = [r for r, _ in CASES.values()]
    with pytest.raises(DataError) as info:
        _gate(data_dir, [_record("good.png"), *hostile])
    msg = str(info.value)
    assert f"{len(hostile)} of {len(hostile) + 1} image records refused" in msg
    assert f"and {len(hostile) - 8} more" in msg  # the first 8 named, the rest counted


def test_pixel_limit_read_from_header_before_decoding(data_dir, monkeypatch):
    """The explicit limit refuses a real 64x64 image from its header: the decoder is never reached."""
    decoded = []
    real = image_cache.decode_image
    monkeypatch.setattr(image_cache, "decode_image", lambda *a, **k: decoded.append(a) or real(*a, **k))
    with pytest.raises(ImageRefused, match="64x64 = 4096 pixels, above the limit 4000"):
        check_header(data_dir / "good.png", max_pixels=4000)
    with pytest.raises(DataError, match="data.jsonl:1: .* above the limit 4000"):
        path = data_dir / "data.jsonl"
        path.write_text(json.dumps(_record("good.png")) + "\n")
        build_image_dataset(path, ByteTokenizer(), IMAGE_TOKEN, PER_IMAGE, SIZE, 96, max_pixels=4000)
    assert decoded == []
    assert check_header(data_dir / "good.png", max_pixels=4096) == (64, 64, "RGB")  # control: at the limit
    assert len(build_image_dataset(path, ByteTokenizer(), IMAGE_TOKEN, PER_IMAGE, SIZE, 96, max_pixels=4096)) == 1
    assert len(decoded) == 1  # ... and then the image is decoded


def test_symlink_inside_the_data_directory_is_followed(data_dir):
    """A link that stays inside the directory is fine (the refusal above is about leaving it)."""
    os.symlink(data_dir / "good.png", data_dir / "alias.png")
    assert len(_gate(data_dir, [_record("alias.png")])) == 1


def test_placeholder_id_in_text_refused(data_dir):
    """Text that encodes to the placeholder id would be read as an image: refused. (UTF-8 never holds byte 255, the
    byte tokenizer's default placeholder, so a tokenizer that maps '~' to it stands in for one that can.)"""

    class Tok(ByteTokenizer):
        def encode(self, text):
            return [IMAGE_TOKEN if ch == "~" else b for ch in text for b in ch.encode()]

    path = data_dir / "data.jsonl"
    path.write_text(json.dumps(_record("good.png", answer="~")) + "\n")
    with pytest.raises(DataError, match="data.jsonl:1: the text encodes to the image placeholder id 255"):
        build_image_dataset(path, Tok(), IMAGE_TOKEN, PER_IMAGE, SIZE, 96)
    path.write_text(json.dumps(_record("good.png", answer="-")) + "\n")
    assert len(build_image_dataset(path, Tok(), IMAGE_TOKEN, PER_IMAGE, SIZE, 96)) == 1  # control


def test_truncated_images_allowed_globally_stops_the_gate(data_dir, monkeypatch):
    """Pillow's process-wide switch that decodes truncated files would let one through: the gate refuses to run."""
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(DataError, match="LOAD_TRUNCATED_IMAGES is set"):
        _gate(data_dir, [_record("good.png")])
    assert images_decode_truncated(data_dir)  # control: with it set, the truncated file really does decode


def images_decode_truncated(root) -> bool:
    from kuangchao_core.data.images import decode_image

    return decode_image(root / "truncated.png", SIZE).shape == (SIZE, SIZE, 3)
