"""Instruction data (``data.format: sft``): prompt/completion pairs or chat ``messages``, loss on the answers only.

A record (a JSON-lines object or a parquet row) holds either ``prompt`` and ``completion`` strings, or ``messages``:
a list of ``{"role": "system" | "user" | "assistant", "content": str}``. Each record becomes one example — token ids
and, for every token, whether the loss is taken on it:

- prompt/completion: the prompt's tokens (not trained), the completion's and the end token (``tokenizer.sep_id``)
  after it (trained);
- messages with the built-in template (the byte tokenizer, or a tokenizer without a chat template): each turn is
  ``<|role|>\\n{content}\\n``; an assistant turn's content and its closing newline are trained, everything else not;
- messages with a tokenizer directory's ``chat_template`` (``tokenizer_config.json``), rendered as transformers
  renders it (Jinja in a sandbox, ``bos_token``/``eos_token`` from the config): the text of ``messages[:i]`` with
  ``add_generation_prompt`` ends where assistant turn ``i`` begins, the text of ``messages[:i + 1]`` where it ends;
  the text between is trained. Each span is tokenized on its own, so the mask falls on token boundaries exactly.

An example longer than ``seq_len + 1`` tokens (one window) follows ``data.truncation``: ``drop`` (the default) leaves it
out, ``truncate`` keeps its first ``seq_len + 1`` tokens (dropped all the same when nothing trained is left). Both are
counted in the dataset's ``report``.

Packing (``data.packing``): ``none`` — one example per row, padded with the end token (padding never trained; with
causal attention the padding after an example cannot change its tokens); ``concat`` — examples laid end to end and
cut into windows as pre-training text is (attention then crosses example boundaries); ``documents`` — as
``concat``, but each example attends only to itself with positions from 0 (:func:`~kuangchao_core.data.packing.
document_window`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kuangchao_core.config.bounded_json import BoundedJSONError, loads_bounded
from kuangchao_core.data.files import resolve_files
from kuangchao_core.data.packing import document_window, num_windows
from kuangchao_core.data.stream import Oversize, lines, open_binary
from kuangchao_core.errors import DataError

ROLES = ("system", "user", "assistant")


@dataclass
class Example:
    """Token ids and, per token, whether the loss is taken on it (``trained``, same length)."""

    ids: list[int]
    trained: list[bool]


@dataclass
class SFTReport:
    """What building the examples kept and left out."""

    records: int = 0
    examples: int = 0
    dropped_too_long: int = 0
    truncated: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    where_dropped: list[str] = field(default_factory=list)  # the first few, to name in the log

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready counts."""
        return {k: v for k, v in self.__dict__.items() if k != "where_dropped"} | {
            "first_dropped": self.where_dropped[:3]
        }


# ---------------------------------------------------------------------- records
def iter_sft_records(path: str | Path, max_line_bytes: int | None = None) -> Iterator[tuple[dict[str, Any], str]]:
    """Every record under ``path`` (``.jsonl`` or ``.parquet`` files) as a dict, with where it came from. JSON lines
    are streamed and parsed with the bounded JSON reader; a line over ``max_line_bytes`` raises DataError."""
    for f, kind in resolve_files(path, "auto"):
        if kind == "jsonl":
            with open_binary(f) as fh:
                for lineno, line in lines(fh, max_line_bytes):
                    if isinstance(line, Oversize):
                        raise DataError(
                            f"{f}:{lineno}: a line of {line.n_bytes} bytes, more than the limit of {line.limit}"
                        )
                    if not line.strip():
                        continue
                    try:
                        obj = loads_bounded(line, max_bytes=len(line))
                    except BoundedJSONError as exc:
                        raise DataError(f"{f}:{lineno}: refused, {exc.reason}") from None
                    if not isinstance(obj, dict):
                        raise DataError(f"{f}:{lineno}: a record must be a JSON object, got {type(obj).__name__}")
                    yield obj, f"{f}:{lineno}"
        elif kind == "parquet":
            import pyarrow.parquet as pq

            for row, obj in enumerate(pq.read_table(f).to_pylist()):
                yield obj, f"{f}#row{row}"
        else:
            raise DataError(f"{f}: data.format sft reads .jsonl and .parquet files, not {kind}")


