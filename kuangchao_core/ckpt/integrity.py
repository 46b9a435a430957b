"""Integrity checks: is a step directory a complete, untampered checkpoint?

A step directory is intact when its ``manifest.json`` exists, parses, has a format version this kuangchao reads,
names the step of its directory, lists a shard and an RNG file for every rank, every file it lists exists with the
recorded size and sha256, and (format version 2) every shard's safetensors header holds exactly the tensors, dtypes
and shapes of the manifest's ``tensor_table`` with data offsets inside the file (``ckpt.header``), and every JSON file
it lists (state, RNG) and the manifest itself parse within the limits of the bounded JSON reader
(``config.bounded_json``: size, nesting depth). Version 1 steps have no table and verify by hash and JSON only. Anything else is reported as a problem; :func:`find_latest_intact` skips
such directories and logs why.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from kuangchao_core.ckpt.header import HeaderError, read_header, table_problems
from kuangchao_core.ckpt.layout import (
    FORMAT_VERSION,
    LOGGER_NAME,
    MANIFEST,
    READ_FORMAT_VERSIONS,
    TENSOR_TABLE,
    parse_step_dir,
    rng_name,
    shard_name,
)
from kuangchao_core.ckpt.storage import LocalStorage, Storage
from kuangchao_core.config.bounded_json import (
    DEFAULT_MAX_BYTES,
    MANIFEST_MAX_BYTES,
    BoundedJSONError,
    loads_bounded,
)
from kuangchao_core.errors import CheckpointCorrupt, CheckpointError

logger = logging.getLogger(LOGGER_NAME)


def corrupt(path: str | os.PathLike[str], reason: str, hint: str | None = None) -> CheckpointCorrupt:
    """A CheckpointCorrupt naming the path and the reason, with ``.path`` and ``.reason`` attributes."""
    hint = hint or "use an older checkpoint (find_latest_intact / `kc checkpoint list`) or re-run from scratch"
    exc = CheckpointCorrupt(f"checkpoint {path} is not usable: {reason}; {hint}")
    exc.path = str(path)  # type: ignore[attr-defined]
    exc.reason = reason  # type: ignore[attr-defined]
    return exc


def locate(step_dir: str | os.PathLike[str], storage: Storage | None) -> tuple[Storage, str, str]:
    """(storage, key, display name) for a step directory given as a local path or as a key in ``storage``."""
    if storage is None:
        p = Path(step_dir)
        return LocalStorage(p.parent), p.name, str(p)
    key = Path(step_dir).as_posix()
    return storage, key, f"{storage!r}:{key}"


def _load_manifest(storage: Storage, key: str, where: str) -> dict[str, Any]:
    mkey = f"{key}/{MANIFEST}"
    if not storage.is_dir(key):
        raise corrupt(where, "step directory does not exist")
    if not storage.exists(mkey):
        raise corrupt(where, f"{MANIFEST} is missing (the save did not finish)")
    size = storage.size(mkey)
    if size > MANIFEST_MAX_BYTES:
        raise corrupt(where, f"{MANIFEST} is {size} bytes, more than the limit of {MANIFEST_MAX_BYTES}")
    try:
        manifest = loads_bounded(storage.read_bytes(mkey), max_bytes=MANIFEST_MAX_BYTES)
    except BoundedJSONError as exc:
        raise corrupt(where, f"{MANIFEST} refused: {exc.reason}") from None
    if not isinstance(manifest, dict):
        raise corrupt(where, f"{MANIFEST} is not a JSON object")
    version = manifest.get("format_version")
    if isinstance(version, bool) or version not in READ_FORMAT_VERSIONS:
        raise corrupt(
            where,
            f"format_version is {version!r}, this kuangchao reads {', '.join(map(str, READ_FORMAT_VERSIONS))} "
            f"(writes {FORMAT_VERSION})",
            "convert it with a kuangchao that knows that version, or use another checkpoint",
        )
    if not isinstance(manifest.get("files"), dict):
        raise corrupt(where, f"{MANIFEST} has no 'files' table")
    return manifest


def read_manifest(step_dir: str | os.PathLike[str], storage: Storage | None = None) -> dict[str, Any]:
    """The parsed ``manifest.json`` of ``step_dir``; raises CheckpointCorrupt if missing, unreadable or of another format."""
    st, key, where = locate(step_dir, storage)
    return _load_manifest(st, key, where)


#: written beside a step's files when the step verified but could not be loaded (shapes, dtypes, headers)
BAD_MARK = "BAD.json"


def mark_bad(step_dir: str | os.PathLike[str], reason: str) -> Path:
    """Record that ``step_dir`` could not be loaded (``BAD.json``, atomic): it no longer verifies, so recovery and
    ``find_latest_intact`` go to the previous intact step instead of failing on this one again."""
    import datetime as _dt

    path = Path(step_dir) / BAD_MARK
    tmp = path.with_name(f".{BAD_MARK}.{os.getpid()}.tmp")
    at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    tmp.write_text(json.dumps({"reason": reason[:2000], "marked_at": at}), encoding="utf-8")
    os.replace(tmp, path)
    return path


#: the largest world size a manifest may state (a larger one is a forged or corrupt manifest, not a job)
MAX_WORLD_SIZE = 1 << 16


def _bad_file_name(rel: Any) -> str | None:
    """Why a manifest's file name cannot be a file of this step (absolute, ``..``, empty parts), or None."""
    if not isinstance(rel, str) or not rel:
        return "not a file name"
    if rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in rel.split("/")):
        return "a path outside the step directory"
    return None


