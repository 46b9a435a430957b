"""One bounded JSON reader for every file or record an outsider could have placed.

Checkpoint manifests, safetensors headers and their metadata entries, lineage and state files, trust and token
files, heartbeat files and JSON-lines data records are all parsed with :func:`loads_bounded` or
:func:`read_json_file`. Both refuse, with :class:`BoundedJSONError`, input that is

- larger than ``max_bytes`` (a file is never read past that limit), or
- nested deeper than ``max_depth`` arrays/objects — checked by a scan of the bytes that does not recurse
  (strings and their escapes are skipped) before :func:`json.loads` runs, so Python's ``RecursionError`` at about
  1000 levels can never escape; or
- not UTF-8, or not valid JSON.

``BoundedJSONError`` is a ``ValueError`` as well as a :class:`~kuangchao_core.errors.KuangchaoError`, so callers
that already turn a ``ValueError`` into "this step is not intact" or "this record is refused" keep doing so; its
``reason`` says why in a few words. The module is in ``config`` so that every layer that may import ``config``
(data, ckpt, obs, sched, perm, engine) can use it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from kuangchao_core.errors import KuangchaoError

#: deepest nesting of arrays/objects accepted (the formats we read nest fewer than ten levels)
DEFAULT_MAX_DEPTH = 64
#: largest JSON file read by default (state, lineage, trust, token and heartbeat files are kilobytes)
DEFAULT_MAX_BYTES = 64 << 20
#: largest checkpoint manifest (its tensor table grows with tensors x ranks)
MANIFEST_MAX_BYTES = 256 << 20

_QUOTE = ord('"')
_CHUNK = 1 << 22  # bytes scanned at a time
_SMALL = 1 << 16
_STEP_TABLE = [0] * 256
_STEP_TABLE[ord("[")] = _STEP_TABLE[ord("{")] = 1
_STEP_TABLE[ord("]")] = _STEP_TABLE[ord("}")] = -1


class BoundedJSONError(KuangchaoError, ValueError):
    """JSON input refused: too large, too deep, not UTF-8 or not valid JSON. ``reason`` says which, ``where``
    names the file or record (may be empty)."""

    def __init__(self, reason: str, where: str = ""):
        self.reason = reason
        self.where = where
        super().__init__(f"{where}: {reason}" if where else reason)


def max_nesting(data: bytes | str) -> int:
    """How deep ``data`` nests arrays/objects (outside strings), computed without recursion in linear time.

    Escapes (backslash pairs) are removed first, as a JSON string reads them left to right; then a byte is inside a
    string when an odd number of quotes precede it. The depth is the highest running count of open brackets
    outside strings, computed with numpy in chunks (a hostile file of any size costs one pass)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if b"[" not in raw and b"{" not in raw:
        return 0
    raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    if len(raw) <= _SMALL and "numpy" not in sys.modules:  # a manifest read by kc train's early refusal: the
        # same count in Python, instead of importing numpy for it (0.3-0.5 s)
        depth = deepest = 0
        inside = False
        for byte in raw:
            if byte == _QUOTE:
                inside = not inside
            elif not inside and _STEP_TABLE[byte]:
                depth += _STEP_TABLE[byte]
                deepest = max(deepest, depth)
        return deepest
    import numpy as np

    table = np.array(_STEP_TABLE, dtype=np.int8)
    depth = deepest = quotes = 0
    for start in range(0, len(raw), _CHUNK):
        a = np.frombuffer(raw, dtype=np.uint8, count=min(_CHUNK, len(raw) - start), offset=start)
        outside = (np.cumsum(a == _QUOTE, dtype=np.int64) + quotes) % 2 == 0
        step = table[a] * outside
        running = np.cumsum(step, dtype=np.int64) + depth
        if len(running):
            deepest = max(deepest, int(running.max()))
            depth = int(running[-1])
        quotes += int(np.count_nonzero(a == _QUOTE))
    return deepest


def loads_bounded(
    data: bytes | bytearray | str,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
    where: str = "",
    **json_kwargs: Any,
) -> Any:
    """``json.loads(data)`` within the limits; raises :class:`BoundedJSONError` for anything it refuses.

    ``json_kwargs`` (``object_pairs_hook``, ``parse_constant`` …) go to :func:`json.loads`; an exception those hooks
    raise is passed on unchanged."""
    size = len(data) if not isinstance(data, str) else len(data.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise BoundedJSONError(f"{size} bytes of JSON, more than the limit of {max_bytes}", where)
    depth = max_nesting(data)
    if depth > max_depth:
        raise BoundedJSONError(f"JSON nested {depth} levels deep, more than the limit of {max_depth}", where)
    if not isinstance(data, str):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BoundedJSONError(f"not UTF-8 (byte {exc.start}: {exc.reason})", where) from None
    try:
        return json.loads(data, **json_kwargs)
    except json.JSONDecodeError as exc:
        raise BoundedJSONError(f"not valid JSON ({exc})", where) from None
    except RecursionError:  # not reached after the scan; kept so that it can never escape
        raise BoundedJSONError("JSON nested too deeply to parse", where) from None


def read_json_file(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
    **json_kwargs: Any,
) -> Any:
    """The JSON value in the file at ``path``, read no further than ``max_bytes`` + 1 bytes.

    Raises :class:`BoundedJSONError` for what :func:`loads_bounded` refuses (naming the file), ``OSError`` when the
    file cannot be read (a missing file stays ``FileNotFoundError``)."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise BoundedJSONError(f"larger than the limit of {max_bytes} bytes", str(path))
    return loads_bounded(data, max_bytes=max_bytes, max_depth=max_depth, where=str(path), **json_kwargs)


def read_json_object(path: str | os.PathLike[str], **kwargs: Any) -> dict[str, Any]:
    """:func:`read_json_file` of a file that must hold a JSON object; anything else raises BoundedJSONError."""
    value = read_json_file(path, **kwargs)
    if not isinstance(value, dict):
        raise BoundedJSONError(f"a JSON {type(value).__name__}, not an object", str(path))
    return value
