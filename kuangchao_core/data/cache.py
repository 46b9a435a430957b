"""Tokenize once (``data.cache_dir``): a corpus tokenized into memory-mapped arrays every rank, attempt and later run
reads instead of the raw files.

An entry is ``<cache_dir>/<key>/``: one ``<name>.bin`` file per array and ``meta.json`` (each array's dtype and length,
and what the entry was built from). Text files (txt, jsonl, parquet) give ``tokens`` (int32, the packed stream) and
``starts`` (int64, where each document starts); instruction records (``data.format: sft``) give ``ids`` (int32, the
examples end to end), ``trained`` (bool, whether the loss is taken on each token), ``starts`` (int64, where each
example starts) and the build's report in ``meta.json``. The key is a hash of what the arrays depend on: the data
format, text field and ``.txt`` document rule (``data.txt_documents``), the tokenizer (``byte``, or the bytes of its
files — a chat template included), every data file's path, size and modification time — a stat, so a warm start
reads no raw file — and, for sft records, ``seq_len`` and ``truncation`` (they decide which examples are kept).
A text entry is written as it is tokenized, piece by piece: building it holds one piece of text and its tokens in
memory, never the corpus, so a corpus larger than memory is cached and then streamed from the map.
Changing a file or the tokenizer gives a new entry (old ones are left for the user to delete).

The first rank to miss an entry takes ``<key>.lock`` (created exclusively) and builds it in a private directory that
is renamed into place when complete, so a reader never sees half an entry; the other ranks wait for ``meta.json``. A
lock older than ``LOCK_STALE_S`` (a builder that died) is taken over. Readers map the arrays copy-on-write: each rank
holds only the pages it touches, whatever the corpus size, and the page cache is shared between ranks.
``kc data prepare CONFIG`` builds the entry before a job.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kuangchao_core.data.files import read_documents, resolve_files
from kuangchao_core.data.packing import write_packed_stream
from kuangchao_core.data.sft import build_examples, iter_sft_records
from kuangchao_core.errors import DataError

LOCK_STALE_S = 1800.0
WAIT_S = 3600.0
FORMAT_VERSION = 2


def _tokenizer_identity(spec: str) -> str:
    if spec in (None, "", "byte"):
        return "byte"
    path = Path(spec)
    files = [path / "tokenizer.json", path / "tokenizer_config.json"] if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return "sha256:" + h.hexdigest()


def cache_key(path: str, fmt: str, text_field: str, tokenizer_spec: str, **more: Any) -> tuple[str, dict[str, Any]]:
    """The entry's key and what it was computed from (stored in ``meta.json``); ``more`` adds settings the arrays
    depend on (sft: ``seq_len``, ``truncation``)."""
    files = []
    for f, kind in resolve_files(path, "auto" if fmt == "sft" else fmt):
        st = f.stat()
        files.append([str(f.resolve()), kind, st.st_size, st.st_mtime_ns])
    what = {
        "version": FORMAT_VERSION,
        "format": fmt,
        "text_field": text_field,
        "tokenizer": _tokenizer_identity(tokenizer_spec),
        "files": files,
        **more,
    }
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]
    return key, what


def _save_arrays(staging: Path, arrays: dict[str, np.ndarray]) -> dict[str, list]:
    """Write in-memory ``arrays`` into an entry being built; each one's ``[dtype, length]``."""
    for name, a in arrays.items():
        a.tofile(staging / f"{name}.bin")
    return {name: [a.dtype.name, int(a.size)] for name, a in arrays.items()}