def _symlinks(st: Storage, key: str) -> list[str]:
    """Symbolic links inside a local step directory (the step itself included): never followed, never trusted."""
    root = st.local_path(key) if hasattr(st, "local_path") else None
    if root is None:
        return []
    found = ["the step directory itself"] if root.is_symlink() else []
    if root.is_dir() and not root.is_symlink():
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            for name in dirnames + filenames:
                full = Path(dirpath) / name
                if full.is_symlink():
                    found.append(full.relative_to(root).as_posix())
    return found


def verify_checkpoint(step_dir: str | os.PathLike[str], storage: Storage | None = None) -> list[str]:
    """Every problem found in ``step_dir`` (empty list = intact). Hashes every file listed in the manifest.

    Never raises on a malformed step: file names outside the step directory, an absurd world size and symbolic
    links (refused, never followed — a link could point at any file of the machine) are problems like any other."""
    st, key, where = locate(step_dir, storage)
    try:
        manifest = _load_manifest(st, key, where)
    except CheckpointCorrupt as exc:
        return [exc.reason]  # type: ignore[attr-defined]
    except (CheckpointError, OSError, ValueError) as exc:
        return [f"unreadable step directory ({exc})"]
    problems: list[str] = [f"{link}: is a symbolic link (refused)" for link in _symlinks(st, key)]
    if st.exists(f"{key}/{BAD_MARK}"):
        try:
            why = _read_small_json(st, f"{key}/{BAD_MARK}").get("reason", "?")
        except (OSError, ValueError, AttributeError):
            why = "unreadable mark"
        problems.append(f"marked bad after a failed load: {why}")
    dir_step = parse_step_dir(key.rsplit("/", 1)[-1])
    if dir_step is not None and manifest.get("step") != dir_step:
        problems.append(f"manifest step {manifest.get('step')!r} does not match directory step {dir_step}")
    files: dict[str, Any] = manifest["files"]
    has_table = manifest.get("format_version", 1) >= 2
    if has_table and not isinstance(manifest.get(TENSOR_TABLE), dict):
        problems.append(f"format_version {manifest['format_version']} manifest has no '{TENSOR_TABLE}' table")
        has_table = False
    world_size = manifest.get("world_size")
    if isinstance(world_size, int) and not isinstance(world_size, bool) and 1 <= world_size <= MAX_WORLD_SIZE:
        for r in range(world_size):
            for rel in (shard_name(r), rng_name(r)):
                if rel not in files:
                    problems.append(f"{rel}: not listed in the manifest (world_size {world_size})")
    else:
        problems.append(f"manifest world_size is {world_size!r}, expected an integer in [1, {MAX_WORLD_SIZE}]")
    for rel, entry in sorted(files.items(), key=lambda kv: str(kv[0])):
        why = _bad_file_name(rel)
        if why is not None:
            problems.append(f"{str(rel)[:80]!r}: {why} (refused)")
            continue
        fkey = f"{key}/{rel}"
        if not isinstance(entry, dict) or "sha256" not in entry or "size" not in entry:
            problems.append(f"{rel}: manifest entry lacks sha256/size")
            continue
        try:
            size = st.size(fkey)
        except (FileNotFoundError, NotADirectoryError):
            problems.append(f"{rel}: missing")
            continue
        except (CheckpointError, OSError) as exc:
            problems.append(f"{rel}: unreadable ({exc})")
            continue
        if size != entry["size"]:
            problems.append(f"{rel}: size {size} bytes, manifest says {entry['size']} (truncated or replaced)")
            continue
        digest = st.sha256(fkey)
        if digest != entry["sha256"]:
            problems.append(f"{rel}: sha256 {digest[:16]}… does not match the manifest ({str(entry['sha256'])[:16]}…)")
        if has_table:
            problems.extend(_header_problems(st, fkey, rel, manifest[TENSOR_TABLE]))
        if rel.endswith(".json"):
            problems.extend(_json_problems(st, fkey, rel))
    if has_table:
        problems.extend(
            f"{str(rel)[:80]!r}: in the manifest's tensor_table but not among its files"
            for rel in sorted(manifest[TENSOR_TABLE], key=str)
            if rel not in files
        )
    return problems


