"""Data validation before any compute is spent: a great-expectations suite over the raw dataset records.

The records (documents, before tokenisation and packing) become a pandas DataFrame with the columns
``text``, ``n_bytes``, ``n_tokens``, ``is_valid_utf8``, ``is_blank`` and ``text_hash``; a GX 1.x expectation
suite runs over it in an ephemeral context. Expectations, each named in its ``meta``:

- ``not_empty``: at least one record.
- ``no_empty_records``: no record is empty or whitespace only.
- ``no_oversize_records``: no record is larger than ``max_record_bytes`` (UTF-8 bytes).
- ``valid_utf8``: every record is valid UTF-8.
- ``enough_tokens``: the records hold at least ``ceil(planned_tokens / max_epochs)`` tokens, and at least one
  full training sequence (``seq_len + 1`` tokens). ``planned_tokens = train.steps x global batch x seq_len``.
  So a job may pass over its data at most ``max_epochs`` times (default 10); ``max_epochs=1`` demands that
  the planned steps never revisit a token.
- ``duplicate_share``: the share of records that repeat an earlier record is at most ``max_duplicate_share``
  (default 0.5); GX checks it as "proportion of unique values >= 1 - limit".

Token counts are byte-level (one token per UTF-8 byte, what the ``byte`` tokenizer produces) unless a tokenizer
is given: an object with ``encode(text)`` or a spec ``kuangchao_core.data.tokenizer.get_tokenizer`` accepts.

Where the records come from (``load_records``): the same documents ``kuangchao_core.data`` trains on. ``data.path``
is a file, directory or glob of ``.txt`` (documents separated by blank lines), ``.jsonl`` (one object per line,
text under ``data.text_field``; blank lines skipped, ``{"text": ""}`` is an empty record) and ``.parquet`` (one row
per record) files. Files are read as bytes here, so a bad byte sequence is one failing record rather than a
failed read. With no path, the synthetic corpus's training documents are used; since that corpus draws problems
with replacement by design, ``validate_dataset`` does not apply the duplicate limit to it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kuangchao_core.config.access import setting
from kuangchao_core.data.files import decode_record
from kuangchao_core.errors import DataError

DEFAULT_MAX_RECORD_BYTES = 1 << 20
DEFAULT_MAX_DUPLICATE_SHARE = 0.5
DEFAULT_MAX_EPOCHS = 10.0

EXPECTATION_NAMES = (
    "not_empty",
    "no_empty_records",
    "no_oversize_records",
    "valid_utf8",
    "enough_tokens",
    "duplicate_share",
)

_log = logging.getLogger(__name__)


@dataclass
class ExpectationResult:
    """Outcome of one named expectation."""

    name: str
    success: bool
    expectation: str
    observed: Any = None
    expected: str = ""
    detail: str = ""


@dataclass
class ValidationReport:
    """Outcome of the whole suite; ``summary`` is a readable multi-line text."""

    success: bool
    results: list[ExpectationResult]
    num_records: int
    total_tokens: int
    required_tokens: int
    source: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> list[ExpectationResult]:
        """The expectations that did not hold."""
        return [r for r in self.results if not r.success]

    def result(self, name: str) -> ExpectationResult:
        """The result of the expectation called ``name``."""
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def summary(self) -> str:
        """Readable summary: one line per expectation, failures first."""
        head = "data validation passed" if self.success else f"data validation FAILED ({len(self.failed)} failed)"
        lines = [f"{head}: {self.num_records} records, {self.total_tokens} tokens from {self.source or 'records'}"]
        for r in sorted(self.results, key=lambda r: r.success):
            mark = "ok  " if r.success else "FAIL"
            lines.append(f"  {mark} {r.name}: {r.detail}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        d = asdict(self)
        d["summary"] = self.summary
        return json.loads(json.dumps(d, default=_jsonable))

    def to_markdown(self) -> str:
        """Markdown table of the results, for a Prefect artifact."""
        status = "passed" if self.success else "**FAILED**"
        rows = [
            f"# Data validation {status}",
            "",
            f"Source: `{self.source or 'records'}` — {self.num_records} records, {self.total_tokens} tokens "
            f"(required {self.required_tokens}).",
            "",
            "| expectation | result | observed | expected |",
            "|---|---|---|---|",
        ]
        for r in self.results:
            rows.append(f"| {r.name} | {'ok' if r.success else '**FAIL**'} | {_jsonable(r.observed)} | {r.expected} |")
        return "\n".join(rows) + "\n"


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)


# ------------------------------------------------------------------------------------------------- records


def load_records(data_cfg: Any) -> tuple[list[bytes | str], str]:
    """Read the raw records named by a ``data`` config section; returns ``(records, source description)``.

    The records come from the training reader itself (:func:`kuangchao_core.data.files.iter_records`), so what
    passes here is what training reads. Raises ``DataError`` when the path is missing or a file is malformed, with
    the training reader's message.
    """
    from kuangchao_core.data.files import iter_records

    path = setting(data_cfg, "path")
    fmt = setting(data_cfg, "format", "auto")
    text_field = setting(data_cfg, "text_field", "text")
    if path is None or fmt == "synthetic":
        return _synthetic_records(data_cfg), "synthetic corpus"
    if fmt == "sft":  # each record's text as the model reads it; a record training cannot use fails here
        from kuangchao_core.data.sft import iter_sft_records, record_text

        return [record_text(r, where) for r, where in iter_sft_records(path)], str(path)
    return [raw for raw, _ in iter_records(path, fmt, text_field)], str(path)


def _synthetic_records(data_cfg: Any) -> list[bytes | str]:
    """Training documents of the synthetic corpus of ``kuangchao_core.data``."""
    from kuangchao_core.data.dataset import synthetic_settings
    from kuangchao_core.data.synthetic import make_corpus

    syn = synthetic_settings(data_cfg)
    corpus = make_corpus(str(syn["task"]), int(syn["num_train"]), int(syn["num_eval"]), int(syn["seed"]))
    return list(corpus.documents("train"))


def _token_counter(tokenizer: Any):
    if tokenizer is None or tokenizer == "byte":
        return None
    if isinstance(tokenizer, (str, os.PathLike)):
        from kuangchao_core.data.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(str(tokenizer))
    return lambda texts: [len(tokenizer.encode(t)) for t in texts]


def records_frame(records: Sequence[bytes | str], tokenizer: Any = None):
    """DataFrame of the records with the columns the suite checks."""
    import pandas as pd

    texts: list[str] = []
    valid: list[bool] = []
    n_bytes: list[int] = []
    for raw in records:
        text, ok = decode_record(raw)
        texts.append(text)
        valid.append(ok)
        n_bytes.append(len(raw) if isinstance(raw, bytes) else len(text.encode("utf-8", "replace")))
    counter = _token_counter(tokenizer)
    n_tokens = n_bytes if counter is None else counter(texts)
    return pd.DataFrame(
        {
            "text": pd.Series(texts, dtype="object"),
            "n_bytes": pd.Series(n_bytes, dtype="int64"),
            "n_tokens": pd.Series(list(n_tokens), dtype="int64"),
            "is_valid_utf8": pd.Series(valid, dtype="bool"),
            "is_blank": pd.Series([not t.strip() for t in texts], dtype="bool"),
            "text_hash": pd.Series(
                [hashlib.blake2b(t.encode("utf-8", "replace"), digest_size=16).hexdigest() for t in texts],
                dtype="object",
            ),
        }
    )


# ------------------------------------------------------------------------------------------------- suite


def required_tokens(planned_tokens: int, max_epochs: float = DEFAULT_MAX_EPOCHS, seq_len: int = 0) -> int:
    """Fewest tokens the data must hold: the planned tokens spread over at most ``max_epochs`` passes."""
    if max_epochs <= 0:
        raise DataError(f"max_epochs must be > 0, got {max_epochs}")
    return max(int(math.ceil(planned_tokens / max_epochs)), seq_len + 1 if seq_len else 1)


def _build_suite(gx, max_record_bytes: int, min_tokens: int, max_duplicate_share: float):
    E = gx.expectations
    suite = gx.ExpectationSuite(name="kuangchao_data")
    specs = [
        (E.ExpectTableRowCountToBeBetween(min_value=1), "not_empty", ">= 1 record"),
        (E.ExpectColumnValuesToBeInSet(column="is_blank", value_set=[False]), "no_empty_records", "0 empty records"),
        (
            E.ExpectColumnValuesToBeBetween(column="n_bytes", max_value=max_record_bytes),
            "no_oversize_records",
            f"every record <= {max_record_bytes} bytes",
        ),
        (E.ExpectColumnValuesToBeInSet(column="is_valid_utf8", value_set=[True]), "valid_utf8", "all valid UTF-8"),
        (E.ExpectColumnSumToBeBetween(column="n_tokens", min_value=min_tokens), "enough_tokens", f">= {min_tokens}"),
        (
            E.ExpectColumnProportionOfUniqueValuesToBeBetween(column="text_hash", min_value=1.0 - max_duplicate_share),
            "duplicate_share",
            f"duplicate share <= {max_duplicate_share:g}",
        ),
    ]
    expected = {}
    for exp, name, text in specs:
        exp.meta = {"name": name}
        suite.add_expectation(exp)
        expected[name] = text
    return suite, expected


def validate_records(
    records: Sequence[bytes | str],
    *,
    planned_tokens: int = 0,
    seq_len: int = 0,
    max_epochs: float = DEFAULT_MAX_EPOCHS,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    max_duplicate_share: float = DEFAULT_MAX_DUPLICATE_SHARE,
    tokenizer: Any = None,
    source: str = "",
) -> ValidationReport:
    """Run the expectation suite over ``records`` (bytes or str) and return the report."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    df = records_frame(records, tokenizer)
    min_tokens = required_tokens(planned_tokens, max_epochs, seq_len)

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch_def = (
        ctx.data_sources.add_pandas("kuangchao_records")
        .add_dataframe_asset("records")
        .add_batch_definition_whole_dataframe("all")
    )
    suite, expected = _build_suite(gx, max_record_bytes, min_tokens, max_duplicate_share)
    suite = ctx.suites.add(suite)
    gx_result = batch_def.get_batch(batch_parameters={"dataframe": df}).validate(suite)

    n = len(df)
    total_tokens = int(df["n_tokens"].sum()) if n else 0
    n_unique = int(df["text_hash"].nunique()) if n else 0
    facts = {
        "not_empty": (n, f"{n} records"),
        "no_empty_records": (int(df["is_blank"].sum()), f"{int(df['is_blank'].sum())} empty records"),
        "no_oversize_records": (
            int(df["n_bytes"].max()) if n else 0,
            f"{int((df['n_bytes'] > max_record_bytes).sum())} records over {max_record_bytes} bytes"
            + (f" (largest {int(df['n_bytes'].max())})" if n else ""),
        ),
        "valid_utf8": (
            int((~df["is_valid_utf8"]).sum()),
            f"{int((~df['is_valid_utf8']).sum())} records not valid UTF-8",
        ),
        "enough_tokens": (
            total_tokens,
            f"{total_tokens} tokens, need {min_tokens} (planned {planned_tokens} over at most {max_epochs:g} epochs)",
        ),
        "duplicate_share": (
            round(1 - n_unique / n, 4) if n else 0.0,
            f"duplicate share {1 - n_unique / n:.3f} (limit {max_duplicate_share:g})" if n else "no records to compare",
        ),
    }
    results = []
    for er in gx_result.results:
        name = (er.expectation_config.meta or {}).get("name", er.expectation_config.type)
        exc = er.exception_info or {}
        raised = exc.get("raised_exception") if isinstance(exc, dict) else False
        observed, detail = facts.get(name, (er.result.get("observed_value"), ""))
        if raised:
            detail += f" (check raised: {exc.get('exception_message')})"
        results.append(
            ExpectationResult(
                name=name,
                success=bool(er.success),
                expectation=er.expectation_config.type,
                observed=observed,
                expected=expected.get(name, ""),
                detail=detail,
            )
        )
    return ValidationReport(
        success=all(r.success for r in results),
        results=results,
        num_records=n,
        total_tokens=total_tokens,
        required_tokens=min_tokens,
        source=source,
        stats={"planned_tokens": planned_tokens, "max_epochs": max_epochs, "unique_records": n_unique},
    )


