"""The data check's per-record facts, gathered as the records stream past (issue 38): no record's text is kept.

Each record adds one entry to compact columns — its UTF-8 bytes, its tokens, whether it is valid UTF-8, blank or
holds a refused control character, and a 64-bit BLAKE2b digest of its text for the duplicate share — about 27 bytes
a record whatever its size; the first few offenders (oversize records, control characters) are named ``file:line``
as they pass. ``frame()`` is the DataFrame the expectation suite of ``kuangchao_core.data.validation`` runs over.
Two different records collide in 64 bits with probability about ``n**2 / 2**65``, far below one duplicate's share.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from typing import Any

from kuangchao_core.data.files import decode_record
from kuangchao_core.data.stream import Oversize

#: NUL and control characters refused in text: C0 but tab/newline, a CR not before LF, DEL and C1
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]|\r(?!\n)")
_LINE_OF = re.compile(r"^(.*):(\d+)$", re.DOTALL)
#: how many offending records a detail names
NAMED = 3


def control_char_at(text: str) -> int | None:
    """Offset of the first refused control character in ``text`` (see :data:`CONTROL_CHARS`), or None."""
    found = CONTROL_CHARS.search(text)
    return None if found is None else found.start()


def control_where(raw: bytes | str, text: str, at: int, where: str) -> str:
    """``file:line: U+XXXX`` of a control character: a text file's line is counted from the record's first line."""
    m = _LINE_OF.match(where)
    if m and isinstance(raw, bytes):  # a .txt document: its newlines are the file's
        where = f"{m.group(1)}:{int(m.group(2)) + text.count(chr(10), 0, at)}"
    return f"{where or 'record'}: U+{ord(text[at]):04X} at character {at}"


def _digest(text: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).digest(), "little", signed=True
    )


class RecordFacts:
    """The columns of the records added so far (module docstring); ``tokenizer`` has ``encode(text)`` (None: one
    token a UTF-8 byte)."""

    def __init__(self, tokenizer: Any = None, allow_control_chars: bool = False, max_record_bytes: int | None = None):
        self.tokenizer, self.allow_control_chars, self.max_record_bytes = (
            tokenizer,
            allow_control_chars,
            max_record_bytes,
        )
        self.n_bytes, self.n_tokens, self.digest = array("q"), array("q"), array("q")
        self.valid, self.blank, self.control = array("b"), array("b"), array("b")
        self.oversize: list[str] = []  # the first NAMED oversize records' file:line
        self.controls: list[str] = []  # the first NAMED control characters, file:line: U+XXXX
        self.n_oversize = self.n_control = 0

    def __len__(self) -> int:
        return len(self.n_bytes)

    def add(self, raw: bytes | str | Oversize, where: str = "") -> None:
        """One record (an Oversize one: its size only, never blank, never a duplicate, no tokens)."""
        if isinstance(raw, Oversize):
            text, ok, n_bytes, tokens = f"\x00oversize record {len(self)}", True, raw.n_bytes, 0
            at = None
        else:
            text, ok = decode_record(raw)
            n_bytes = len(raw) if isinstance(raw, bytes) else len(text.encode("utf-8", "replace"))
            tokens = n_bytes if self.tokenizer is None else len(self.tokenizer.encode(text))
            at = None if self.allow_control_chars else control_char_at(text)
        if self.max_record_bytes is not None and n_bytes > self.max_record_bytes:
            self.n_oversize += 1
            if where and len(self.oversize) < NAMED:
                self.oversize.append(where)
        if at is not None:
            self.n_control += 1
            if len(self.controls) < NAMED:
                self.controls.append(control_where(raw, text, at, where))  # type: ignore[arg-type]
        self.n_bytes.append(n_bytes)
        self.n_tokens.append(tokens)
        self.digest.append(_digest(text))
        self.valid.append(ok)
        self.blank.append(not text.strip())
        self.control.append(at is not None)

    def frame(self):
        """The columns as a DataFrame (``n_bytes``, ``n_tokens``, ``is_valid_utf8``, ``is_blank``, ``has_control``,
        ``text_hash``)."""
        import numpy as np
        import pandas as pd

        def col(values: array, dtype: str):
            return np.frombuffer(values, dtype=np.int64 if values.typecode == "q" else np.int8).astype(dtype)

        return pd.DataFrame(
            {
                "n_bytes": col(self.n_bytes, "int64"),
                "n_tokens": col(self.n_tokens, "int64"),
                "is_valid_utf8": col(self.valid, "bool"),
                "is_blank": col(self.blank, "bool"),
                "has_control": col(self.control, "bool"),
                "text_hash": col(self.digest, "int64"),
            }
        )
