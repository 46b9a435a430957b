"""A byte-level BPE tokenizer trained on the user's own text with the ``tokenizers`` library (``kc data prepare``,
issue 39).

Byte-level: the text's UTF-8 bytes are mapped to 256 printable characters (GPT-2's table) before the merges are
learnt, so every text encodes — no unknown token — and decoding gives back the exact text, whitespace, blank lines
and ``\\r\\n`` included (no normalizer, no prefix space, no clean-up of spaces on decode). The vocabulary is the 256
bytes, the end-of-text token :data:`EOS` (it separates documents, ``data.tokenizer``) and the merges learnt up to
``vocab_size``; a small corpus may give fewer.

Written as a Hugging Face tokenizer directory: ``tokenizer.json`` and ``tokenizer_config.json`` (``eos_token``,
``PreTrainedTokenizerFast``), which ``transformers.AutoTokenizer.from_pretrained(dir)`` and ``data.tokenizer: dir``
both read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from kuangchao_core.errors import DataError

EOS = "<|endoftext|>"
#: the smallest vocabulary: the 256 bytes and the end-of-text token
MIN_VOCAB = 257


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def train_byte_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path, max_length: int | None = None) -> int:
    """Train a byte-level BPE tokenizer of at most ``vocab_size`` tokens on ``texts`` and write it to ``out_dir``
    (``tokenizer.json``, ``tokenizer_config.json``); returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise DataError(f"--vocab-size: {vocab_size} is below {MIN_VOCAB} (the 256 bytes and the end-of-text token)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tokenizer.json.tmp-{os.getpid()}"
    tok.save(str(tmp))
    os.replace(tmp, out / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    if max_length:
        config["model_max_length"] = int(max_length)
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", {"eos_token": EOS})
    return tok.get_vocab_size(with_added_tokens=True)
