"""Data validation before any compute is spent: a great-expectations suite over the raw dataset records.

The records (documents, before tokenisation and packing) become a pandas DataFrame with the columns ``text``,
``n_bytes``, ``n_tokens``, ``is_valid_utf8``, ``is_blank``, ``has_control`` and ``text_hash``; a GX 1.x expectation
suite runs over it in an ephemeral context. Expectations, each named in its ``meta``:

- ``not_empty``: at least one record.
- ``no_empty_records``: no record is empty or whitespace only.
- ``no_oversize_records``: no record is larger than ``max_record_bytes`` (UTF-8 bytes). Text and JSON-lines files
  are streamed with that limit applied while reading (``data.stream``): an oversize record is never held whole,
  only its size and ``file:line`` are kept, so a 1 GiB single-line file is refused in one pass with bounded memory.
- ``valid_utf8``: every record is valid UTF-8.
- ``no_control_chars``: no record holds NUL or another control character — C0 other than tab, newline and the
  carriage return of a CRLF, DEL, or C1 (terminal escape sequences start with ESC or CSI); the first few are
  named ``file:line``. ``allow_control_chars=True`` turns the check off for data that needs them.
- ``enough_tokens``: the records hold at least ``ceil(planned_tokens / max_epochs)`` tokens, and at least one
  full training sequence (``seq_len + 1`` tokens). ``planned_tokens = train.steps x global batch x seq_len``.
  So a job may pass over its data at most ``max_epochs`` times (default 10); ``max_epochs=1`` demands that
  the planned steps never revisit a token.
- ``duplicate_share``: the share of records that repeat an earlier record is at most ``max_duplicate_share``
  (default 0.5); GX checks it as "proportion of unique values >= 1 - limit".

Token counts are byte-level (one token per UTF-8 byte, what the ``byte`` tokenizer produces) unless a tokenizer
is given: an object with ``encode(text)`` or a spec ``kuangchao_core.data.tokenizer.get_tokenizer`` accepts.

Where the records come from (``load_records``): the same documents ``kuangchao_core.data`` trains on. ``data.path``
is a file, directory or glob of ``.txt`` (documents separated by blank lines), ``.jsonl`` (one object per line, text
under ``data.text_field``; blank lines skipped, ``{"text": ""}`` is an empty record) and ``.parquet`` (one row per
record) files, read as bytes: a bad byte sequence is one failing record, not a failed read. An sft record is its
prompt and completion or turns; a ``model.vision`` job's record its image paths and turns (``image_record_text``). A
JSON-lines line that is not JSON, or nested deeper than ``config.bounded_json`` allows, fails the whole validation with
``DataError`` naming ``file:line``, as training would. With no path, the synthetic corpus's training documents are
used; it draws problems with replacement by design, so ``validate_dataset`` does not apply the duplicate limit to it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kuangchao_core.config.access import setting
from kuangchao_core.data.files import decode_record
from kuangchao_core.data.stream import Oversize
from kuangchao_core.errors import DataError

DEFAULT_MAX_RECORD_BYTES = 1 << 20
DEFAULT_MAX_DUPLICATE_SHARE = 0.5
DEFAULT_MAX_EPOCHS = 10.0

EXPECTATION_NAMES = (
    "not_empty",
    "no_empty_records",
    "no_oversize_records",
    "valid_utf8",
    "no_control_chars",
    "enough_tokens",
    "duplicate_share",
)

_log = logging.getLogger(__name__)

#: NUL and control characters refused in text: C0 but tab/newline, a CR not before LF, DEL and C1
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]|\r(?!\n)")
_LINE_OF = re.compile(r"^(.*):(\d+)$", re.DOTALL)
#: how many offending records a detail names
NAMED = 3


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


Located = tuple[bytes | str | Oversize, str]  # (raw record, where it came from)


def load_records(
    data_cfg: Any, max_record_bytes: int | None = DEFAULT_MAX_RECORD_BYTES
) -> tuple[list[bytes | str | Oversize], str]:
    """Read the raw records named by a ``data`` config section; returns ``(records, source description)``.

    The records come from the training reader itself (:func:`kuangchao_core.data.files.iter_records`), so what
    passes here is what training reads. Raises ``DataError`` when the path is missing or a file is malformed, with
    the training reader's message. A record over ``max_record_bytes`` is an :class:`Oversize` (never read whole).
    """
    located, source = load_located_records(data_cfg, max_record_bytes)
    return [raw for raw, _ in located], source


def load_located_records(
    data_cfg: Any, max_record_bytes: int | None = DEFAULT_MAX_RECORD_BYTES, images: bool = False
) -> tuple[list[Located], str]:
    """:func:`load_records` with where each record came from (``file:line``); ``images``: a vision job's records."""
    from kuangchao_core.data.files import JSONL_LINE_FACTOR, iter_records

    path = setting(data_cfg, "path")
    fmt = setting(data_cfg, "format", "auto")
    text_field = setting(data_cfg, "text_field", "text")
    if path is None or fmt == "synthetic":
        return [(doc, f"synthetic#{i}") for i, doc in enumerate(_synthetic_records(data_cfg))], "synthetic corpus"
    if fmt == "sft" or images:  # each record's text as the model reads it; a record training cannot use fails here
        from kuangchao_core.data.image_records import image_record_text
        from kuangchao_core.data.sft import iter_sft_records, record_text

        line_limit = None if max_record_bytes is None else JSONL_LINE_FACTOR * max_record_bytes + (64 << 10)
        text_of = image_record_text if images else record_text
        return [(text_of(r, where), where) for r, where in iter_sft_records(path, line_limit)], str(path)
    return list(iter_records(path, fmt, text_field, max_record_bytes)), str(path)


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


