"""How many bytes and characters of text each token id spells (issue 39 item 5), to restate a loss per token as
nats per character and bits per byte.

A held-out loss is the mean over labelled tokens; the same sum over the text those tokens spell is
``loss × tokens / characters`` nats per character, and ``loss × tokens / bytes / ln 2`` bits per byte. The text of
a labelled token is its UTF-8 bytes; its characters are those of its bytes that start a UTF-8 character (not
``10xxxxxx``), so a character split across two tokens counts once, in the token of its first byte, and a run of
tokens counts exactly the characters of the text it spells. A special token (``<|endoftext|>``, which separates
documents) spells no text: 0 bytes, 0 characters, while its loss stays in the sum.

Known for the byte tokenizer (one byte per id) and for byte-level tokenizers (a ``ByteLevel`` decoder, every token
written in GPT-2's 256-character byte alphabet, as ``kc data prepare`` trains); any other tokenizer gives None.
"""

from __future__ import annotations

from typing import Any

import torch


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character that stands for each byte -> the byte.

    The bytes ``!``..``~``, ``¡``..``¬`` and ``®``..``ÿ`` stand for themselves; the other 68, in order, for
    U+0100, U+0101, …"""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in kept}, 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _counts(raw: bytes) -> tuple[int, int]:
    return len(raw), sum(1 for b in raw if b & 0xC0 != 0x80)


def token_text_sizes(tokenizer: Any, vocab_size: int) -> torch.Tensor | None:
    """``(vocab_size, 2)`` int64: the bytes and characters each id spells (ids beyond the tokenizer's: 0), or None
    when the tokenizer's tokens are not byte sequences it can name (see the module docstring)."""
    sizes = torch.zeros(max(int(vocab_size), 1), 2, dtype=torch.int64)
    if getattr(tokenizer, "name", None) == "byte":
        for b in range(min(256, len(sizes))):
            sizes[b] = torch.tensor(_counts(bytes([b])))
        return sizes
    inner = getattr(tokenizer, "_tok", None)
    if inner is None or type(inner.decoder).__name__ != "ByteLevel":
        return None  # only a byte-level decoder turns each token's characters back into bytes
    alphabet = byte_alphabet()
    special = {t.content for t in inner.get_added_tokens_decoder().values() if t.special}
    for token, index in inner.get_vocab(with_added_tokens=True).items():
        if index >= len(sizes) or token in special:
            continue
        if any(ch not in alphabet for ch in token):
            return None  # not a byte-level vocabulary
        sizes[index] = torch.tensor(_counts(bytes(alphabet[ch] for ch in token)))
    return sizes


def labelled_text_sizes(sizes: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[bytes, characters]`` (float64) of the labelled tokens of ``labels`` (``ignore_index`` where none); an id
    beyond the table (a model vocabulary padded past the tokenizer's) spells nothing."""
    kept = labels[(labels != ignore_index) & (labels >= 0) & (labels < len(sizes))]
    return sizes.to(kept.device)[kept].sum(dim=0).double()
