"""Images bounded by what decoding would allocate (issue 38, item 1), not only by the header's pixel count.

The attack: a 1 x 400 000 RGB PNG (a few KB) passed ``data.images.max_pixels`` from its header, and the resize of its
short side to the tower's size stretched its long side in proportion: 32 x 12 800 000 pixels, 4 GB and a minute per
image in every rank's data gate. Now the header's aspect ratio (``data.images.max_aspect_ratio``) and the size the
resize would give (``data.images.max_pixels`` again) are checked before anything is decoded. Peak memory is read from
the kernel (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), so Pillow's own buffers count too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kuangchao_core.data.image_data import build_image_dataset, gate_settings
from kuangchao_core.data.images import (
    DEFAULT_MAX_PIXELS,
    ImageRefused,
    check_header,
    decode_image,
    resized_size,
    size_refusal,
)
from kuangchao_core.data.tokenizer import ByteTokenizer
from kuangchao_core.errors import DataError

SIZE, PER_IMAGE, IMAGE_TOKEN = 32, 16, 255
#: the limits of these tests: the attack's 400 000 pixels pass the pixel cap, as under the default
MAX_PIXELS, MAX_RATIO = 1 << 20, 20.0
#: one buffer of a passing image at the cap (Pillow keeps RGB as 4 bytes a pixel): a refusal must stay below it
ONE_BUFFER = 4 * MAX_PIXELS


def _tall(path: Path, height: int) -> Path:
    Image.new("RGB", (1, height), (200, 30, 30)).save(path)
    return path


def _peak_growth(fn) -> tuple[object, int, float]:
    """``(fn()'s result or its ImageRefused, the peak resident growth in bytes, seconds)``."""

    def rss(key: str) -> int:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets the peak (VmHWM) to the current resident size
    base, start = rss("VmRSS:"), time.perf_counter()
    try:
        out = fn()
    except ImageRefused as exc:
        out = exc
    return out, rss("VmHWM:") - base, time.perf_counter() - start


def test_the_tall_strip_is_refused_from_its_header(tmp_path):
    path = _tall(tmp_path / "tall.png", 400_000)
    assert path.stat().st_size < 4096  # the attack's file: a few KB
    decode_image(_tall(tmp_path / "small.png", 20), SIZE)  # Pillow's PNG plugin loaded before the measurement
    out, grew, seconds = _peak_growth(lambda: decode_image(path, SIZE, MAX_PIXELS, max_aspect_ratio=MAX_RATIO))
    assert isinstance(out, ImageRefused) and "data.images.max_aspect_ratio" in out.reason, out
    assert "1x400000" in out.reason
    assert grew < ONE_BUFFER, grew  # nothing decoded
    assert seconds < 1.0, seconds
    # the pre-fix check (the header's pixels alone) passed it, and the resize would have made 409 600 000 pixels
    assert size_refusal(1, 400_000, DEFAULT_MAX_PIXELS, max_aspect_ratio=float("inf")) is None
    assert resized_size(1, 400_000, SIZE) == (SIZE, SIZE * 400_000)


def test_control_with_the_caps_off_the_resize_stretches_the_long_side(tmp_path):
    """The attack's behaviour on a 1 x 20 000 strip (cheap): with both caps off it is decoded, and the resize's
    32 x 640 000 intermediate takes far more than the bound the refusal is held to."""
    path = _tall(tmp_path / "tall.png", 20_000)
    decode_image(_tall(tmp_path / "small.png", 20), SIZE)
    stretched = resized_size(1, 20_000, SIZE)
    assert stretched == (SIZE, 640_000)
    out, grew, _ = _peak_growth(lambda: decode_image(path, SIZE, 1 << 32, max_aspect_ratio=float(1 << 32)))
    assert isinstance(out, np.ndarray) and out.shape == (SIZE, SIZE, 3)
    assert grew >= 3 * stretched[0] * stretched[1] > ONE_BUFFER  # at least the resized RGB bytes
    with pytest.raises(ImageRefused, match="max_aspect_ratio"):  # ... which the caps refuse
        decode_image(path, SIZE, MAX_PIXELS, max_aspect_ratio=MAX_RATIO)


def test_resized_area_capped_by_max_pixels(tmp_path):
    """A 100 x 150 image (15 000 pixels, ratio 1.5) resized to a 1024-pixel tower would be 1024 x 1536 pixels: over
    the cap, refused from the header; the same file for the 32-pixel tower passes (the control)."""
    path = tmp_path / "wide.png"
    Image.new("RGB", (100, 150), (0, 90, 200)).save(path)
    with pytest.raises(ImageRefused, match=r"1024x1536 = 1572864 pixels, above the limit 1048576 \(data.images.max"):
        check_header(path, MAX_PIXELS, MAX_RATIO, size=1024)
    assert check_header(path, MAX_PIXELS, MAX_RATIO, size=SIZE) == (100, 150, "RGB")
    assert check_header(path, MAX_PIXELS, MAX_RATIO) == (100, 150, "RGB")  # the header alone passes


def test_aspect_ratio_limit_is_inclusive(tmp_path):
    assert size_refusal(1, 20, MAX_PIXELS, 20.0) is None
    assert "21 (1x21) is above the limit 20" in size_refusal(1, 21, MAX_PIXELS, 20.0)
    assert "above the limit 20" in size_refusal(21, 1, MAX_PIXELS, 20.0)


def test_the_gate_names_the_record_and_the_field(tmp_path):
    from kuangchao_core.config import config_from_dict

    _tall(tmp_path / "tall.png", 400_000)
    Image.new("RGB", (64, 48), (10, 200, 10)).save(tmp_path / "good.png")
    lines = [
        {
            "image": name,
            "conversations": [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "x"}],
        }
        for name in ("good.png", "tall.png")
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    settings = gate_settings(config_from_dict({"task": {"name": "t"}, "model": {"vision": {}}}).data)
    assert settings["max_aspect_ratio"] == 20.0

    def build(**gate):
        return build_image_dataset(path, ByteTokenizer(), IMAGE_TOKEN, PER_IMAGE, SIZE, 96, **gate)

    start = time.perf_counter()
    with pytest.raises(DataError) as info:
        build(**settings)
    assert time.perf_counter() - start < 1.0
    msg = str(info.value)
    assert "data.jsonl:2: " in msg and "tall.png" in msg and "data.images.max_aspect_ratio" in msg, msg
    assert "data.jsonl:1" not in msg
    path.write_text(json.dumps(lines[0]) + "\n", encoding="utf-8")
    assert len(build(**settings)) == 1  # a normal image passes under the defaults
