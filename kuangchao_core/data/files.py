"""Documents from user files: ``.txt``, ``.jsonl`` and ``.parquet``; a file, a directory or a glob pattern.

- ``.txt``: UTF-8; documents are separated by blank lines (a file without blank lines is one document).
- ``.jsonl``: one JSON object per line, the document in the field ``text_field``; blank lines are skipped.
- ``.parquet``: the string column ``text_field`` (read with pyarrow), one document per row.
"""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Iterator
from pathlib import Path

from kuangchao_core.errors import DataError

EXTENSIONS = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
_BLANK = re.compile(r"\n(?:[ \t]*\n)+")


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


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: bytes at offset {exc.start} are not valid UTF-8 ({exc.reason}); convert the file to UTF-8"
        ) from exc


def read_txt(path: Path) -> Iterator[str]:
    """Blank-line separated documents of a UTF-8 text file."""
    for block in _BLANK.split(_read_text(path).replace("\r\n", "\n")):
        block = block.strip("\n")
        if block.strip():
            yield block


def read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    """The ``text_field`` of every JSON object in a JSON-lines file."""
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc}); each line must be one JSON object") from exc
        if not isinstance(obj, dict) or text_field not in obj:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(
                f"{path}:{lineno}: no field {text_field!r} (found {keys}); set data.text_field to the text field"
            )
        value = obj[text_field]
        if not isinstance(value, str):
            raise DataError(f"{path}:{lineno}: field {text_field!r} is {type(value).__name__}, expected a string")
        yield value


def read_parquet(path: Path, text_field: str) -> Iterator[str]:
    """The string column ``text_field`` of a parquet file."""
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
    for value in table.column(text_field).to_pylist():
        if value is not None:
            yield value


def read_documents(path: str | Path, fmt: str = "auto", text_field: str = "text") -> Iterator[str]:
    """Every document under ``path`` in a stable order (files sorted by name)."""
    for f, kind in resolve_files(path, fmt):
        if kind == "txt":
            yield from read_txt(f)
        elif kind == "jsonl":
            yield from read_jsonl(f, text_field)
        else:
            yield from read_parquet(f, text_field)
