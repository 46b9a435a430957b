"""Reading checkpoints back: shards (safetensors), state, RNG and manifest — JSON and safetensors only, never pickle.

Every function takes a step directory (a local path, or a key when ``storage`` is given) and raises
CheckpointCorrupt naming the path and the reason when something is missing or does not match the manifest.
Tensor and state reads pass the permission guard as ``checkpoint_read`` on ``checkpoint:<task name>``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import load_file as st_load_file

from kuangchao_core import guard_api
from kuangchao_core.ckpt.integrity import corrupt, find_latest_intact, locate, read_manifest, verify_checkpoint
from kuangchao_core.ckpt.layout import (
    META_EXTRA,
    META_FORMAT,
    META_SLICES,
    STATE,
    rng_name,
    shard_name,
    task_of_step_dir,
)
from kuangchao_core.ckpt.storage import Storage
from kuangchao_core.config.bounded_json import DEFAULT_MAX_BYTES, BoundedJSONError, loads_bounded

__all__ = [
    "find_latest_intact",
    "load_shard",
    "read_manifest",
    "read_rng",
    "read_shard_extra",
    "read_shard_slices",
    "read_state",
    "verify_checkpoint",
]

_MAX_HEADER = 256 << 20


def _guard(st: Storage, key: str, where: str) -> None:
    local = st.local_path(key)
    task = task_of_step_dir(Path(local).resolve().as_posix() if local is not None else key)
    guard_api.check("checkpoint_read", f"checkpoint:{task}")


def _checked_file(st: Storage, key: str, rel: str, where: str, verify: bool) -> str:
    """Key of ``rel`` inside the step dir after checking it against the manifest (size always, sha256 if verify)."""
    manifest = read_manifest(key, storage=st)
    entry = manifest["files"].get(rel)
    if entry is None:
        raise corrupt(where, f"{rel} is not listed in the manifest (world_size {manifest.get('world_size')})")
    fkey = f"{key}/{rel}"
    if not st.exists(fkey):
        raise corrupt(where, f"{rel} is missing")
    size = st.size(fkey)
    if size != entry.get("size"):
        raise corrupt(where, f"{rel}: size {size} bytes, manifest says {entry.get('size')}")
    if verify and st.sha256(fkey) != entry.get("sha256"):
        raise corrupt(where, f"{rel}: sha256 does not match the manifest")
    return fkey


def _read_json(st: Storage, fkey: str, where: str, rel: str) -> Any:
    size = st.size(fkey)
    if size > DEFAULT_MAX_BYTES:
        raise corrupt(where, f"{rel} is {size} bytes, more than the limit of {DEFAULT_MAX_BYTES}")
    try:
        return loads_bounded(st.read_bytes(fkey))
    except BoundedJSONError as exc:
        raise corrupt(where, f"{rel} refused: {exc.reason}") from None


def load_shard(
    step_dir: str | os.PathLike[str], rank: int, storage: Storage | None = None, verify: bool = False
) -> dict[str, torch.Tensor]:
    """The tensors of ``rank``'s shard (CPU). Checks the size against the manifest, and the sha256 when ``verify``."""
    st, key, where = locate(step_dir, storage)
    _guard(st, key, where)
    rel = shard_name(rank)
    fkey = _checked_file(st, key, rel, where, verify)
    try:
        local = st.local_path(fkey)
        if local is not None:
            return st_load_file(str(local), device="cpu")
        return st_load(st.read_bytes(fkey))
    except (SafetensorError, ValueError, OSError) as exc:
        raise corrupt(where, f"{rel} is not a readable safetensors file ({exc})") from None


def read_safetensors_metadata(st: Storage, fkey: str, where: str, rel: str | None = None) -> dict[str, str]:
    """The ``__metadata__`` (string -> string) of the safetensors file at ``fkey``, read without loading tensors."""
    rel = rel or fkey
    with st.open_read(fkey) as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise corrupt(where, f"{rel} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise corrupt(where, f"{rel} declares a {n}-byte header (limit {_MAX_HEADER})")
        head = f.read(n)
    try:
        header = loads_bounded(head, max_bytes=_MAX_HEADER)
    except BoundedJSONError as exc:
        raise corrupt(where, f"{rel} has an unreadable safetensors header ({exc.reason})") from None
    if not isinstance(header, dict):
        raise corrupt(where, f"{rel}: the safetensors header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise corrupt(where, f"{rel}: safetensors __metadata__ is not an object")
    return meta


def _shard_meta(step_dir: str | os.PathLike[str], rank: int, storage: Storage | None, field: str) -> Any:
    st, key, where = locate(step_dir, storage)
    rel = shard_name(rank)
    fkey = _checked_file(st, key, rel, where, verify=False)
    meta = read_safetensors_metadata(st, fkey, where, rel)
    if META_FORMAT not in meta:
        raise corrupt(where, f"{rel} lacks the {META_FORMAT} metadata entry (not written by kuangchao)")
    try:
        return loads_bounded(meta.get(field, "null"), max_bytes=_MAX_HEADER)
    except BoundedJSONError as exc:
        raise corrupt(where, f"{rel}: metadata entry {field} refused ({exc.reason})") from None


def read_shard_slices(
    step_dir: str | os.PathLike[str], rank: int, storage: Storage | None = None
) -> dict[str, dict[str, Any]]:
    """For each tensor of ``rank``'s shard: ``{"full_shape", "offsets", "shape"}`` — which slice of which full tensor."""
    return _shard_meta(step_dir, rank, storage, META_SLICES) or {}


def read_shard_extra(step_dir: str | os.PathLike[str], rank: int, storage: Storage | None = None) -> Any:
    """The JSON value the writer stored with ``rank``'s shard (``shard_meta=`` of ``save``), or None."""
    return _shard_meta(step_dir, rank, storage, META_EXTRA)


def read_state(step_dir: str | os.PathLike[str], storage: Storage | None = None) -> dict[str, Any]:
    """The contents of ``state.json`` (step, scheduler, sampler, …)."""
    st, key, where = locate(step_dir, storage)
    _guard(st, key, where)
    fkey = _checked_file(st, key, STATE, where, verify=False)
    state = _read_json(st, fkey, where, STATE)
    if not isinstance(state, dict):
        raise corrupt(where, f"{STATE} is not a JSON object")
    return state


def read_rng(step_dir: str | os.PathLike[str], rank: int, storage: Storage | None = None) -> dict[str, Any]:
    """The RNG state saved by ``rank`` (as produced by :func:`kuangchao_core.ckpt.rng.capture_rng_state`)."""
    st, key, where = locate(step_dir, storage)
    _guard(st, key, where)
    rel = rng_name(rank)
    fkey = _checked_file(st, key, rel, where, verify=False)
    rng = _read_json(st, fkey, where, rel)
    if not isinstance(rng, dict):
        raise corrupt(where, f"{rel} is not a JSON object")
    return rng
