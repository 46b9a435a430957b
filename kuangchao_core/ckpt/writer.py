"""Atomic multi-rank checkpoint writes.

Protocol of :meth:`CheckpointWriter.save` (every rank calls it with the same ``step``):

1. rank 0 creates ``<task>/step_<N>.tmp-<nonce>/`` (removing a leftover of the same name first); barrier.
2. every rank writes ``shards/rank_<r>.safetensors`` and ``rng/rank_<r>.json``; rank 0 also ``state.json``.
   Each file goes to a temporary name, is flushed and fsynced, then renamed. Barrier.
3. rank 0 hashes every file (sha256 + size), reads every shard's safetensors header into the manifest's
   ``tensor_table`` (per tensor its dtype and shape), writes ``manifest.json`` (temp, fsync, rename) last, fsyncs the
   directories, renames ``step_<N>.tmp-<nonce>`` to ``step_<N>`` and fsyncs the task directory. Barrier.
4. rank 0 applies retention when ``keep_last`` was given.

**The nonce** is the writer's ``attempt_id``, so every rank derives the same tmp name without talking: pass it
explicitly, or it is taken from ``KC_CKPT_ATTEMPT``, else from torchrun's ``TORCHELASTIC_RUN_ID`` and
``TORCHELASTIC_RESTART_COUNT``, else ``"0"``. It works across processes and across nodes sharing the
directory. A tmp dir left by a crashed attempt either has another nonce (and is removed by retention once a newer
checkpoint is intact) or the same one (and rank 0 clears it in step 1).

**An existing final ``step_<N>``** is never overwritten: an intact one is another writer's step and the save fails;
a corrupt one (for example after resuming from an older step) is, with ``on_existing="move_aside"`` (default),
renamed to ``step_<N>.replaced-<time>`` (kept, ignored by discovery and retention) with a warning; with
``on_existing="error"`` the save fails.

**One writer per lineage**: a writer started with a lineage ``generation`` (from ``KC_CKPT_LINEAGE_GENERATION``,
set by the flow that holds the lineage's lease, see ``ckpt.lineage_lease``) checks the lease before it opens,
publishes or prunes a step, and is refused (:class:`~kuangchao_core.ckpt.lineage_lease.StaleWriter`) once another
generation holds the lineage.

A crash at any point leaves no ``step_<N>`` for the new step (only a tmp dir), and older checkpoints untouched.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kuangchao_core import __version__, guard_api
from kuangchao_core.ckpt.header import HeaderError, read_header, tensor_table
from kuangchao_core.ckpt.layout import (
    FORMAT_VERSION,
    LOGGER_NAME,
    MANIFEST,
    META_EXTRA,
    META_FORMAT,
    META_SLICES,
    STATE,
    TENSOR_TABLE,
    rng_name,
    shard_name,
    step_dir_name,
    tmp_dir_name,
)
from kuangchao_core.ckpt.lineage_lease import ENV_GENERATION, check_writer
from kuangchao_core.ckpt.storage import DiskFull, LocalStorage, Storage
from kuangchao_core.errors import CheckpointError

logger = logging.getLogger(LOGGER_NAME)

_RESERVED = {
    "format_version",
    "step",
    "kuangchao_version",
    "created_at",
    "world_size",
    "files",
    "tensors",
    TENSOR_TABLE,
}


def default_attempt_id() -> str:
    """The attempt id every rank of this launch agrees on (see the module docstring)."""
    if os.environ.get("KC_CKPT_ATTEMPT"):
        return os.environ["KC_CKPT_ATTEMPT"]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return f"{run_id}-r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return "0"


def _sanitize(nonce: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9_.-]", "_", nonce)[:64]
    return clean or "0"


def normalize_slice(key: str, tensor: torch.Tensor, spec: Mapping[str, Any] | None) -> dict[str, Any]:
    """Slice metadata of ``tensor`` as ``{"full_shape", "offsets", "shape"}``; None means the whole tensor.

    ``spec`` gives ``full_shape`` and either ``offsets`` (start per dim) or ``ranges`` ([start, stop] per dim).
    """
    shape = list(tensor.shape)
    if spec is None:
        return {"full_shape": shape, "offsets": [0] * len(shape), "shape": shape}
    full = [int(x) for x in spec.get("full_shape", shape)]
    if "ranges" in spec:
        ranges = [(int(a), int(b)) for a, b in spec["ranges"]]
        offsets = [a for a, _ in ranges]
        if [b - a for a, b in ranges] != shape:
            raise CheckpointError(f"slice of {key}: ranges {ranges} do not match the tensor shape {shape}")
    else:
        offsets = [int(x) for x in spec.get("offsets", [0] * len(shape))]
    if not (len(full) == len(offsets) == len(shape)):
        raise CheckpointError(
            f"slice of {key}: full_shape {full}, offsets {offsets} and tensor shape {shape} differ in rank"
        )
    for d, (f, o, s) in enumerate(zip(full, offsets, shape, strict=True)):
        if o < 0 or o + s > f:
            raise CheckpointError(f"slice of {key}: dim {d} covers [{o}, {o + s}) outside the full size {f}")
    return {"full_shape": full, "offsets": offsets, "shape": shape}


def _prepare_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, detached tensors with no shared storage (safetensors refuses aliases, e.g. tied weights)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, t in tensors.items():
        if not isinstance(key, str) or not key:
            raise CheckpointError(f"checkpoint tensor names must be non-empty strings, got {key!r}")
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"checkpoint tensor {key!r} is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        if t.numel() and ident in seen:
            t = t.clone()
        seen.add(ident)
        out[key] = t
    return out


def _json_bytes(obj: Any, what: str) -> bytes:
    try:
        return json.dumps(obj, indent=1, sort_keys=True, allow_nan=True).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{what} is not JSON-serialisable ({exc}); pass only dicts, lists, str, numbers"
        ) from None


def _slices_from_header(st: Storage, key: str) -> dict[str, Any]:
    from kuangchao_core.ckpt.reader import read_safetensors_metadata

    return json.loads(read_safetensors_metadata(st, key, key).get(META_SLICES, "{}"))


def _table_from_header(st: Storage, key: str) -> dict[str, Any]:
    """The dtype and shape of every tensor of the shard at ``key``, as its safetensors header states them."""
    try:
        return tensor_table(read_header(st, key))
    except HeaderError as exc:
        raise CheckpointError(f"{key}: the shard just written has an unreadable safetensors header ({exc})") from None


@dataclass
class SavePlan:
    """One rank's checkpoint of one step, encoded and ready to be written (see :meth:`CheckpointWriter.save`)."""

    step: int
    task: str
    tmp_key: str
    final_key: str
    tensors: dict[str, torch.Tensor]
    header: dict[str, str]
    rng_bytes: bytes
    state_bytes: bytes | None
    meta: dict[str, Any]