def _write_entry(target: Path, build: Callable[[Path], tuple[dict, dict]], meta: dict[str, Any]) -> None:
    """Build the entry in a private directory (``build(staging)`` writes the arrays' files and returns each one's
    ``[dtype, length]`` and extra meta) and rename it into place: it appears whole, with meta.json, or not at all."""
    staging = target.parent / f"{target.name}.build-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    t0 = time.perf_counter()
    shapes, extra = build(staging)
    meta = {**meta, **extra, "build_seconds": round(time.perf_counter() - t0, 3), "arrays": shapes}
    (staging / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    os.replace(staging, target)


def _take_lock(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            if time.time() - lock.stat().st_mtime > LOCK_STALE_S:
                lock.unlink(missing_ok=True)  # its builder died; the next try takes it
        except FileNotFoundError:
            pass
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def _read_entry(entry: Path, vocab_size: int | None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    if vocab_size is not None and int(meta["max_token"]) >= vocab_size:
        raise DataError(
            f"token id {meta['max_token']} in the cached corpus {entry} is outside model.vocab_size {vocab_size}; "
            "use a tokenizer that fits the model or raise model.vocab_size"
        )
    arrays = {}
    for name, (dtype, n) in meta["arrays"].items():
        arrays[name] = (
            np.memmap(entry / f"{name}.bin", dtype=np.dtype(dtype), mode="c", shape=(n,)) if n else np.zeros(0, dtype)
        )
    return arrays, meta


def _entry(
    root: Path, key: str, what: dict[str, Any], vocab_size: int | None, build: Callable[[Path], tuple[dict, dict]]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays of entry ``key`` under ``root``, built by ``build(staging)`` (:func:`_write_entry`) by whichever
    process takes the lock first; ``meta["built"]`` says whether this call built it."""
    root.mkdir(parents=True, exist_ok=True)
    entry, lock = root / key, root / f"{key}.lock"
    deadline = time.monotonic() + WAIT_S
    while not (entry / "meta.json").is_file():
        if _take_lock(lock):
            try:
                if not (entry / "meta.json").is_file():
                    _write_entry(entry, build, {**what, "key": key})
                    out, meta = _read_entry(entry, vocab_size)
                    return out, {**meta, "built": True}
            finally:
                lock.unlink(missing_ok=True)
        if time.monotonic() > deadline:
            raise DataError(f"data.cache_dir: waited {WAIT_S:.0f} s for {entry} to be built by another process")
        time.sleep(0.2)
    out, meta = _read_entry(entry, vocab_size)
    return out, {**meta, "built": False}


def cached_corpus(
    data_cfg: Any, tokenizer: Any, vocab_size: int | None, cache_dir: str
) -> tuple[torch.Tensor, np.ndarray, dict[str, Any]]:
    """The packed stream and document starts of the ``data`` section's text files, from the cache (built on a miss);
    returns ``(tokens, starts, meta)`` — ``meta["built"]`` says whether this call built the entry."""
    from kuangchao_core.config.access import setting

    path, fmt = str(setting(data_cfg, "path")), setting(data_cfg, "format", "auto")
    text_field, spec = setting(data_cfg, "text_field", "text"), setting(data_cfg, "tokenizer", "byte")
    txt_documents = setting(data_cfg, "txt_documents", "file")
    key, what = cache_key(path, fmt, text_field, spec, txt_documents=txt_documents)

    def build(staging: Path) -> tuple[dict, dict]:
        docs = read_documents(path, fmt, text_field, txt_documents=txt_documents)
        with open(staging / "tokens.bin", "wb") as tokens, open(staging / "starts.bin", "wb") as starts:
            n_tokens, n_docs, max_token = write_packed_stream(docs, tokenizer, tokens, starts)
        shapes = {"tokens": ["int32", n_tokens], "starts": ["int64", n_docs]}
        return shapes, {"num_tokens": n_tokens, "num_documents": n_docs, "max_token": max_token}

    arrays, meta = _entry(Path(cache_dir), key, what, vocab_size, build)
    return torch.from_numpy(arrays["tokens"]), arrays["starts"], meta


def cached_sft(
    data_cfg: Any, tokenizer: Any, vocab_size: int | None, cache_dir: str
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The encoded instruction examples of the ``data`` section's sft records, from the cache (built on a miss):
    arrays ``ids``, ``trained`` and ``starts`` and the meta, whose ``report`` is the build's
    :class:`~kuangchao_core.data.sft.SFTReport` as a dict."""
    from kuangchao_core.config.access import setting

    path = str(setting(data_cfg, "path"))
    spec, seq_len = setting(data_cfg, "tokenizer", "byte"), int(setting(data_cfg, "seq_len", 0))
    truncation = setting(data_cfg, "truncation", "drop")
    key, what = cache_key(path, "sft", "", spec, seq_len=seq_len, truncation=truncation)

    def build(staging: Path) -> tuple[dict, dict]:
        examples, report = build_examples(iter_sft_records(path), tokenizer, seq_len, truncation)
        lengths = np.fromiter((len(ex.ids) for ex in examples), dtype=np.int64, count=len(examples))
        arrays = {
            "ids": np.fromiter((t for ex in examples for t in ex.ids), dtype=np.int32, count=int(lengths.sum())),
            "trained": np.fromiter(
                (t for ex in examples for t in ex.trained), dtype=np.bool_, count=int(lengths.sum())
            ),
            "starts": np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64),
        }
        return _save_arrays(staging, arrays), {**_counts(arrays["ids"], len(examples)), "report": report.to_dict()}

    return _entry(Path(cache_dir), key, what, vocab_size, build)


def _counts(tokens: np.ndarray, documents: int) -> dict[str, int]:
    return {
        "num_tokens": int(tokens.size),
        "num_documents": int(documents),
        "max_token": int(tokens.max()) if tokens.size else -1,
    }