def control_char_at(text: str) -> int | None:
    """Offset of the first refused control character in ``text`` (see :data:`CONTROL_CHARS`), or None."""
    found = CONTROL_CHARS.search(text)
    return None if found is None else found.start()


def _control_where(raw: bytes | str, text: str, at: int, where: str) -> str:
    """``file:line: U+XXXX`` of a control character: a text file's line is counted from the record's first line."""
    m = _LINE_OF.match(where)
    if m and isinstance(raw, bytes):  # a .txt document: its newlines are the file's
        where = f"{m.group(1)}:{int(m.group(2)) + text.count(chr(10), 0, at)}"
    return f"{where or 'record'}: U+{ord(text[at]):04X} at character {at}"


def records_frame(records: Sequence[bytes | str | Oversize], tokenizer: Any = None, allow_control_chars: bool = False):
    """DataFrame of the records with the columns the suite checks (an Oversize record: its size, no text)."""
    import pandas as pd

    texts: list[str] = []
    valid: list[bool] = []
    n_bytes: list[int] = []
    control: list[bool] = []
    for i, raw in enumerate(records):
        if isinstance(raw, Oversize):
            texts.append(f"\x00oversize record {i}")  # never blank, never a duplicate; not tokenised
            valid.append(True)
            n_bytes.append(raw.n_bytes)
            control.append(False)
            continue
        text, ok = decode_record(raw)
        texts.append(text)
        valid.append(ok)
        n_bytes.append(len(raw) if isinstance(raw, bytes) else len(text.encode("utf-8", "replace")))
        control.append(not allow_control_chars and control_char_at(text) is not None)
    kept = [i for i, raw in enumerate(records) if not isinstance(raw, Oversize)]  # an oversize record adds none
    counter = _token_counter(tokenizer)
    counts = [n_bytes[i] for i in kept] if counter is None else counter([texts[i] for i in kept])
    n_tokens = [0] * len(texts)
    for i, count in zip(kept, counts, strict=True):
        n_tokens[i] = count
    return pd.DataFrame(
        {
            "text": pd.Series(texts, dtype="object"),
            "n_bytes": pd.Series(n_bytes, dtype="int64"),
            "n_tokens": pd.Series(n_tokens, dtype="int64"),
            "is_valid_utf8": pd.Series(valid, dtype="bool"),
            "is_blank": pd.Series([not t.strip() for t in texts], dtype="bool"),
            "has_control": pd.Series(control, dtype="bool"),
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
        (
            E.ExpectColumnValuesToBeInSet(column="has_control", value_set=[False]),
            "no_control_chars",
            "no NUL or control characters",
        ),
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
    wheres: Sequence[str] | None = None,
    allow_control_chars: bool = False,
) -> ValidationReport:
    """Run the expectation suite over ``records`` (bytes, str or Oversize) and return the report; ``wheres`` (one
    per record, ``file:line``) name the offending records in the details."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    df = records_frame(records, tokenizer, allow_control_chars)
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
            + (f" (largest {int(df['n_bytes'].max())})" if n else "")
            + _named([i for i, b in enumerate(df["n_bytes"]) if b > max_record_bytes], wheres),
        ),
        "no_control_chars": _control_fact(records, df, wheres, allow_control_chars),
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


def _named(rows: list[int], wheres: Sequence[str] | None) -> str:
    """``: file:line, …`` for the first few offending rows (empty without ``wheres``)."""
    if not rows or not wheres:
        return ""
    more = f", … {len(rows) - NAMED} more" if len(rows) > NAMED else ""
    return ": " + ", ".join(wheres[i] for i in rows[:NAMED]) + more


def _control_fact(records, df, wheres: Sequence[str] | None, allowed: bool) -> tuple[int, str]:
    """(records with control characters, the detail naming the first few by ``file:line: U+XXXX``)."""
    if allowed:
        return 0, "control characters allowed (allow_control_chars)"
    rows = [i for i, bad in enumerate(df["has_control"]) if bad]
    named = []
    for i in rows[:NAMED]:
        text = df["text"].iat[i]
        named.append(_control_where(records[i], text, control_char_at(text) or 0, wheres[i] if wheres else ""))
    more = f", … {len(rows) - NAMED} more" if len(rows) > NAMED else ""
    detail = f"{len(rows)} records with NUL or control characters" + (": " + "; ".join(named) + more if rows else "")
    return len(rows), detail


def planned_tokens_of(cfg: Any) -> tuple[int, int]:
    """``(train.steps x global batch x seq_len, seq_len)`` of a job config (0 where a field is missing)."""
    train, par, data = (getattr(cfg, section, None) for section in ("train", "parallel", "data"))
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
    allow_control_chars: bool = False,
) -> ValidationReport:
    """Load the records of ``cfg.data`` (streamed, ``max_record_bytes`` applied while reading) and validate them
    against the job's planned token budget."""
    located, source = load_located_records(cfg.data, max_record_bytes, images=setting(cfg, "model.vision") is not None)
    records = [raw for raw, _ in located]
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
        wheres=[where for _, where in located],
        allow_control_chars=allow_control_chars,
    )
