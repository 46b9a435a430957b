"""Tokenize once (``data.cache_dir``): a text corpus tokenized into memory-mapped arrays every rank, attempt and later
run reads instead of the raw files.

An entry is ``<cache_dir>/<key>/``: ``tokens.bin`` (int32, the packed stream), ``starts.bin`` (int64, where each
document starts) and ``meta.json``. The key is a hash of what the arrays depend on: the data format and text field,
the tokenizer (``byte``, or the bytes of its files), and every data file's path, size and modification time — a
stat, so a warm start reads no raw file; changing a file or the tokenizer gives a new entry (old ones are left for
the user to delete).

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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kuangchao_core.data.files import read_documents, resolve_files
from kuangchao_core.data.packing import pack_documents_with_starts
from kuangchao_core.errors import DataError

LOCK_STALE_S = 1800.0
WAIT_S = 3600.0
FORMAT_VERSION = 1


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


def cache_key(path: str, fmt: str, text_field: str, tokenizer_spec: str) -> tuple[str, dict[str, Any]]:
    """The entry's key and what it was computed from (stored in ``meta.json``)."""
    files = []
    for f, kind in resolve_files(path, fmt):
        st = f.stat()
        files.append([str(f.resolve()), kind, st.st_size, st.st_mtime_ns])
    what = {
        "version": FORMAT_VERSION,
        "format": fmt,
        "text_field": text_field,
        "tokenizer": _tokenizer_identity(tokenizer_spec),
        "files": files,
    }
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]
    return key, what


def _write_entry(target: Path, tokens: torch.Tensor, starts: np.ndarray, meta: dict[str, Any]) -> None:
    staging = target.parent / f"{target.name}.build-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tokens.numpy().astype(np.int32, copy=False).tofile(staging / "tokens.bin")
    starts.astype(np.int64, copy=False).tofile(staging / "starts.bin")
    (staging / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    os.replace(staging, target)  # the entry appears whole, with meta.json, or not at all


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


def _read_entry(entry: Path, vocab_size: int | None) -> tuple[torch.Tensor, np.ndarray, dict[str, Any]]:
    meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    n = int(meta["num_tokens"])
    if vocab_size is not None and int(meta["max_token"]) >= vocab_size:
        raise DataError(
            f"token id {meta['max_token']} in the cached corpus {entry} is outside model.vocab_size {vocab_size}; "
            "use a tokenizer that fits the model or raise model.vocab_size"
        )
    docs = int(meta["num_documents"])
    tokens = np.memmap(entry / "tokens.bin", dtype=np.int32, mode="c", shape=(n,)) if n else np.zeros(0, np.int32)
    starts = np.memmap(entry / "starts.bin", dtype=np.int64, mode="r", shape=(docs,)) if docs else np.zeros(0, np.int64)
    return torch.from_numpy(tokens), starts, meta


def cached_corpus(
    data_cfg: Any, tokenizer: Any, vocab_size: int | None, cache_dir: str
) -> tuple[torch.Tensor, np.ndarray, dict[str, Any]]:
    """The packed stream and document starts of the ``data`` section's files, from the cache (built on a miss);
    returns ``(tokens, starts, meta)`` — ``meta["built"]`` says whether this call built the entry."""
    from kuangchao_core.config.access import setting

    path, fmt = str(setting(data_cfg, "path")), setting(data_cfg, "format", "auto")
    text_field, spec = setting(data_cfg, "text_field", "text"), setting(data_cfg, "tokenizer", "byte")
    key, what = cache_key(path, fmt, text_field, spec)
    root = Path(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    entry, lock = root / key, root / f"{key}.lock"
    deadline = time.monotonic() + WAIT_S
    while not (entry / "meta.json").is_file():
        if _take_lock(lock):
            try:
                if not (entry / "meta.json").is_file():
                    t0 = time.perf_counter()
                    tokens, starts = pack_documents_with_starts(read_documents(path, fmt, text_field), tokenizer)
                    meta = {
                        **what,
                        "key": key,
                        "num_tokens": int(tokens.numel()),
                        "num_documents": len(starts),
                        "max_token": int(tokens.max()) if tokens.numel() else -1,
                        "build_seconds": round(time.perf_counter() - t0, 3),
                    }
                    _write_entry(entry, tokens, starts, meta)
                    out = _read_entry(entry, vocab_size)
                    return out[0], out[1], {**out[2], "built": True}
            finally:
                lock.unlink(missing_ok=True)
        if time.monotonic() > deadline:
            raise DataError(f"data.cache_dir: waited {WAIT_S:.0f} s for {entry} to be built by another process")
        time.sleep(0.2)
    tokens, starts, meta = _read_entry(entry, vocab_size)
    return tokens, starts, {**meta, "built": False}
