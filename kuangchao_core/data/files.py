"""Documents from user files: ``.txt``, ``.jsonl`` and ``.parquet``; a file, a directory or a glob pattern.

- ``.txt``: UTF-8; documents are separated by blank lines (a file without blank lines is one document); each is
  named ``file:line`` by the line where it starts.
- ``.jsonl``: one JSON object per line, the document in the field ``text_field``; blank lines are skipped. A line
  is parsed with the bounded JSON reader (``config.bounded_json``): a line nested too deeply is refused like one
  that is not JSON.
- ``.parquet``: the string column ``text_field`` (read with pyarrow), one document per row (a null is an empty one).

:func:`iter_records` is the one reader: training (:func:`read_documents`) and data validation both use it, so
validation passes exactly what training accepts. It raises ``DataError`` for what no reader can use (missing file,
bad JSON, a missing or non-string field, an unreadable parquet file) and yields each record raw with where it came
from, so validation can count records that are not valid UTF-8 where training refuses the first one.

Text and JSON-lines files are streamed (``data.stream``), never read whole: given ``max_record_bytes``, a record
larger than that comes back as :class:`~kuangchao_core.data.stream.Oversize` (its size, not its bytes) as soon as
its end is found; training (:func:`read_documents`) refuses it naming ``file:line``.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path

from kuangchao_core.config.bounded_json import BoundedJSONError, loads_bounded
from kuangchao_core.data.stream import Oversize, lines, open_binary, text_documents
from kuangchao_core.errors import DataError

EXTENSIONS = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
#: a JSON-lines line may be this many times its text's limit (escapes such as \u0001 take 6 bytes for one)
JSONL_LINE_FACTOR = 6
_JSONL_SLACK = 64 << 10  # plus this much for the other fields of the object


def resolve_files(path: str | Path, fmt: str = "auto") -> list[tuple[Path, str]]:
    """The files ``path`` names, sorted, each with its format; raises DataError when none are found."""
    text = str(path)
    if any(ch in text for ch in "*?["):
        candidates = [Path(p) for p in sorted(glob.glob(text, recursive=True)) if Path(p).is_file()]
        where = f"glob {text!r}"
    else:
        p = Path(text)
        if not p.exists():
            raise DataError(f"data.path: {p} does not exist; give an existing file, directory or glob pattern")
        if p.is_dir():
            candidates = sorted(q for q in p.rglob("*") if q.is_file() and not q.name.startswith("."))
            if fmt == "auto":
                candidates = [q for q in candidates if q.suffix.lower() in EXTENSIONS]
            where = f"directory {p}"
        else:
            candidates = [p]
            where = str(p)
    out = []
    for f in candidates:
        if fmt == "auto":
            kind = EXTENSIONS.get(f.suffix.lower())
            if kind is None:
                raise DataError(
                    f"data.format: cannot tell the format of {f} from its extension; "
                    f"use one of {sorted(EXTENSIONS)} or set data.format"
                )
        elif fmt in ("txt", "jsonl", "parquet"):
            kind = fmt
        else:
            raise DataError(f"data.format: unsupported format {fmt!r} for files; use auto, txt, jsonl or parquet")
        out.append((f, kind))
    if not out:
        raise DataError(f"data.path: no data files found in {where} (extensions {sorted(EXTENSIONS)})")
    return out


Record = tuple[bytes | str | Oversize, str]  # (raw record, "file:line" or "file#row<N>")


def decode_record(raw: bytes | str) -> tuple[str, bool]:
    """A record as text, and whether it was valid UTF-8 (invalid bytes become U+FFFD in the text returned)."""
    if isinstance(raw, str):
        try:
            raw.encode("utf-8")
            return raw, True
        except UnicodeEncodeError:  # lone surrogates, e.g. from a JSON "\udcff" escape
            return raw.encode("utf-8", "surrogatepass").decode("utf-8", "replace"), False
    try:
        return raw.decode("utf-8").replace("\r\n", "\n"), True
    except UnicodeDecodeError:
        return raw.decode("utf-8", "replace").replace("\r\n", "\n"), False


def read_txt(path: Path, max_record_bytes: int | None = None) -> Iterator[Record]:
    """Blank-line separated documents of a text file, as bytes (decoded per record), streamed; a document over
    ``max_record_bytes`` comes back as Oversize."""
    with open_binary(path) as f:
        for block, line in text_documents(f, max_record_bytes):
            yield block, f"{path}:{line}"


def read_jsonl(path: Path, text_field: str, max_record_bytes: int | None = None) -> Iterator[Record]:
    """The ``text_field`` of every JSON object in a JSON-lines file (a line that is not UTF-8 comes back as bytes),
    streamed; a line over ``JSONL_LINE_FACTOR`` x ``max_record_bytes`` (+ 64 KiB) comes back as Oversize."""
    line_limit = None if max_record_bytes is None else JSONL_LINE_FACTOR * max_record_bytes + _JSONL_SLACK
    with open_binary(path) as f:
        for lineno, line in lines(f, line_limit):
            if isinstance(line, Oversize):
                yield line, f"{path}:{lineno}"
                continue
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                yield line, f"{path}:{lineno}"
                continue
            try:
                obj = loads_bounded(text, max_bytes=len(line))
            except BoundedJSONError as exc:
                raise DataError(f"{path}:{lineno}: refused, {exc.reason}; each line must be one JSON object") from None
            if not isinstance(obj, dict) or text_field not in obj:
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise DataError(
                    f"{path}:{lineno}: no field {text_field!r} (found {keys}); set data.text_field to the text field"
                )
            value = obj[text_field]
            if not isinstance(value, str):
                raise DataError(f"{path}:{lineno}: field {text_field!r} is {type(value).__name__}, expected a string")
            yield value, f"{path}:{lineno}"


def read_parquet(path: Path, text_field: str) -> Iterator[Record]:
    """The string column ``text_field`` of a parquet file (a null row is an empty document)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise DataError(f"{path}: not a readable parquet file ({exc})") from exc
    if text_field not in schema.names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {schema.names}); set data.text_field")
    field_type = schema.field(text_field).type
    if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)):
        raise DataError(f"{path}: column {text_field!r} has type {field_type}, expected strings")
    table = pq.read_table(path, columns=[text_field])
    for row, value in enumerate(table.column(text_field).to_pylist()):
        yield ("" if value is None else value), f"{path}#row{row}"


