"""Streaming readers of text and JSON-lines files, with a per-record size limit applied while reading.

A file is read in pieces of at most :data:`PIECE_BYTES` (``readline`` with a size), never whole: a record (a
``.txt`` document — lines up to a blank line — or a ``.jsonl`` line) that grows past its limit stops being kept
and comes back as :class:`Oversize` with its full size once its end is found, so a 1 GiB single-line file costs
one pass over its bytes and about one piece of memory. Without a limit the records are assembled as before.

Blank-line splitting (``data.txt_documents: blank_lines``, the rule ``files.read_txt`` had before issue 39): a line
of only spaces and tabs (``\\r\\n`` or ``\\n``) after another line ends a document; a document is stripped of its
leading and trailing ``\\r``/``\\n`` and skipped when only whitespace is left — so those blank lines are not kept.

Whole files (``data.txt_documents: file``, the default since issue 39): :func:`file_pieces` cuts a file's bytes, all
of them as written, into consecutive pieces of at most a given size — after a newline where the piece has one,
else at a UTF-8 character boundary — so a file of any size is read with bounded memory and nothing is refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

#: the most bytes read at a time (a longer line arrives in several pieces)
PIECE_BYTES = 1 << 20

_NEWLINES = b"\r\n"


@dataclass(frozen=True)
class Oversize:
    """A record refused while reading because it holds more than ``limit`` bytes (``n_bytes``, the whole
    record's size once its end was found); its bytes were not kept."""

    n_bytes: int
    limit: int


def open_binary(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for reading bytes with a buffer of one piece (the default 8 KiB buffer makes ``readline``
    of a long line several times slower)."""
    return open(path, "rb", buffering=PIECE_BYTES)


def _pieces(f: BinaryIO) -> Iterator[tuple[bytes, bool, int]]:
    """``(piece, starts a line, line number)`` for each piece of at most PIECE_BYTES bytes."""
    lineno, at_start = 0, True
    while True:
        piece = f.readline(PIECE_BYTES)
        if not piece:
            return
        if at_start:
            lineno += 1
        yield piece, at_start, lineno
        at_start = piece.endswith(b"\n")


def _is_separator(piece: bytes, starts: bool, lineno: int) -> bool:
    """A whole line of only spaces/tabs after another line: the blank line that ends a document."""
    if not (starts and lineno > 1 and piece.endswith(b"\n")):
        return False
    body = piece[:-1]
    if body.endswith(b"\r"):
        body = body[:-1]
    return not body.translate(None, b" \t")


def _leading_newlines(piece: bytes) -> int:
    """How many ``\\r``/``\\n`` bytes begin ``piece`` (a copy is made only when there are some)."""
    return len(piece) - len(piece.lstrip(_NEWLINES)) if piece[:1] in (b"\r", b"\n") else 0


def _trailing_newlines(piece: bytes) -> int:
    """How many ``\\r``/``\\n`` bytes end ``piece``."""
    return len(piece) - len(piece.rstrip(_NEWLINES)) if piece[-1:] in (b"\r", b"\n") else 0


class _Document:
    """One document being read: its pieces while under the limit, its size as stripped of ``\\r``/``\\n``."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.parts: list[bytes] = []
        self.total = self.lead = self.tail = 0
        self.first_line: int | None = None
        self.over = False

    @property
    def size(self) -> int:
        return self.total - self.lead - self.tail if self.first_line is not None else 0

    def add(self, piece: bytes, lineno: int) -> None:
        self.total += len(piece)
        lead = _leading_newlines(piece)
        if lead == len(piece):
            self.tail += len(piece)
            if self.first_line is None:
                self.lead += len(piece)
        else:
            if self.first_line is None:
                self.first_line = lineno
                self.lead += lead
            self.tail = _trailing_newlines(piece)
        if not self.over:
            self.parts.append(piece)
            if self.limit is not None and self.size > self.limit:
                self.over, self.parts = True, []

    def result(self) -> tuple[bytes | Oversize, int] | None:
        if self.first_line is None:
            return None
        if self.over:
            return Oversize(self.size, self.limit or 0), self.first_line
        block = b"".join(self.parts).strip(_NEWLINES)
        return (block, self.first_line) if block.strip() else None


def text_documents(f: BinaryIO, max_record_bytes: int | None = None) -> Iterator[tuple[bytes | Oversize, int]]:
    """``(document bytes or Oversize, line where it starts)`` for the blank-line separated documents of ``f``."""
    doc = _Document(max_record_bytes)
    for piece, starts, lineno in _pieces(f):
        if _is_separator(piece, starts, lineno):
            done = doc.result()
            if done is not None:
                yield done
            doc = _Document(max_record_bytes)
        else:
            doc.add(piece, lineno)
    done = doc.result()
    if done is not None:
        yield done


def lines(f: BinaryIO, max_line_bytes: int | None = None) -> Iterator[tuple[int, bytes | Oversize]]:
    """``(line number, line without its \\r\\n or \\n, or Oversize)`` for every line of ``f``."""
    parts: list[bytes] = []
    size, start, over = 0, 0, False
    for piece, starts, lineno in _pieces(f):
        if starts:
            parts, size, start, over = [], 0, lineno, False
        size += len(piece)
        if not over:
            parts.append(piece)
            if max_line_bytes is not None and size - 2 > max_line_bytes:
                over, parts = True, []
        if piece.endswith(b"\n"):
            yield start, _line_result(parts, size, over, max_line_bytes)
            parts, size = [], 0
    if size:
        yield start, _line_result(parts, size, over, max_line_bytes)


def _line_result(parts: list[bytes], size: int, over: bool, limit: int | None) -> bytes | Oversize:
    if over:
        return Oversize(size, limit or 0)
    line = b"".join(parts).rstrip(_NEWLINES)
    if limit is not None and len(line) > limit:
        return Oversize(len(line), limit)
    return line


def _char_boundary(buf: bytearray, at: int) -> int:
    """The offset nearest below or at ``at`` where a UTF-8 character of ``buf`` starts (at most 3 bytes back);
    ``at`` itself where the bytes are not UTF-8 (nothing to keep whole)."""
    cut = at
    while cut > 0 and at - cut < 3 and (buf[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut if cut > 0 and (buf[cut] & 0xC0) != 0x80 else at


def file_pieces(f: BinaryIO, max_piece_bytes: int | None = None) -> Iterator[tuple[bytes, int]]:
    """``(bytes, line where they start)``: every byte of ``f`` in order, in pieces of at most ``max_piece_bytes``
    (default :data:`PIECE_BYTES`), each cut after its last newline when it has one, else at a character boundary;
    joined, the pieces are the file exactly."""
    limit = max(4, int(max_piece_bytes or PIECE_BYTES))
    buf, line = bytearray(), 1
    for piece, _, _ in _pieces(f):
        buf += piece
        while len(buf) > limit:
            cut = buf.rfind(b"\n", 0, limit) + 1 or _char_boundary(buf, limit)
            out = bytes(buf[:cut])
            del buf[:cut]
            yield out, line
            line += out.count(b"\n")
    if buf:
        yield bytes(buf), line