def _messages(record: dict[str, Any], where: str) -> list[dict[str, str]] | None:
    msgs = record.get("messages")
    if msgs is None:
        return None
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: messages[{i}] must be {{'role': one of {list(ROLES)}, 'content': a string}}, got {m!r}"[:300]
            )
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant message: nothing to train on")
    return out


# ---------------------------------------------------------------------- rendering
def _render_chat(template: str, messages: list[dict[str, str]], generation: bool, special: dict[str, str]) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=generation, **special)
    except TemplateError as exc:
        raise DataError(f"data.tokenizer chat_template: {exc}") from exc


def chat_spans(messages: list[dict[str, str]], tokenizer: Any) -> list[tuple[str, bool]]:
    """The rendered conversation as ``(text, trained)`` spans (see the module docstring)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        spans = []
        for m in messages:
            if m["role"] == "assistant":
                spans += [("<|assistant|>\n", False), (m["content"] + "\n", True)]
            else:
                spans.append((f"<|{m['role']}|>\n{m['content']}\n", False))
        return spans
    special = getattr(tokenizer, "special_tokens", {})
    spans, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _render_chat(template, messages[:i], True, special)
        end = _render_chat(template, messages[: i + 1], False, special)
        if not start.startswith(done) or not end.startswith(start):
            raise DataError(
                "data.tokenizer chat_template: rendering a conversation's prefix does not give a prefix of the whole; "
                "the assistant turns cannot be located"
            )
        spans += [(start[len(done) :], False), (end[len(start) :], True)]
        done = end
    whole = _render_chat(template, messages, False, special)
    if whole[len(done) :]:
        spans.append((whole[len(done) :], False))
    return [s for s in spans if s[0]]


def record_text(record: dict[str, Any], where: str) -> str:
    """The text of a record the model reads (prompt and completion, or the turns' contents), for data validation;
    raises ``DataError`` for a record training could not use."""
    msgs = _messages(record, where)
    if msgs is not None:
        return "\n".join(m["content"] for m in msgs)
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DataError(
            f"{where}: an sft record needs string fields 'prompt' and 'completion', or 'messages' "
            f"(found {sorted(record)[:8]})"
        )
    return prompt + completion


def encode_record(record: dict[str, Any], where: str, tokenizer: Any) -> Example:
    """One record as an :class:`Example` (prompt/completion or messages)."""
    msgs = _messages(record, where)
    if msgs is not None:
        spans = chat_spans(msgs, tokenizer)
        ids: list[int] = []
        trained: list[bool] = []
        for text, on in spans:
            t = tokenizer.encode(text)
            ids += t
            trained += [on] * len(t)
        return Example(ids, trained)
    record_text(record, where)  # the fields' checks
    prompt, completion = record["prompt"], record["completion"]
    p, c = tokenizer.encode(prompt), tokenizer.encode(completion) + [int(tokenizer.sep_id)]
    return Example(p + c, [False] * len(p) + [True] * len(c))


def build_examples(
    records: Iterator[tuple[dict[str, Any], str]], tokenizer: Any, seq_len: int, truncation: str = "drop"
) -> tuple[list[Example], SFTReport]:
    """Every record encoded, too-long ones dropped or truncated by ``truncation``; with the report of what happened."""
    if truncation not in ("drop", "truncate"):
        raise DataError(f"data.truncation must be drop or truncate, got {truncation!r}")
    limit = seq_len + 1
    report, out = SFTReport(), []
    for record, where in records:
        report.records += 1
        ex = encode_record(record, where, tokenizer)
        if len(ex.ids) > limit:
            if truncation == "drop" or not any(ex.trained[:limit]):
                report.dropped_too_long += 1
                report.where_dropped.append(where)
                continue
            ex = Example(ex.ids[:limit], ex.trained[:limit])
            report.truncated += 1
        out.append(ex)
        report.examples += 1
        report.tokens += len(ex.ids)
        report.trained_tokens += sum(ex.trained[1:])  # the first token is never a label
    if not out:
        raise DataError(
            f"data: none of {report.records} sft records fits data.seq_len {seq_len} "
            f"({report.dropped_too_long} too long); raise data.seq_len or set data.truncation: truncate"
        )
    return out, report


# ---------------------------------------------------------------------- the dataset
class SFTDataset:
    """Windows of ``seq_len`` input tokens whose labels are -100 wherever the loss is not taken.

    Holds the examples end to end — ``ids`` (int32), ``trained`` (bool) and ``starts`` (where each example begins) —
    in memory or mapped from the data cache; a ``packing: none`` row is cut and padded when it is read.
    """

    def __init__(
        self,
        ids: torch.Tensor,
        trained: torch.Tensor,
        starts: np.ndarray,
        seq_len: int,
        packing: str,
        name: str,
        tokenizer,
        report,
    ):
        if packing not in ("none", "concat", "documents"):
            raise DataError(f"data.packing {packing!r} is not available for sft data; use none, concat or documents")
        self.seq_len, self.name, self.tokenizer, self.report, self.packing = seq_len, name, tokenizer, report, packing
        self.ids, self.trained, self.starts = ids, trained, starts
        self.corpus = None
        self.examples: list[Example] | None = None
        if packing == "none":
            self._n = len(starts)
        else:
            self._n = num_windows(self.ids.numel(), seq_len)
            if self._n == 0:
                raise DataError(f"dataset {name!r}: {self.ids.numel()} tokens, fewer than one window of {seq_len + 1}")

    @classmethod
    def from_examples(
        cls, examples: Sequence[Example], seq_len: int, packing: str, name: str, tokenizer, report
    ) -> SFTDataset:
        """The dataset of encoded ``examples``."""
        lengths = [len(ex.ids) for ex in examples]
        ids = torch.from_numpy(np.concatenate([np.asarray(ex.ids, dtype=np.int32) for ex in examples]))
        trained = torch.from_numpy(np.concatenate([np.asarray(ex.trained, dtype=bool) for ex in examples]))
        starts = np.cumsum([0] + lengths[:-1], dtype=np.int64)
        return cls(ids, trained, starts, seq_len, packing, name, tokenizer, report)

    def example(self, i: int) -> Example:
        """Example ``i`` as encoded."""
        lo = int(self.starts[i])
        hi = int(self.starts[i + 1]) if i + 1 < len(self.starts) else self.ids.numel()
        return Example(self.ids[lo:hi].tolist(), self.trained[lo:hi].tolist())

    @property
    def num_tokens(self) -> int:
        """Tokens in the rows (padding included for ``packing: none``)."""
        return self._n * (self.seq_len + 1) if self.packing == "none" else int(self.ids.numel())

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -self._n <= index < self._n:
            raise IndexError(f"window {index} out of range for {self._n} windows")
        index %= self._n
        width = self.seq_len + 1
        if self.packing == "none":
            lo = int(self.starts[index])
            hi = int(self.starts[index + 1]) if index + 1 < len(self.starts) else self.ids.numel()
            ids = torch.full((width,), int(self.tokenizer.sep_id), dtype=torch.long)
            trained = torch.zeros(width, dtype=torch.bool)
            ids[: hi - lo] = self.ids[lo:hi].long()
            trained[: hi - lo] = self.trained[lo:hi]
        elif self.packing == "documents":
            out = document_window(self.ids, self.starts, index, self.seq_len)
            lo = index * self.seq_len
            keep = self.trained[lo + 1 : lo + width]
            out["labels"] = torch.where(keep, out["labels"], torch.full_like(out["labels"], -100))
            return out
        else:
            lo = index * self.seq_len
            ids, trained = self.ids[lo : lo + width].long(), self.trained[lo : lo + width]
        labels = torch.where(trained[1:], ids[1:], torch.full_like(ids[1:], -100))
        return {"input_ids": ids[:-1], "labels": labels}


def build_sft_dataset(
    path: str, tokenizer: Any, seq_len: int, packing: str, truncation: str, keep_examples: bool = False
) -> SFTDataset:
    """The :class:`SFTDataset` of every record under ``path``; ``keep_examples`` keeps the encoded examples as
    ``examples`` (held-out data: their prompts and answers are asked at each evaluation)."""
    examples, report = build_examples(iter_sft_records(path), tokenizer, seq_len, truncation)
    ds = SFTDataset.from_examples(examples, seq_len, packing, str(path), tokenizer, report)
    ds.examples = list(examples) if keep_examples else None
    return ds