def iter_records(
    path: str | Path, fmt: str = "auto", text_field: str = "text", max_record_bytes: int | None = None
) -> Iterator[Record]:
    """Every raw record under ``path`` in a stable order (files sorted by name), with where it came from; text and
    JSON-lines records over ``max_record_bytes`` come back as Oversize without being read whole."""
    for f, kind in resolve_files(path, fmt):
        if kind == "txt":
            yield from read_txt(f, max_record_bytes)
        elif kind == "jsonl":
            yield from read_jsonl(f, text_field, max_record_bytes)
        else:
            yield from read_parquet(f, text_field)


def read_documents(
    path: str | Path, fmt: str = "auto", text_field: str = "text", max_record_bytes: int | None = None
) -> Iterator[str]:
    """Every document under ``path`` as text; the first record that is not valid UTF-8, or larger than
    ``max_record_bytes``, raises DataError naming where it is."""
    for raw, where in iter_records(path, fmt, text_field, max_record_bytes):
        if isinstance(raw, Oversize):
            raise DataError(f"{where}: a record of {raw.n_bytes} bytes, more than the limit of {raw.limit}")
        text, ok = decode_record(raw)
        if not ok:
            detail = "not valid UTF-8"
            if isinstance(raw, bytes):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    detail = f"bytes at offset {exc.start} of this record are not valid UTF-8 ({exc.reason})"
            raise DataError(f"{where}: {detail}; convert the file to UTF-8")
        yield text
