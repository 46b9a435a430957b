"""Data validation before any compute is spent: a great-expectations suite over the raw dataset records.

The records (documents, before tokenisation and packing) stream past once (issue 38): each becomes a row of compact
columns (``kuangchao_core.data.record_facts``: ``n_bytes``, ``n_tokens``, ``is_valid_utf8``, ``is_blank``,
``has_control`` and a 64-bit ``text_hash``, about 27 bytes a record), so no record's text is held and memory does
not grow with the records' sizes; a GX 1.x expectation suite runs over that DataFrame in an ephemeral context. Expectations, each named in its ``meta``:

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
is a file, directory or glob of ``.txt`` (``data.txt_documents``), ``.jsonl`` (one object per line, text
under ``data.text_field``; blank lines skipped, ``{"text": ""}`` is an empty record) and ``.parquet`` (one row per
record) files, read as bytes: a bad byte sequence is one failing record, not a failed read. An sft record is its
prompt and completion or turns; a ``model.vision`` job's record its image paths and turns (``image_record_text``). A
JSON-lines line that is not JSON, or nested deeper than ``config.bounded_json`` allows, fails the whole validation with
``DataError`` naming ``file:line``, as training would. With no path, the synthetic corpus's training documents are
used; it draws problems with replacement by design, so ``validate_dataset`` does not apply the duplicate limit to it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kuangchao_core.config.access import setting
from kuangchao_core.data import expectation_suite, validation_cache
from kuangchao_core.data.record_facts import CONTROL_CHARS, NAMED, RecordFacts, control_char_at  # noqa: F401
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
    located, source = iter_located_records(data_cfg, max_record_bytes, images)
    return list(located), source


def iter_located_records(
    data_cfg: Any, max_record_bytes: int | None = DEFAULT_MAX_RECORD_BYTES, images: bool = False
) -> tuple[Iterator[Located], str]:
    """:func:`load_located_records` as a stream: the records are read as the iterator is consumed."""
    from kuangchao_core.data.files import JSONL_LINE_FACTOR, iter_records

    path = setting(data_cfg, "path")
    fmt = setting(data_cfg, "format", "auto")
    text_field = setting(data_cfg, "text_field", "text")
    if path is None or fmt == "synthetic":
        docs = _synthetic_records(data_cfg)
        return ((doc, f"synthetic#{i}") for i, doc in enumerate(docs)), "synthetic corpus"
    if fmt == "sft" or images:  # each record's text as the model reads it; a record training cannot use fails here
        from kuangchao_core.data.image_records import image_record_text
        from kuangchao_core.data.sft import iter_sft_records, record_text

        line_limit = None if max_record_bytes is None else JSONL_LINE_FACTOR * max_record_bytes + (64 << 10)
        text_of = image_record_text if images else record_text
        return ((text_of(r, where), where) for r, where in iter_sft_records(path, line_limit)), str(path)
    return iter_records(path, fmt, text_field, max_record_bytes, setting(data_cfg, "txt_documents", "file")), str(path)


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
    return tokenizer


def records_frame(records: Sequence[bytes | str | Oversize], tokenizer: Any = None, allow_control_chars: bool = False):
    """DataFrame of the records with the columns the suite checks (:class:`RecordFacts`; an Oversize record: its
    size, no text)."""
    facts = RecordFacts(_token_counter(tokenizer), allow_control_chars)
    for raw in records:
        facts.add(raw)
    return facts.frame()


# ------------------------------------------------------------------------------------------------- suite


def required_tokens(planned_tokens: int, max_epochs: float = DEFAULT_MAX_EPOCHS, seq_len: int = 0) -> int:
    """Fewest tokens the data must hold: the planned tokens spread over at most ``max_epochs`` passes."""
    if max_epochs <= 0:
        raise DataError(f"max_epochs must be > 0, got {max_epochs}")
    return max(int(math.ceil(planned_tokens / max_epochs)), seq_len + 1 if seq_len else 1)


def validate_records(
    records: Iterable[bytes | str | Oversize],
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
    """Run the expectation suite over ``records`` (bytes, str or Oversize; read once, as a stream) and return the
    report; ``wheres`` (one per record, ``file:line``) name the offending records in the details."""
    where_of = iter(wheres) if wheres is not None else None
    facts = RecordFacts(_token_counter(tokenizer), allow_control_chars, max_record_bytes)
    for raw in records:
        facts.add(raw, next(where_of) if where_of is not None else "")
    return _validate_facts(facts, planned_tokens, seq_len, max_epochs, max_record_bytes, max_duplicate_share, source)


def _validate_facts(
    facts: RecordFacts,
    planned_tokens: int,
    seq_len: int,
    max_epochs: float,
    max_record_bytes: int,
    max_duplicate_share: float,
    source: str,
) -> ValidationReport:
    df = facts.frame()
    min_tokens = required_tokens(planned_tokens, max_epochs, seq_len)
    params = {
        "max_record_bytes": max_record_bytes,
        "min_tokens": min_tokens,
        "max_duplicate_share": max_duplicate_share,
    }
    key = validation_cache.outcome_key(df, params, expectation_suite.suite_source())
    outcomes, cached = validation_cache.remembered(key, lambda: expectation_suite.suite_outcomes(df, **params))
    if cached:
        _log.info("data validation: the same records and suite as before; the suite's outcomes are the cached ones")
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
            + _named(facts.oversize, facts.n_oversize),
        ),
        "no_control_chars": _control_fact(facts),
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
    for o in outcomes:
        observed, detail = facts.get(o["name"], (o["observed"], ""))
        detail += f" (check raised: {o['raised']})" if o["raised"] else ""
        results.append(ExpectationResult(o["name"], o["success"], o["expectation"], observed, o["expected"], detail))
    return ValidationReport(
        success=all(r.success for r in results),
        results=results,
        num_records=n,
        total_tokens=total_tokens,
        required_tokens=min_tokens,
        source=source,
        stats={"planned_tokens": planned_tokens, "max_epochs": max_epochs, "unique_records": n_unique},
    )


def _named(named: list[str], count: int) -> str:
    """``: file:line, …`` for the first few offending records (empty when none was named)."""
    if not named:
        return ""
    more = f", … {count - NAMED} more" if count > NAMED else ""
    return ": " + ", ".join(named) + more


def _control_fact(facts: RecordFacts) -> tuple[int, str]:
    """(records with control characters, the detail naming the first few by ``file:line: U+XXXX``)."""
    if facts.allow_control_chars:
        return 0, "control characters allowed (allow_control_chars)"
    count = facts.n_control
    more = f", … {count - NAMED} more" if count > NAMED else ""
    detail = f"{count} records with NUL or control characters" + (
        ": " + "; ".join(facts.controls) + more if count else ""
    )
    return count, detail


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
    located, source = iter_located_records(cfg.data, max_record_bytes, images=setting(cfg, "model.vision") is not None)
    planned, seq_len = planned_tokens_of(cfg)
    tok = setting(cfg.data, "tokenizer", "byte")
    if source == "synthetic corpus":
        max_duplicate_share = 1.0
    facts = RecordFacts(_token_counter(None if tok in (None, "byte") else tok), allow_control_chars, max_record_bytes)
    for raw, where in located:  # streamed: one record's text at a time
        facts.add(raw, where)
    return _validate_facts(facts, planned, seq_len, max_epochs, max_record_bytes, max_duplicate_share, source)
