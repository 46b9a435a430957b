"""safetensors headers read defensively, and compared with the tensor table a manifest records for each shard.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON (an object: tensor name ->
``{"dtype", "shape", "data_offsets"}``, plus an optional ``__metadata__`` of strings), then the tensor bytes;
``data_offsets`` are ``[begin, end)`` within those bytes. :func:`read_header` parses that without trusting any of
it: the length is capped (:data:`MAX_HEADER_BYTES`) and must fit in the file, the JSON must be an object, every
entry must name a dtype, a shape of non-negative integers and offsets inside the file whose span matches the
shape and dtype. Anything else raises :class:`HeaderError` with the reason.

:func:`tensor_table` is what the writer records in the manifest (``tensor_table``, format version 2): per tensor
its dtype and shape as safetensors names them (``{"dtype": "F32", "shape": [64, 32]}``).
:func:`table_problems` compares a shard's header with that record, one problem string per difference.
"""

from __future__ import annotations

import struct
from typing import Any

from kuangchao_core.ckpt.storage import Storage
from kuangchao_core.config.bounded_json import BoundedJSONError, loads_bounded

#: the largest header length accepted; real shards have headers of kilobytes
MAX_HEADER_BYTES = 100 << 20

#: bytes per element of the safetensors dtypes of whole bytes (sub-byte types such as F4 are left unchecked)
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}

_METADATA = "__metadata__"
_KC_META = "kuangchao."  # prefix of the metadata entries kuangchao writes as JSON (ckpt.layout META_*)

#: differences reported per shard before the rest are summed up in one line
MAX_PROBLEMS_PER_FILE = 20


class HeaderError(ValueError):
    """A safetensors header that cannot be trusted; the message says why."""


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(prefix: bytes, file_size: int) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file from its first bytes ``prefix`` (at least 8 + header length).

    ``file_size`` is the whole file's size, used for the bounds. Returns name -> ``{"dtype", "shape",
    "data_offsets"}`` (``__metadata__`` left out); raises :class:`HeaderError` on anything malformed."""
    if file_size < 8 or len(prefix) < 8:
        raise HeaderError(f"{file_size} bytes is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {n} exceeds the limit {MAX_HEADER_BYTES}")
    if 8 + n > file_size:
        raise HeaderError(f"header length {n} runs past the end of the {file_size}-byte file")
    if len(prefix) < 8 + n:
        raise HeaderError(f"header length {n} but only {len(prefix) - 8} header bytes could be read")
    try:
        header = loads_bounded(prefix[8 : 8 + n], max_bytes=MAX_HEADER_BYTES)
    except BoundedJSONError as exc:
        raise HeaderError(f"header refused: {exc.reason[:160]}") from None
    if not isinstance(header, dict):
        raise HeaderError(f"header is a JSON {type(header).__name__}, not an object")
    data_size = file_size - 8 - n
    entries: dict[str, dict[str, Any]] = {}
    for name, entry in header.items():
        if name == _METADATA:
            _check_metadata(entry)
            continue
        entries[name] = _check_entry(name, entry, data_size)
    return entries


def _check_metadata(meta: Any) -> None:
    """``__metadata__``: an object of strings; kuangchao's own entries (``kuangchao.*``) must be JSON that the
    bounded reader accepts, since the readers parse them (``ckpt.reader``)."""
    if not isinstance(meta, dict):
        raise HeaderError("__metadata__ is not an object")
    for key, value in meta.items():
        if not isinstance(value, str):
            raise HeaderError(f"__metadata__ entry {key!r} is not a string")
        if key.startswith(_KC_META):
            try:
                loads_bounded(value, max_bytes=MAX_HEADER_BYTES)
            except BoundedJSONError as exc:
                raise HeaderError(f"__metadata__ entry {key!r} refused: {exc.reason[:160]}") from None


def _check_entry(name: str, entry: Any, data_size: int) -> dict[str, Any]:
    """One tensor entry, checked: dtype string, shape of non-negative ints, offsets in ``[0, data_size]``."""
    if not isinstance(entry, dict):
        raise HeaderError(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not dtype:
        raise HeaderError(f"tensor {name!r}: dtype {dtype!r} is not a dtype name")
    if not isinstance(shape, list) or not all(_int(d) and d >= 0 for d in shape):
        raise HeaderError(f"tensor {name!r}: shape {str(shape)[:80]} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_int(o) for o in offsets)):
        raise HeaderError(f"tensor {name!r}: data_offsets {str(offsets)[:80]} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise HeaderError(
            f"tensor {name!r}: data_offsets [{begin}, {end}] lie outside the {data_size} data bytes of the file"
        )
    item = DTYPE_BYTES.get(dtype)
    if item is not None:
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * item:
            raise HeaderError(
                f"tensor {name!r}: data_offsets span {end - begin} bytes, but {dtype} {shape} needs {numel * item}"
            )
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def read_header(storage: Storage, key: str) -> dict[str, dict[str, Any]]:
    """:func:`parse_header` of the file at ``key`` in ``storage``, reading only the header bytes.

    Raises :class:`HeaderError` for a malformed header, OSError when the file cannot be read."""
    size = storage.size(key)
    with storage.open_read(key) as f:
        head = f.read(8)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            if n <= MAX_HEADER_BYTES and 8 + n <= size:
                head += f.read(n)
    return parse_header(head, size)


def tensor_table(entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The manifest's record of one shard: tensor name -> ``{"dtype", "shape"}`` (from :func:`parse_header`)."""
    return {name: {"dtype": e["dtype"], "shape": list(e["shape"])} for name, e in sorted(entries.items())}


def table_problems(rel: str, entries: dict[str, dict[str, Any]], recorded: Any) -> list[str]:
    """Every difference between shard ``rel``'s header ``entries`` and its manifest record ``recorded``.

    Each problem names the file and the tensor: tensors missing from the file or not in the manifest, another
    dtype, another shape. A record that is not a table is one problem."""
    if not isinstance(recorded, dict):
        return [f"{rel}: the manifest's tensor_table entry is not a table"]
    problems: list[str] = []
    for name in sorted(set(recorded) - set(entries), key=str):
        problems.append(f"{rel}: tensor {name!r} is in the manifest's tensor table but not in the file")
    for name in sorted(set(entries) - set(recorded)):
        problems.append(f"{rel}: tensor {name!r} is in the file but not in the manifest's tensor table")
    for name in sorted(set(entries) & set(recorded)):
        want, got = recorded[name], entries[name]
        if not isinstance(want, dict):
            problems.append(f"{rel}: tensor {name!r}: the manifest's record is not an object")
            continue
        if got["dtype"] != want.get("dtype"):
            problems.append(f"{rel}: tensor {name!r} has dtype {got['dtype']}, the manifest says {want.get('dtype')}")
        if got["shape"] != want.get("shape"):
            problems.append(f"{rel}: tensor {name!r} has shape {got['shape']}, the manifest says {want.get('shape')}")
    if len(problems) > MAX_PROBLEMS_PER_FILE:
        extra = len(problems) - MAX_PROBLEMS_PER_FILE
        problems = [*problems[:MAX_PROBLEMS_PER_FILE], f"{rel}: … and {extra} more tensor table differences"]
    return problems
