"""Documents from user files: ``.txt``, ``.jsonl`` and ``.parquet``; a file, a directory or a glob pattern.

- ``.txt``: UTF-8. ``txt_documents="file"`` (``data.txt_documents``, the default): each file is one document, its
  bytes exactly as written (blank lines, trailing spaces and ``\\r\\n`` kept); it is read in pieces
  (``data.stream.file_pieces``) — records of at most ``max_record_bytes`` for validation, each named ``file:line`` by
  its first line — so a file of any size is cut, never refused. ``"blank_lines"``: documents are separated by blank
  lines, which are dropped with each document's leading and trailing newlines (the rule before issue 39); each is
  named ``file:line`` by the line where it starts.
- ``.jsonl``: one JSON object per line, the document in the field ``text_field``; blank lines are skipped. A line
  is parsed with the bounded JSON reader (``config.bounded_json``): a line nested too deeply is refused like one
  that is not JSON.
- ``.parquet``: the string column ``text_field`` (read with pyarrow), one document per row (a null is an empty one).

:func:`iter_records` is the one reader: training (:func:`read_documents`) and data validation both use it, so
validation passes exactly what training accepts. It raises ``DataError`` for what no reader can use (missing file,
bad JSON, a missing or non-string field, an unreadable parquet file) and yields each record raw with where it came
from, so validation can count records that are not valid UTF-8 where training refuses the first one.

Text and JSON-lines files are streamed (``data.stream``), never read whole: given ``max_record_bytes``, a
blank-line document or JSON-lines record larger than that comes back as :class:`~kuangchao_core.data.stream.Oversize`
(its size, not its bytes) as soon as its end is found, and training (:func:`read_documents`) refuses it naming
``file:line``; a whole ``.txt`` file is never refused, only cut into pieces.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path

from kuangchao_core.config.bounded_json import BoundedJSONError, loads_bounded
from kuangchao_core.data.stream import PIECE_BYTES, Oversize, file_pieces, lines, open_binary, text_documents
from kuangchao_core.errors import DataError

EXTENSIONS = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
#: a JSON-lines line may be this many times its text's limit (escapes such as \u0001 take 6 bytes for one)
JSONL_LINE_FACTOR = 6
_JSONL_SLACK = 64 << 10  # plus this much for the other fields of the object
#: ``data.txt_documents``: a whole ``.txt`` file is one document, or blank lines separate documents
TXT_DOCUMENTS = ("file", "blank_lines")


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


def read_txt(path: Path, max_record_bytes: int | None = None, txt_documents: str = "file") -> Iterator[Record]:
    """The records of a text file as bytes (decoded per record), streamed: with ``txt_documents="file"`` its
    consecutive pieces of at most ``max_record_bytes`` (the file's bytes exactly, joined); with ``"blank_lines"``
    its blank-line separated documents, one over ``max_record_bytes`` coming back as Oversize."""
    if txt_documents not in TXT_DOCUMENTS:
        raise DataError(f"data.txt_documents: {txt_documents!r} is not one of {list(TXT_DOCUMENTS)}")
    with open_binary(path) as f:
        if txt_documents == "file":
            for piece, line in file_pieces(f, max_record_bytes):
                yield piece, f"{path}:{line}"
            return
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
    path: str | Path,
    fmt: str = "auto",
    text_field: str = "text",
    max_record_bytes: int | None = None,
    txt_documents: str = "file",
) -> Iterator[Record]:
    """Every raw record under ``path`` in a stable order (files sorted by name), with where it came from; a whole
    ``.txt`` file comes in pieces of at most ``max_record_bytes``; blank-line documents and JSON-lines records over
    it come back as Oversize without being read whole."""
    for f, kind in resolve_files(path, fmt):
        yield from _file_records(f, kind, text_field, max_record_bytes, txt_documents)


def _file_records(f: Path, kind: str, text_field: str, max_record_bytes: int | None, txt_documents: str):
    """The records of one file of format ``kind``."""
    if kind == "txt":
        return read_txt(f, max_record_bytes, txt_documents)
    if kind == "jsonl":
        return read_jsonl(f, text_field, max_record_bytes)
    return read_parquet(f, text_field)


def _checked_text(raw: bytes | str | Oversize, where: str, keep_crlf: bool = False) -> str:
    """A record as text; an Oversize one or one that is not valid UTF-8 raises DataError naming ``where``."""
    if isinstance(raw, Oversize):
        raise DataError(f"{where}: a record of {raw.n_bytes} bytes, more than the limit of {raw.limit}")
    if keep_crlf and isinstance(raw, bytes):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            pass  # the message below
    text, ok = decode_record(raw)
    if not ok:
        detail = "not valid UTF-8"
        if isinstance(raw, bytes):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                detail = f"bytes at offset {exc.start} of this record are not valid UTF-8 ({exc.reason})"
        raise DataError(f"{where}: {detail}; convert the file to UTF-8")
    return text


def _file_document(path: Path) -> Iterator[str]:
    """A whole text file as one document: its text in pieces of at most PIECE_BYTES bytes, exactly as written."""
    for raw, where in read_txt(path, PIECE_BYTES, "file"):
        yield _checked_text(raw, where, keep_crlf=True)


def read_documents(
    path: str | Path,
    fmt: str = "auto",
    text_field: str = "text",
    max_record_bytes: int | None = None,
    txt_documents: str = "file",
) -> Iterator[str | Iterator[str]]:
    """Every document under ``path``: a string, or — a whole ``.txt`` file (``txt_documents="file"``; an empty file
    gives none) — an iterator of its text in pieces, which joined are the document. The first record that is not
    valid UTF-8, or larger than ``max_record_bytes`` (blank-line documents and JSON-lines), raises DataError
    naming where it is."""
    for f, kind in resolve_files(path, fmt):
        if kind == "txt" and txt_documents == "file":
            if f.stat().st_size:
                yield _file_document(f)
            continue
        for raw, where in _file_records(f, kind, text_field, max_record_bytes, txt_documents):
            yield _checked_text(raw, where)