def planned_tokens_of(cfg: Any) -> tuple[int, int]:
    """``(train.steps x global batch x seq_len, seq_len)`` of a job config (0 where a field is missing)."""
    train = getattr(cfg, "train", None)
    par = getattr(cfg, "parallel", None)
    data = getattr(cfg, "data", None)
    steps = int(getattr(train, "steps", 0) or 0)
    micro = int(getattr(par, "micro_batch_size", 1) or 1)
    accum = int(getattr(par, "gradient_accumulation_steps", 1) or 1)
    dp = int(getattr(par, "data_parallel_size", 1) or 1)
    seq_len = int(getattr(data, "seq_len", 0) or 0)
    return steps * micro * accum * dp * seq_len, seq_len


def validate_dataset(
    cfg: Any,
    *,
    max_epochs: float = DEFAULT_MAX_EPOCHS,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    max_duplicate_share: float = DEFAULT_MAX_DUPLICATE_SHARE,
) -> ValidationReport:
    """Load the records of ``cfg.data`` and validate them against the job's planned token budget."""
    records, source = load_records(cfg.data)
    planned, seq_len = planned_tokens_of(cfg)
    tok = setting(cfg.data, "tokenizer", "byte")
    if source == "synthetic corpus":
        max_duplicate_share = 1.0
    return validate_records(
        records,
        planned_tokens=planned,
        seq_len=seq_len,
        max_epochs=max_epochs,
        max_record_bytes=max_record_bytes,
        max_duplicate_share=max_duplicate_share,
        tokenizer=None if tok in (None, "byte") else tok,
        source=source,
    )
