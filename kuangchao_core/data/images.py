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

Size (issue 38): what decoding will allocate is bounded from the header, before any pixel is decoded (``Image.open``
reads only the header), by :func:`size_refusal`: the header's width x height against ``max_pixels``, the long side
over the short one against ``max_aspect_ratio``, and the size step 2 would resize to (before the crop) against
``max_pixels`` again. So a small file claiming a huge image costs nothing, and neither does a 1 x 400 000 strip
that step 2 would otherwise stretch to ``S x 400 000 S``. Every buffer a passing image makes (the decoded pixels,
their RGB conversion, either pass of the resize) then holds at most ``max_pixels`` pixels of 4 bytes. Pillow's own
decompression-bomb error (twice ``Image.MAX_IMAGE_PIXELS``) is reported the same way.
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
#: default limit on the long side over the short one, checked from the header
DEFAULT_MAX_ASPECT_RATIO = 20.0
FORMATS = ("PNG", "JPEG")
CONVERTED_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr")


class ImageRefused(ValueError):
    """An image file the data gate refuses; ``reason`` says why (the caller names the record)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def size_refusal(
    width: int,
    height: int,
    max_pixels: int,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
    size: int | None = None,
) -> str | None:
    """Why a ``width`` x ``height`` image is refused before decoding (None: it passes), naming the limit's field:
    its pixels over ``max_pixels``, its aspect ratio over ``max_aspect_ratio``, or (given the tower's ``size``) its
    size after step 2's resize over ``max_pixels``."""
    w, h = width, height
    if w < 1 or h < 1 or w * h > max_pixels:
        return f"decompression bomb: the header says {w}x{h} = {w * h} pixels, above the limit {max_pixels} (data.images.max_pixels)"
    if max(w, h) > max_aspect_ratio * min(w, h):
        return (
            f"aspect ratio {max(w, h) / min(w, h):.6g} ({w}x{h}) is above the limit {max_aspect_ratio:g} "
            "(data.images.max_aspect_ratio): resizing its short side would stretch its long side as many times"
        )
    if size is not None:
        rw, rh = resized_size(w, h, size)
        if rw * rh > max_pixels:
            return (
                f"{w}x{h} resized to the tower's {size} px short side is {rw}x{rh} = {rw * rh} pixels, above the limit "
                f"{max_pixels} (data.images.max_pixels)"
            )
    return None


def _open(path: Path, max_pixels: int, max_aspect_ratio: float, size: int | None):
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
    refusal = size_refusal(*img.size, max_pixels, max_aspect_ratio, size)
    if refusal is not None:
        img.close()
        raise ImageRefused(refusal)
    if img.mode not in CONVERTED_MODES:
        img.close()
        raise ImageRefused(
            f"mode {img.mode!r} is not converted to RGB (16/32-bit and float pixels would be clipped, not scaled); "
            f"save it as 8-bit ({', '.join(CONVERTED_MODES)})"
        )
    return img


def check_header(
    path: str | Path,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
    size: int | None = None,
) -> tuple[int, int, str]:
    """``(width, height, mode)`` from the file's header, nothing decoded (:func:`size_refusal`'s limits, the resized
    area given the tower's ``size``); raises :class:`ImageRefused`."""
    img = _open(Path(path), max_pixels, max_aspect_ratio, size)
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


def decode_image(
    path: str | Path,
    size: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    resample: str = "bicubic",
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
):
    """Steps 1-3 of the module docstring: the ``(size, size, 3)`` uint8 pixels of the file at ``path``; raises
    :class:`ImageRefused` for a file the gate refuses (a truncated or corrupt one included, and any that
    :func:`size_refusal` refuses from its header)."""
    from PIL import Image

    filters = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}
    img = _open(Path(path), max_pixels, max_aspect_ratio, size)
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
