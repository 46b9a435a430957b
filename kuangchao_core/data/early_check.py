"""The data checks that need no server, made by ``kc train`` before Prefect or MLflow start (issue 45 §2).

A wrong ``data.path`` was reported after 35–90 s, once Prefect, the doctor and MLflow had started, and left a FAILED
MLflow run behind. :func:`check_data_early` looks at ``data.path`` and ``data.eval_path`` as the training reader does
(:func:`~kuangchao_core.data.files.resolve_files`: the path, glob or directory exists and holds files of a known
format) and reads the first :data:`SAMPLE_RECORDS` records of the first text or JSON-lines file (a malformed line, a
missing ``data.text_field``), in well under a second; the flow's ``validate_data`` still reads everything.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

from kuangchao_core.data.files import JSONL_LINE_FACTOR, iter_records, resolve_files
from kuangchao_core.errors import DataError

#: how many records of the first file are read
SAMPLE_RECORDS = 64
#: the largest record the sample reads whole (the validation's default limit)
SAMPLE_RECORD_BYTES = 64 << 20


def check_data_early(data: Any) -> None:
    """Raise :class:`~kuangchao_core.errors.DataError` (its message names the field) when ``data.path`` or
    ``data.eval_path`` names no readable data; nothing for the synthetic corpus."""
    fields = [("data.path", data.path), ("data.eval_path", data.eval_path)]
    for field, path in fields:
        if path:
            try:
                _check(path, data.format, data.text_field)
            except DataError as exc:
                message = str(exc)
                if field != "data.path" and message.startswith("data.path:"):
                    message = field + message.removeprefix("data.path")
                raise DataError(message if message.startswith("data.") else f"{field}: {message}") from None


def _check(path: str, fmt: str, text_field: str) -> None:
    sft = fmt == "sft"
    files = resolve_files(path, "auto" if sft else fmt)
    first, kind = files[0]
    if sft and kind == "jsonl":
        from kuangchao_core.data.sft import iter_sft_records

        line_limit = JSONL_LINE_FACTOR * SAMPLE_RECORD_BYTES + (64 << 10)
        list(islice(iter_sft_records(first, line_limit), SAMPLE_RECORDS))
    elif not sft and kind in ("txt", "jsonl"):  # a parquet file is read whole: the flow's validation reads it
        list(islice(iter_records(first, kind, text_field, SAMPLE_RECORD_BYTES), SAMPLE_RECORDS))
