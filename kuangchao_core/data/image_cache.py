"""Decoded images cached by content (issue 31): ``<cache_dir>/images/<sha256[:2]>/<sha256>-<size>-<resample>.u8``.

An entry is the ``(size, size, 3)`` uint8 pixels :func:`~kuangchao_core.data.images.decode_image` returns (after
RGB, resize and crop; the normalisation is redone per batch), raw bytes with no header. The key is the SHA-256 of
the file's bytes with the preprocessing settings, so a renamed or copied file hits, an edited one misses, and two
image sizes keep separate entries. Unlike the text cache (keyed by a stat, so a warm start reads no raw file) each
file is read and hashed on every start: hashing is far cheaper than decoding, and a stat could not tell a file
rewritten within the mtime's resolution. Entries are written to a private name and renamed into place, so a
reader sees a whole entry or none; a corrupt or wrong-sized entry is rebuilt. Only decodable images get an entry:
a refused file is decoded (and refused) again each time.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numpy as np

from kuangchao_core.data.images import DEFAULT_MAX_ASPECT_RATIO, DEFAULT_MAX_PIXELS, check_header, decode_image

VERSION = 1


def fingerprint(path: Path) -> str:
    """SHA-256 of the file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class ImageCache:
    """Decoded pixels under ``root`` (``None``: no cache, every image decoded); ``hits``/``misses`` count lookups."""

    def __init__(self, root: str | Path | None, size: int, resample: str = "bicubic"):
        self.root = None if root is None else Path(root) / "images"
        self.size, self.resample = int(size), resample
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def _entry(self, digest: str) -> Path:
        assert self.root is not None
        return self.root / digest[:2] / f"{digest}-{self.size}-{self.resample}-v{VERSION}.u8"

    def load(
        self, path: Path, max_pixels: int = DEFAULT_MAX_PIXELS, max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO
    ) -> np.ndarray:
        """The pixels of ``path``: from the cache when an entry of its content exists, else decoded (and stored).
        The header is checked against the limits either way (``images.size_refusal``: pixels, aspect ratio, resized
        area); raises ``ImageRefused``."""
        check_header(path, max_pixels, max_aspect_ratio, self.size)
        if self.root is None:
            return decode_image(path, self.size, max_pixels, self.resample, max_aspect_ratio)
        entry = self._entry(fingerprint(path))
        shape = (self.size, self.size, 3)
        if entry.is_file() and entry.stat().st_size == int(np.prod(shape)):
            with self._lock:
                self.hits += 1
            return np.fromfile(entry, dtype=np.uint8).reshape(shape)
        with self._lock:
            self.misses += 1
        pixels = decode_image(path, self.size, max_pixels, self.resample, max_aspect_ratio)
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.{id(pixels)}.tmp")
        pixels.tofile(tmp)
        os.replace(tmp, entry)
        return pixels