def _read_small_json(st: Storage, fkey: str) -> Any:
    """A JSON file of a step read with the bounded reader (raises BoundedJSONError, OSError)."""
    size = st.size(fkey)
    if size > DEFAULT_MAX_BYTES:
        raise BoundedJSONError(f"{size} bytes, more than the limit of {DEFAULT_MAX_BYTES}")
    return loads_bounded(st.read_bytes(fkey))


def _json_problems(st: Storage, fkey: str, rel: str) -> list[str]:
    """A listed JSON file (state, RNG) that the bounded reader refuses is a problem: loading it would fail."""
    try:
        _read_small_json(st, fkey)
    except BoundedJSONError as exc:
        return [f"{rel}: refused ({exc.reason})"]
    except (CheckpointError, OSError) as exc:
        return [f"{rel}: unreadable ({exc})"]
    return []


def _is_shard(rel: str) -> bool:
    return rel.startswith("shards/") and rel.endswith(".safetensors")


def _header_problems(st: Storage, fkey: str, rel: str, table: dict[str, Any]) -> list[str]:
    """Problems of one listed file against the manifest's tensor table (shards only; never raises)."""
    if not _is_shard(rel):
        return []
    if rel not in table:
        return [f"{rel}: not in the manifest's tensor_table"]
    try:
        entries = read_header(st, fkey)
    except HeaderError as exc:
        return [f"{rel}: bad safetensors header ({exc})"]
    except (CheckpointError, OSError) as exc:
        return [f"{rel}: safetensors header unreadable ({exc})"]
    return table_problems(rel, entries, table[rel])


def list_step_dirs(task_dir: str | os.PathLike[str], storage: Storage | None = None) -> list[tuple[int, str]]:
    """Published step directories of a task as (step, key in the storage), oldest first.

    Tmp and oddly named directories are left out. Without ``storage`` the keys are names inside ``task_dir``.
    """
    st, key, _ = _locate_task(task_dir, storage)
    out = []
    for name in st.list_dir(key):
        step = parse_step_dir(name)
        if step is not None and st.is_dir(_child(key, name)):
            out.append((step, _child(key, name)))
    return sorted(out)


def _locate_task(task_dir: str | os.PathLike[str], storage: Storage | None) -> tuple[Storage, str, str]:
    if storage is None:
        return LocalStorage(task_dir), "", str(task_dir)
    key = Path(task_dir).as_posix()
    return storage, key, f"{storage!r}:{key}"


def _child(base: str, name: str) -> str:
    return f"{base}/{name}" if base else name


def find_latest_intact(
    task_dir: str | os.PathLike[str],
    log: logging.Logger | None = None,
    storage: Storage | None = None,
) -> Path | None:
    """The newest step directory of ``task_dir`` that verifies, or None when there is none.

    Each newer directory that fails verification is skipped and logged (WARNING, logger ``kuangchao.ckpt``)
    with its reasons. With ``storage`` given, ``task_dir`` is a key in it and the result is a key as a Path.
    """
    log = log or logger
    st, key, where = _locate_task(task_dir, storage)
    steps = sorted(
        ((s, n) for n in st.list_dir(key) if (s := parse_step_dir(n)) is not None and st.is_dir(_child(key, n))),
        reverse=True,
    )
    for step, name in steps:
        problems = verify_checkpoint(_child(key, name), storage=st)
        if not problems:
            return Path(task_dir) / name
        log.warning(
            "skipping corrupt checkpoint %s/%s (step %d): %s",
            where,
            name,
            step,
            "; ".join(problems),
            extra={"checkpoint": f"{where}/{name}", "step": step, "problems": problems},
        )
    return None
