"""Your own text in three commands (issue 39, item 3): ``kc data prepare PATH --out DIR`` turns one file or folder
into what a job needs.

1. a training and a held-out part (:mod:`~kuangchao_core.data.heldout_split`: the last ``--heldout`` share of each
   file's bytes, from a line start) under ``DIR/train`` and ``DIR/heldout``;
2. a byte-level BPE tokenizer of ``--vocab-size`` tokens trained on the training part only
   (:mod:`~kuangchao_core.data.bpe_train`) in ``DIR/tokenizer``;
3. both parts tokenized into the data cache, ``DIR/cache`` (:mod:`~kuangchao_core.data.cache`: memory-mapped token
   arrays every rank and later run maps instead of re-reading and re-tokenizing the files);
4. ``DIR/config.yaml``, a job config to start from: the parts, the tokenizer and the cache (absolute paths),
   ``data.txt_documents: file`` (each file one document, its bytes as written), ``model.preset`` (``--preset``, or
   by the training bytes: :data:`PRESET_BY_SIZE`) with ``model.vocab_size`` the tokenizer's, ``data.seq_len`` half
   the preset's ``max_seq_len`` unless given, and ``train.steps`` two passes over the training tokens (at most
   :data:`MAX_STEPS`), evaluating and checkpointing four times.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kuangchao_core.config.presets import MODEL_PRESETS
from kuangchao_core.data.bpe_train import train_byte_bpe
from kuangchao_core.data.cache import cached_corpus
from kuangchao_core.data.files import read_documents
from kuangchao_core.data.heldout_split import split_heldout
from kuangchao_core.data.tokenizer import HFTokenizer
from kuangchao_core.errors import DataError

#: ``(preset, training bytes from which it is chosen)``: the last one the data reaches wins. ``small`` (3 M
#: parameters) from 20 MiB, about 7 bytes of text a parameter; ``125m`` and ``1b`` at about the same bytes a
#: parameter (a tenth of Chinchilla's 20 tokens a parameter at ~4 bytes a token: enough to learn from, not compute
#: optimal); ``llama3-8b`` only by ``--preset``
PRESET_BY_SIZE = (("tiny", 0), ("small", 20 << 20), ("125m", 800 << 20), ("1b", 8 << 30))
MICRO_BATCH = 8
EPOCHS = 2
MAX_STEPS = 20000


def choose_preset(train_bytes: int) -> str:
    """The preset for this much training text (:data:`PRESET_BY_SIZE`)."""
    return [name for name, least in PRESET_BY_SIZE if train_bytes >= least][-1]


def _training_texts(train_dir: Path, fmt: str) -> Iterator[str]:
    for doc in read_documents(train_dir, fmt, txt_documents="file"):
        yield from ([doc] if isinstance(doc, str) else doc)


def _write_yaml(path: Path, header: str, body: dict[str, Any]) -> None:
    import yaml

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(header + yaml.safe_dump(body, sort_keys=False, allow_unicode=True), encoding="utf-8")
    os.replace(tmp, path)


def prepare_corpus(
    source: str | Path,
    out_dir: str | Path,
    *,
    heldout: float = 0.05,
    vocab_size: int = 4096,
    preset: str | None = None,
    seq_len: int | None = None,
    name: str = "my-text",
    fmt: str = "auto",
) -> dict[str, Any]:
    """Do the four steps of the module docstring; returns what was made (paths, sizes, the rule, the choices)."""
    if preset is not None and preset not in MODEL_PRESETS:
        raise DataError(f"--preset: unknown preset {preset!r}; use one of {sorted(MODEL_PRESETS)}")
    out = Path(out_dir).resolve()
    split = split_heldout(source, out, heldout, fmt)
    chosen = preset or choose_preset(split.train_bytes)
    max_seq_len = int(MODEL_PRESETS[chosen]["max_seq_len"])
    seq_len = int(seq_len or max_seq_len // 2)
    if not 2 <= seq_len <= max_seq_len:
        raise DataError(f"--seq-len: {seq_len} must be between 2 and the preset's max_seq_len {max_seq_len}")
    tok_dir = out / "tokenizer"
    vocab = train_byte_bpe(_training_texts(split.train_dir, fmt), vocab_size, tok_dir, max_length=max_seq_len)
    tokenizer = HFTokenizer(tok_dir)
    data = {
        "format": fmt,
        "path": str(split.train_dir),
        "eval_path": str(split.heldout_dir),
        "txt_documents": "file",
        "tokenizer": str(tok_dir),
        "seq_len": seq_len,
        "cache_dir": str(out / "cache"),
    }
    counts = {}
    for part, key in (("train", "path"), ("heldout", "eval_path")):
        _, _, meta = cached_corpus({**data, "path": data[key]}, tokenizer, vocab, data["cache_dir"])
        counts[part] = int(meta["num_tokens"])
        if counts[part] < seq_len + 1:
            raise DataError(
                f"{part} part: {counts[part]} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}; "
                "give more text, a larger --heldout or a smaller --seq-len"
            )
    steps = max(1, min(MAX_STEPS, math.ceil(EPOCHS * counts["train"] / (MICRO_BATCH * seq_len))))
    every = max(1, steps // 4)
    config = {
        "task": {"name": name, "seed": 1234},
        "model": {"preset": chosen, "vocab_size": vocab},
        "data": data,
        "parallel": {"micro_batch_size": MICRO_BATCH},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
        "train": {"steps": steps, "warmup_steps": min(100, steps // 10), "log_interval": every, "eval_interval": every},
        "checkpoint": {"interval": every, "keep_last": 2},
    }
    rule = (
        f"held-out: the last {heldout:g} of each file's bytes, from the first line starting at or after that point "
        f"({split.heldout_bytes:,} of {split.train_bytes + split.heldout_bytes:,} bytes)"
    )
    header = (
        f"# written by kc data prepare from {Path(source).resolve()}\n# {rule}\n"
        f"# model.preset {chosen}: {'--preset' if preset else 'chosen by the training bytes'}; "
        f"train.steps: {EPOCHS} passes over {counts['train']:,} training tokens\n"
    )
    config_path = out / "config.yaml"
    _write_yaml(config_path, header, config)
    return {
        "config": str(config_path),
        "rule": rule,
        "files": split.files,
        "train_bytes": split.train_bytes,
        "heldout_bytes": split.heldout_bytes,
        "tokenizer": str(tok_dir),
        "vocab_size": vocab,
        "tokens": counts,
        "preset": chosen,
        "preset_chosen_by": "flag" if preset else "size",
        "seq_len": seq_len,
        "steps": steps,
        "cache_dir": data["cache_dir"],
    }
