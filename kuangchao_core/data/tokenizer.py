"""Tokenizers: a byte-level one by default, or a local Hugging Face ``tokenizers`` JSON file or tokenizer directory
(never the hub).

Document separator: for :class:`ByteTokenizer` it is byte 10 (``"\\n"``); a ``tokenizers`` file uses its
end-of-text special token when it has one (``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>``), else
the id of ``"\\n"``.

Ids outside a tokenizer's vocabulary: a model's vocabulary may be padded beyond its tokenizer's (``model.vocab_size``
320 with the byte tokenizer's 256, an embedding rounded up past a Hugging Face tokenizer's size), and greedy decoding
can then produce an id the tokenizer does not know. ``decode`` never raises on one and never drops it silently: it
shows it as ``<unk:ID>`` (:data:`UNKNOWN_ID`) between the text of the known ids around it.
"""

from __future__ import annotations

from pathlib import Path

from kuangchao_core.errors import DataError

_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")

#: how ``decode`` shows an id outside the tokenizer's vocabulary (formatted with the id)
UNKNOWN_ID = "<unk:{}>"


def _decode_known(ids, vocab_size: int, decode_run) -> str:
    """Text of ``ids``: each run of ids in ``[0, vocab_size)`` through ``decode_run(list)``, every other id as
    :data:`UNKNOWN_ID`."""
    parts: list[str] = []
    run: list[int] = []
    for i in ids:
        i = int(i)
        if 0 <= i < vocab_size:
            run.append(i)
            continue
        if run:
            parts.append(decode_run(run))
            run = []
        parts.append(UNKNOWN_ID.format(i))
    if run:
        parts.append(decode_run(run))
    return "".join(parts)


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, separator id 10 (newline)."""

    vocab_size = 256
    sep_id = 10
    name = "byte"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; invalid UTF-8 sequences become U+FFFD, an id outside 0..255 ``<unk:ID>`` (never raises)."""
        return _decode_known(ids, self.vocab_size, lambda run: bytes(run).decode("utf-8", errors="replace"))


def _token_text(value) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_config(path: Path) -> dict:
    import json

    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise DataError(f"data.tokenizer: {path} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise DataError(f"data.tokenizer: {path} must hold a JSON object")
    return config


class HFTokenizer:
    """A ``tokenizers`` JSON file loaded from local disk, or a Hugging Face tokenizer directory (``tokenizer.json``
    and ``tokenizer_config.json``, whose ``chat_template``, ``bos_token`` and ``eos_token`` are kept; the end token
    separates documents)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        config = {}
        if path.is_dir():
            config = _read_config(path / "tokenizer_config.json")
            path = path / "tokenizer.json"
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.special_tokens = {
            k: v for k in ("bos_token", "eos_token") if (v := _token_text(config.get(k))) is not None
        }
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(
                f"data.tokenizer: no tokenizer file at {self.path}; give 'byte', a local tokenizers JSON or a "
                "directory holding tokenizer.json"
            )
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as exc:  # the Rust library raises plain Exceptions
            raise DataError(f"data.tokenizer: {self.path} is not a valid tokenizers JSON file: {exc}") from exc
        self.name = str(self.path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos = self.special_tokens.get("eos_token")
        sep = vocab.get(eos) if eos else None
        if sep is None:
            sep = next((vocab[n] for n in _EOS_NAMES if n in vocab), None)
        if sep is None:
            ids = self._tok.encode("\n", add_special_tokens=False).ids
            if len(ids) != 1:
                raise DataError(
                    f"data.tokenizer: {self.path} has no end-of-text token and no single token for a newline; "
                    f"add one of {list(_EOS_NAMES)} as a special token"
                )
            sep = ids[0]
        self.sep_id = int(sep)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens included); an id outside the vocabulary shows as ``<unk:ID>`` (the
        ``tokenizers`` library would drop it silently, or raise for a negative one)."""
        return _decode_known(ids, self.vocab_size, lambda run: self._tok.decode(run, skip_special_tokens=False))


def get_tokenizer(spec: str | None, vocab_size: int | None = None) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` (or None) -> ByteTokenizer, else a path to a tokenizers JSON or a tokenizer directory. Checks the
    vocabulary fits the model."""
    tok = ByteTokenizer() if spec in (None, "", "byte") else HFTokenizer(spec)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise DataError(
            f"data.tokenizer: {tok.name} has {tok.vocab_size} tokens but model.vocab_size is {vocab_size}; "
            "raise model.vocab_size or use a smaller tokenizer"
        )
    return tok


def vocab_padding_note(tokenizer, vocab_size: int | None) -> str | None:
    """The warning to give once for a model vocabulary larger than ``tokenizer``'s (None when it is not larger):
    both sizes, that the extra ids are never produced by the data, and how a greedy sample shows one."""
    if vocab_size is None or int(vocab_size) <= tokenizer.vocab_size:
        return None
    return (
        f"model.vocab_size {int(vocab_size)} is larger than the tokenizer's vocabulary ({tokenizer.name}: "
        f"{tokenizer.vocab_size} tokens): ids {tokenizer.vocab_size}..{int(vocab_size) - 1} are never produced by "
        f"the data (padding of the model's embedding and output layer); a greedy sample that predicts one shows it "
        f"as {UNKNOWN_ID.format('ID')}"
    )
