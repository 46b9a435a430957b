"""Packing: documents tokenized and joined with a separator into one token stream, cut into windows.

Window ``i`` covers stream tokens ``[i*seq_len, i*seq_len + seq_len]`` (``seq_len + 1`` tokens, consecutive
windows share one boundary token): ``input_ids`` are its first ``seq_len`` tokens, ``labels`` its last ``seq_len``
(already shifted, so ``labels[t]`` is the token after ``input_ids[t]``). The tail that does not fill a window is
dropped.

``data.packing: documents`` (:func:`document_window`) keeps the documents apart inside a window: each token carries
its document's ``segment_ids`` (attention stays inside it) and its ``position_ids`` within the document (rotary
positions restart), and the label that would predict the next document's first token from this one's last is
-100. A window's loss is then the sum of its documents' losses, each as if run alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import BinaryIO

import numpy as np
import torch

from kuangchao_core.errors import DataError


def _document_ids(doc: str | Iterable[str], tokenizer, sep: int) -> np.ndarray:
    """A document's tokens and the separator; a document given in pieces (a whole ``.txt`` file) is encoded piece
    by piece (``files.read_documents``: cut after a newline where possible)."""
    pieces = [doc] if isinstance(doc, str) else doc
    arrays = [np.asarray(tokenizer.encode(piece), dtype=np.int32) for piece in pieces]
    arrays.append(np.array([sep], dtype=np.int32))
    return np.concatenate(arrays)


def write_packed_stream(
    docs: Iterable[str | Iterable[str]], tokenizer, tokens_out: BinaryIO, starts_out: BinaryIO
) -> tuple[int, int, int]:
    """The stream :func:`pack_documents_with_starts` builds, written as it is encoded: each piece's tokens (int32)
    to ``tokens_out``, each document's start (int64) to ``starts_out``; only one piece is in memory at a time.
    Returns ``(tokens, documents, largest token id or -1)``."""
    sep = np.array([int(tokenizer.sep_id)], dtype=np.int32)
    n_tokens = n_docs = 0
    max_token = -1
    for doc in docs:
        np.array([n_tokens], dtype=np.int64).tofile(starts_out)
        n_docs += 1
        for piece in [doc] if isinstance(doc, str) else doc:
            ids = np.asarray(tokenizer.encode(piece), dtype=np.int32)
            if ids.size:
                ids.tofile(tokens_out)
                n_tokens += int(ids.size)
                max_token = max(max_token, int(ids.max()))
        sep.tofile(tokens_out)
        n_tokens += 1
        max_token = max(max_token, int(sep[0]))
    return n_tokens, n_docs, max_token


def pack_documents_with_starts(
    docs: Iterable[str | Iterable[str]], tokenizer, vocab_size: int | None = None
) -> tuple[torch.Tensor, np.ndarray]:
    """One int32 stream — each document's tokens followed by ``tokenizer.sep_id`` — and where each document starts
    in it (int64, ascending). A document is a string or an iterable of its pieces."""
    sep = int(tokenizer.sep_id)
    parts = [_document_ids(doc, tokenizer, sep) for doc in docs]
    stream = torch.from_numpy(np.concatenate(parts)) if parts else torch.empty(0, dtype=torch.int32)
    if vocab_size is not None and stream.numel() and int(stream.max()) >= vocab_size:
        raise DataError(
            f"token id {int(stream.max())} is outside model.vocab_size {vocab_size}; "
            "use a tokenizer that fits the model or raise model.vocab_size"
        )
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]], dtype=np.int64) if parts else np.zeros(0, np.int64)
    return stream, starts


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many full windows of ``seq_len + 1`` tokens a stream of ``num_tokens`` holds."""
    return max(0, (num_tokens - 1) // seq_len)


def window(stream: torch.Tensor, index: int, seq_len: int) -> dict[str, torch.Tensor]:
    """``input_ids``/``labels`` (LongTensors of ``seq_len``) of window ``index``."""
    chunk = stream[index * seq_len : index * seq_len + seq_len + 1].long()
    return {"input_ids": chunk[:-1], "labels": chunk[1:]}


def document_window(stream: torch.Tensor, starts: np.ndarray, index: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Window ``index`` with ``segment_ids``, ``position_ids`` and cross-document labels masked (module docstring);
    ``starts``: where each document begins in ``stream``."""
    lo = index * seq_len
    out = window(stream, index, seq_len)
    pos = np.arange(lo, lo + seq_len + 1)
    doc = np.searchsorted(starts, pos, side="right") - 1
    out["segment_ids"] = torch.from_numpy(doc[:-1] - doc[0])
    out["position_ids"] = torch.from_numpy(pos[:-1] - starts[doc[:-1]])
    crosses = torch.from_numpy(doc[1:] != doc[:-1])
    out["labels"] = torch.where(crosses, torch.full_like(out["labels"], -100), out["labels"])
    return out
