"""Reading one image as the vision tower sees it (issue 31): Pillow decode, RGB, resize, crop, rescale, normalise.

The steps are those of transformers' ``CLIPImageProcessor`` (its Pillow backend) with ``size={"shortest_edge": S}``
and ``crop_size=S`` for the tower's ``image_size`` S:

1. RGB: a mode with transparency (``RGBA``, ``LA``, ``PA``, ``P`` with a transparent index) is composited onto white,
   any other accepted mode converted with Pillow's ``convert("RGB")``;
2. resize with Pillow's bicubic filter so the shorter side is S and the longer ``int(S * long / short)``;
3. center crop S x S (top = ``(h - S) // 2``, left = ``(w - S) // 2``);
4. rescale by 1/255 and normalise with CLIP's mean and std, per channel.

Steps 1-3 are done on 8-bit pixels and give exactly transformers' bytes (the same Pillow calls): :func:`decode_image`
returns them as a ``(S, S, 3)`` uint8 array, the form the decode cache keeps (``data.image_cache``). Step 4 is
:func:`normalise`, done per batch in float64 and returned in the dtype asked for (transformers works in float32).

Modes: 8-bit ones are converted (``1``, ``L``, ``LA``, ``P``, ``PA``, ``RGB``, ``RGBA``, ``RGBX``, ``CMYK``,
``YCbCr``, ``La``, ``RGBa``); the others (``I``, ``I;16*``, ``F``: 16/32-bit integer and float pixels; ``LAB``,
``HSV``) are refused, because Pillow's RGB conversion clips them to 0..255 instead of scaling and the image would be
silently wrong. Formats: PNG and JPEG (others are refused, whatever the file is named).

Size: the header's width x height is checked against ``max_pixels`` before any pixel is decoded (``Image.open``
reads only the header), so a small file claiming a huge image costs nothing; Pillow's own decompression-bomb error
(twice ``Image.MAX_IMAGE_PIXELS``) is reported the same way.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

#: CLIP's normalisation (transformers' ``OPENAI_CLIP_MEAN`` / ``OPENAI_CLIP_STD``)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: default pixel limit (width x height) checked from the header: 4096 x 4096
DEFAULT_MAX_PIXELS = 1 << 24
FORMATS = ("PNG", "JPEG")
CONVERTED_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr")


class ImageRefused(ValueError):
    """An image file the data gate refuses; ``reason`` says why (the caller names the record)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _open(path: Path, max_pixels: int):
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(path, formats=list(FORMATS))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageRefused(f"decompression bomb: {exc}") from None
    except UnidentifiedImageError:
        raise ImageRefused(f"not a {' or '.join(FORMATS)} image (Pillow cannot identify it)") from None
    except OSError as exc:
        raise ImageRefused(f"cannot be read: {exc}") from None
    w, h = img.size
    if w < 1 or h < 1 or w * h > max_pixels:
        img.close()
        raise ImageRefused(
            f"decompression bomb: the header says {w}x{h} = {w * h} pixels, above the limit {max_pixels}"
        )
    if img.mode not in CONVERTED_MODES:
        img.close()
        raise ImageRefused(
            f"mode {img.mode!r} is not converted to RGB (16/32-bit and float pixels would be clipped, not scaled); "
            f"save it as 8-bit ({', '.join(CONVERTED_MODES)})"
        )
    return img


def check_header(path: str | Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int, str]:
    """``(width, height, mode)`` from the file's header, nothing decoded; raises :class:`ImageRefused`."""
    img = _open(Path(path), max_pixels)
    try:
        return img.size[0], img.size[1], img.mode
    finally:
        img.close()


def _to_rgb(img):
    from PIL import Image

    if "A" in img.getbands() or "a" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def resized_size(width: int, height: int, size: int) -> tuple[int, int]:
    """``(width, height)`` after resizing the shorter side to ``size`` (transformers' rounding: ``int`` truncates)."""
    if width <= height:
        return size, int(size * height / width)
    return int(size * width / height), size


def decode_image(path: str | Path, size: int, max_pixels: int = DEFAULT_MAX_PIXELS, resample: str = "bicubic"):
    """Steps 1-3 of the module docstring: the ``(size, size, 3)`` uint8 pixels of the file at ``path``; raises
    :class:`ImageRefused` for a file the gate refuses (a truncated or corrupt one included)."""
    from PIL import Image

    filters = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}
    img = _open(Path(path), max_pixels)
    try:
        try:
            img.load()
            rgb = _to_rgb(img)
        except (OSError, ValueError, SyntaxError) as exc:  # truncated data, a bad chunk or CRC, a broken JPEG
            raise ImageRefused(f"cannot be decoded: {exc}") from None
    finally:
        img.close()
    w, h = resized_size(*rgb.size, size)
    arr = np.asarray(rgb.resize((w, h), resample=filters[resample]), dtype=np.uint8)
    top, left = (h - size) // 2, (w - size) // 2
    return np.ascontiguousarray(arr[top : top + size, left : left + size])


def normalise(pixels, dtype=None):
    """Step 4: uint8 pixels ``(..., S, S, 3)`` -> ``(..., 3, S, S)`` tensor ``(x / 255 - mean) / std``, computed in
    float64 and returned in ``dtype`` (default torch's default dtype)."""
    import torch

    x = torch.from_numpy(np.array(pixels, dtype=np.float64)) / 255.0
    mean = torch.tensor(CLIP_MEAN, dtype=torch.float64)
    std = torch.tensor(CLIP_STD, dtype=torch.float64)
    out = ((x - mean) / std).movedim(-1, -3).contiguous()
    return out.to(dtype or torch.get_default_dtype())
