"""The tokenizer files written beside an exported model, so ``transformers.AutoTokenizer`` reads the job's tokenizer.

- a tokenizer directory: its ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` copied;
- a ``tokenizers`` JSON file: copied as ``tokenizer.json``, with a minimal ``tokenizer_config.json``;
- ``byte``: a ``tokenizer.json`` that encodes every text to its UTF-8 bytes exactly as
  :class:`~kuangchao_core.data.tokenizer.ByteTokenizer` does — byte-level pre-tokenization (each byte one
  character, GPT-2's mapping) and a BPE model whose vocabulary gives each such character its byte value and has no
  merges — and a ``tokenizer_config.json`` with the built-in chat template of sft messages.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

#: the built-in chat format of sft messages (``kuangchao_core.data.sft.chat_spans`` without a template), in Jinja
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def byte_level_chars() -> list[str]:
    """The character standing for each byte 0..255 under byte-level pre-tokenization (GPT-2's table): printable
    Latin-1 bytes stand for themselves, the others for code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    keep = set(printable)
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def byte_tokenizer_json() -> dict:
    """The ``tokenizers`` JSON of the byte tokenizer (ids = UTF-8 byte values)."""
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": level,
        "post_processor": None,
        "decoder": level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {c: b for b, c in enumerate(byte_level_chars())},
            "merges": [],
        },
    }


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_tokenizer_files(spec: str, out_dir: str | os.PathLike[str], max_length: int) -> list[str]:
    """Write the tokenizer of ``data.tokenizer`` = ``spec`` into ``out_dir``; returns the file names written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(max_length)}
    if spec == "byte":
        _write_json(out / "tokenizer.json", byte_tokenizer_json())
        _write_json(out / "tokenizer_config.json", {**base_config, "chat_template": BUILTIN_CHAT_TEMPLATE})
        return ["tokenizer.json", "tokenizer_config.json"]
    src = Path(spec)
    written = []
    if src.is_dir():
        for name in COPIED:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / f".{name}.tmp")
                os.replace(out / f".{name}.tmp", out / name)
                written.append(name)
        if "tokenizer_config.json" not in written:
            _write_json(out / "tokenizer_config.json", base_config)
            written.append("tokenizer_config.json")
        return written
    shutil.copyfile(src, out / ".tokenizer.json.tmp")
    os.replace(out / ".tokenizer.json.tmp", out / "tokenizer.json")
    _write_json(out / "tokenizer_config.json", base_config)
    return ["tokenizer.json", "tokenizer_config.json"]