class CheckpointWriter:
    """Writes ``<root_dir>/<task_name>/step_<N>/`` collectively from ``world_size`` ranks (see module docstring).

    ``barrier`` must block until every rank has called it (e.g. ``torch.distributed.barrier``; a no-op for one
    rank). ``storage`` defaults to ``LocalStorage(root_dir)``; with another storage, ``root_dir`` is only used
    for messages.
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        task_name: str,
        rank: int,
        world_size: int,
        barrier: Callable[[], None],
        storage: Storage | None = None,
        attempt_id: str | None = None,
        keep_last: int | None = None,
        on_existing: str = "move_aside",
        lineage: str | None = None,
        generation: int | None = None,
    ):
        if not task_name or "/" in task_name or task_name in (".", ".."):
            raise CheckpointError(f"task name {task_name!r} cannot name a checkpoint directory; set task.name")
        if not 0 <= rank < world_size:
            raise CheckpointError(f"rank {rank} is outside world_size {world_size}")
        if on_existing not in ("move_aside", "error"):
            raise CheckpointError(f"on_existing must be 'move_aside' or 'error', got {on_existing!r}")
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
        self.root_dir = Path(root_dir)
        self.task_name = task_name
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.storage = storage if storage is not None else LocalStorage(root_dir)
        self.nonce = _sanitize(attempt_id if attempt_id is not None else default_attempt_id())
        self.keep_last = keep_last
        self.on_existing = on_existing
        self.lineage = lineage
        if generation is None and os.environ.get(ENV_GENERATION):
            generation = int(os.environ[ENV_GENERATION])
        self.generation = generation

    @property
    def task_dir(self) -> Path:
        """Where step directories go: ``<root_dir>/<task_name>/<lineage>`` (``<root_dir>/<task_name>`` without one)."""
        base = self.root_dir / self.task_name
        return base / self.lineage if self.lineage else base

    def save(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        rng_state: Mapping[str, Any],
        state: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        slices: Mapping[str, Mapping[str, Any]] | None = None,
        shard_meta: Any = None,
    ) -> Path:
        """Write this rank's part of checkpoint ``step``; collective. Returns the final step directory.

        ``tensors``: this rank's tensors (``param.<name>``, ``optim.<name>.<key>``). ``rng_state``: JSON dict
        (see ``ckpt.rng``). ``state``: JSON dict, used on rank 0 only. ``meta``: ``{"model": …, "parallel": …}``
        plus any other JSON keys for the manifest (rank 0's is used). ``slices``: per tensor name the slice of
        the full tensor it holds (``full_shape`` + ``offsets`` or ``ranges``); tensors not named hold the whole
        tensor. ``shard_meta``: any JSON value stored in this rank's shard header (read with ``read_shard_extra``).
        """
        plan = self.plan_save(step, tensors, rng_state, state, meta, slices, shard_meta)
        self.open_step(plan)
        self.barrier()
        try:
            self.write_files(plan)
            self.barrier()
            if self.rank == 0:
                self._commit(plan.step, plan.tmp_key, plan.final_key, plan.meta)
        except DiskFull:
            self.abandon(plan)
            raise
        self.barrier()
        if not self.storage.exists(plan.final_key):
            raise CheckpointError(
                f"checkpoint {self.task_dir / step_dir_name(plan.step)} was not published by rank 0; see rank 0's log"
            )
        self.retain(plan)
        return self.task_dir / step_dir_name(plan.step)

    # the phases of a save (``ckpt.async_save`` runs the last ones in the background)
    def plan_save(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        rng_state: Mapping[str, Any],
        state: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        slices: Mapping[str, Mapping[str, Any]] | None = None,
        shard_meta: Any = None,
        *,
        copy: bool = False,
    ) -> SavePlan:
        """Validate and encode everything before any collective (a bad argument fails here rather than in a peer's
        barrier). ``copy``: snapshot the tensors (their own memory), so training may change the originals."""
        guard_api.check("checkpoint_write", f"checkpoint:{self.task_name}")
        step = int(step)
        task = f"{self.task_name}/{self.lineage}" if self.lineage else self.task_name
        prepared = _prepare_tensors(tensors)
        if copy:
            prepared = {k: t.clone() for k, t in prepared.items()}
        slices = dict(slices or {})
        unknown = sorted(set(slices) - set(prepared))
        if unknown:
            raise CheckpointError(f"slices given for tensors not being saved: {unknown[:5]}")
        slice_meta = {k: normalize_slice(k, t, slices.get(k)) for k, t in prepared.items()}
        header = {
            META_FORMAT: str(FORMAT_VERSION),
            META_SLICES: json.dumps(slice_meta, sort_keys=True),
            META_EXTRA: _json_bytes(shard_meta, "shard_meta").decode("utf-8"),
        }
        rng_bytes = _json_bytes(dict(rng_state), f"rng_state of rank {self.rank}")
        state_bytes = None
        meta = dict(meta or {})
        if self.rank == 0:
            full_state = {"step": step, **dict(state or {})}
            if full_state["step"] != step:
                raise CheckpointError(f"state['step'] is {full_state['step']} but save() was called for step {step}")
            state_bytes = _json_bytes(full_state, "state")
            clash = sorted(set(meta) & _RESERVED)
            if clash:
                raise CheckpointError(f"meta keys {clash} are reserved for the manifest; rename them")
            _json_bytes(meta, "meta")
        return SavePlan(
            step,
            task,
            f"{task}/{tmp_dir_name(step, self.nonce)}",
            f"{task}/{step_dir_name(step)}",
            prepared,
            header,
            rng_bytes,
            state_bytes,
            meta,
        )

    def check_lease(self, what: str) -> None:
        """Raise ``StaleWriter`` when this writer's lineage generation no longer holds the lineage (no check for a
        writer without a lineage generation, or on storage without a local path)."""
        if self.generation is None or not self.lineage:
            return
        local = self.storage.local_path(f"{self.task_name}/{self.lineage}")
        if local is not None:
            check_writer(local, self.generation, what)

    def open_step(self, plan: SavePlan) -> None:
        """Rank 0 creates the step's temporary directory (follow with a barrier)."""
        st = self.storage
        if self.rank == 0:
            self.check_lease(f"writing {step_dir_name(plan.step)}")
            if st.exists(plan.tmp_key):
                logger.warning("removing leftover %s from an earlier attempt", plan.tmp_key)
                st.remove_tree(plan.tmp_key)
            st.make_dir(f"{plan.tmp_key}/shards")
            st.make_dir(f"{plan.tmp_key}/rng")

    def write_files(self, plan: SavePlan) -> None:
        """Write this rank's shard, RNG state and (rank 0) training state into the temporary directory."""
        st = self.storage
        header = plan.header
        st.write_with(
            f"{plan.tmp_key}/{shard_name(self.rank)}", lambda p: save_file(plan.tensors, str(p), metadata=header)
        )
        st.write_bytes(f"{plan.tmp_key}/{rng_name(self.rank)}", plan.rng_bytes)
        if plan.state_bytes is not None:
            st.write_bytes(f"{plan.tmp_key}/{STATE}", plan.state_bytes)

    def abandon(self, plan: SavePlan) -> None:
        """Remove the step's temporary directory after a failed write (best effort: the disk may be full)."""
        try:
            if self.storage.exists(plan.tmp_key):
                self.storage.remove_tree(plan.tmp_key)
                logger.warning("removed the unfinished %s", plan.tmp_key)
        except (OSError, CheckpointError) as exc:
            logger.warning("could not remove the unfinished %s: %s", plan.tmp_key, exc)

    def commit(self, plan: SavePlan) -> None:
        """Rank 0: verify every rank's files are there, write the manifest, publish the step (atomic rename)."""
        self._commit(plan.step, plan.tmp_key, plan.final_key, plan.meta)

    def retain(self, plan: SavePlan) -> None:
        """Rank 0: apply ``keep_last`` to the lineage, never touching the step just written."""
        if self.rank == 0 and self.keep_last:
            from kuangchao_core.ckpt.retention import apply_retention

            self.check_lease("retention")

            apply_retention(plan.task, self.keep_last, storage=self.storage, protect=step_dir_name(plan.step))

    def _commit(self, step: int, tmp_key: str, final_key: str, meta: Mapping[str, Any]) -> None:
        st = self.storage
        files: dict[str, dict[str, Any]] = {}
        for rel in st.list_files(tmp_key):
            if rel == MANIFEST or rel.rsplit("/", 1)[-1].startswith("."):
                continue
            fkey = f"{tmp_key}/{rel}"
            files[rel] = {"sha256": st.sha256(fkey), "size": st.size(fkey)}
        missing = [
            rel for r in range(self.world_size) for rel in (shard_name(r), rng_name(r), *([STATE] if r == 0 else []))
        ]
        missing = [rel for rel in missing if rel not in files]
        if missing:
            raise CheckpointError(f"step {step}: files missing after every rank reported done: {missing}")
        tensors_meta = {
            shard_name(r): _slices_from_header(st, f"{tmp_key}/{shard_name(r)}") for r in range(self.world_size)
        }
        table = {shard_name(r): _table_from_header(st, f"{tmp_key}/{shard_name(r)}") for r in range(self.world_size)}
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "kuangchao_version": __version__,
            "torch_version": torch.__version__,
            "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "model": meta.get("model"),
            "parallel": meta.get("parallel"),
            "world_size": self.world_size,
            **{k: v for k, v in meta.items() if k not in ("model", "parallel")},
            "files": files,
            "tensors": tensors_meta,
            TENSOR_TABLE: table,
        }
        st.write_bytes(f"{tmp_key}/{MANIFEST}", _json_bytes(manifest, "manifest"))
        for sub in ("shards", "rng", ""):
            st.sync_dir(f"{tmp_key}/{sub}".rstrip("/"))
        self.check_lease(f"publishing {step_dir_name(step)}")
        if st.exists(final_key):
            from kuangchao_core.ckpt.integrity import verify_checkpoint

            if self.on_existing == "error":
                raise CheckpointError(
                    f"{self.task_dir / step_dir_name(step)} already exists; remove it or use on_existing='move_aside'"
                )
            if not verify_checkpoint(final_key, storage=st):
                raise CheckpointError(
                    f"{self.task_dir / step_dir_name(step)} already exists and is intact: another writer published "
                    f"it; this writer's step {step} is refused (its files stay in {tmp_key})"
                )
            aside = f"{final_key}.replaced-{time.strftime('%Y%m%dT%H%M%S')}-{self.nonce}"
            logger.warning("checkpoint %s already exists; moving it to %s", final_key, aside)
            st.rename_dir(final_key, aside)
        st.rename_dir(tmp_key, final_key)
        st.sync_dir(self.task_name)
