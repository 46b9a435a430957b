"""The index of a step directory: which shard holds which slice; assemble full tensors or read one layout's slices.

Every shard records, per tensor, which rectangular slice of which full tensor it holds (``kuangchao.slices``;
the manifest repeats the table under ``"tensors"``): ``{"full_shape", "offsets", "shape"}``. Two kinds of slices
are understood:

- **N-D slices** of the full tensor (``full_shape`` = the tensor's shape): TP shards, PP ownership (whole
  tensors on some ranks), replicas (DP ranks holding the same slice; one is read).
- **Flat ranges** (ZeRO): 1-D slices of the *flattened* full tensor, ``full_shape == [numel]`` while the
  parameter (``param.<name>``, or ``model_shapes``) is N-D. They are reshaped to the parameter's shape when read.
  ZeRO ranges of a TP-sharded parameter cannot be described this way: write such optimizer state as N-D TP
  slices (gather the ZeRO ranges inside the DP group first, e.g. ``ZeroOptimizer.full_state_dict``).

Each full tensor must be covered exactly once (replicas aside); :class:`CheckpointIndex` checks this and raises
CheckpointCorrupt naming the uncovered or doubly covered region.

Engine use (one rank, new layout)::

    layout = TargetLayout(tp=2, pp=2, tp_rank=mesh.tp_rank, pp_rank=mesh.pp_rank, virtual=1)
    wanted = layout.param_slices(model_cfg)                   # HF name -> Region, only what this rank holds
    params = load_for_layout(step_dir, param_keys(wanted))    # "param.<name>" -> tensor of the local shape
    optim = load_optimizer_for_layout(step_dir, wanted)       # "optim.<name>.<key>" -> tensor (local shape)

Reads use ``safetensors.safe_open(...).get_slice`` so a rank never materialises tensors it does not hold.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kuangchao_core import guard_api
from kuangchao_core.ckpt.integrity import corrupt, read_manifest
from kuangchao_core.ckpt.layout import shard_name, task_of_step_dir
from kuangchao_core.errors import CheckpointError
from kuangchao_core.models.layout import Region

__all__ = [
    "CheckpointIndex",
    "load_for_layout",
    "load_full_tensors",
    "load_optimizer_for_layout",
    "model_config_of_checkpoint",
    "param_keys",
]

PARAM = "param."
OPTIM = "optim."


@dataclass
class _Piece:
    rank: int
    region: Region


@dataclass
class CheckpointIndex:
    """Where every tensor of a step directory lives: ``pieces[key]`` = the shards (rank, region) holding it.

    Built from the manifest's ``"tensors"`` table; replicas (identical regions on several ranks) are kept once.
    ``flat_shapes[key]`` is the N-D shape of a tensor stored as flat (ZeRO) ranges.
    """

    step_dir: Path
    manifest: dict[str, Any]
    pieces: dict[str, list[_Piece]] = field(default_factory=dict)
    flat_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _dtypes: dict[str, str] = field(default_factory=dict)
    _handles: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def open(
        cls, step_dir: str | os.PathLike[str], model_shapes: Mapping[str, Iterable[int]] | None = None
    ) -> CheckpointIndex:
        """Index ``step_dir`` (a local step directory) and check coverage of every tensor.

        ``model_shapes`` (HF name -> shape) tells the N-D shape of flat optimizer ranges when the checkpoint holds
        no ``param.<name>`` for a parameter; normally the parameters' own slice metadata supplies it.
        """
        step_dir = Path(step_dir)
        manifest = read_manifest(step_dir)
        guard_api.check("checkpoint_read", f"checkpoint:{task_of_step_dir(step_dir.resolve().as_posix())}")
        table = manifest.get("tensors")
        world = manifest.get("world_size")
        if not isinstance(table, dict) or not isinstance(world, int):
            raise corrupt(step_dir, "manifest has no 'tensors' slice table or no world_size")
        index = cls(step_dir, manifest)
        for rank in range(world):
            entries = table.get(shard_name(rank))
            if entries is None:
                raise corrupt(step_dir, f"manifest 'tensors' lacks {shard_name(rank)} (world_size {world})")
            for key, meta in entries.items():
                try:
                    region = Region.from_meta(meta)
                except (KeyError, TypeError) as exc:
                    raise corrupt(
                        step_dir, f"{shard_name(rank)}: slice metadata of {key} is malformed ({exc})"
                    ) from None
                pieces = index.pieces.setdefault(key, [])
                if pieces and pieces[0].region.full_shape != region.full_shape:
                    raise corrupt(
                        step_dir,
                        f"{key}: {shard_name(rank)} says full shape {list(region.full_shape)}, "
                        f"{shard_name(pieces[0].rank)} says {list(pieces[0].region.full_shape)}",
                    )
                if not any(p.region == region for p in pieces):
                    pieces.append(_Piece(rank, region))
        index._find_flat(dict(model_shapes or {}))
        for key in index.pieces:
            index._check_coverage(key)
        return index

    def _find_flat(self, model_shapes: dict[str, Iterable[int]]) -> None:
        shapes = {n: tuple(int(x) for x in s) for n, s in model_shapes.items()}
        for key, pieces in self.pieces.items():
            if key.startswith(PARAM):
                shapes.setdefault(key[len(PARAM) :], pieces[0].region.full_shape)
        for key, pieces in self.pieces.items():
            if not key.startswith(OPTIM):
                continue
            name = key[len(OPTIM) :].rsplit(".", 1)[0]
            full = pieces[0].region.full_shape
            shape = shapes.get(name)
            if shape is None or tuple(full) == shape or len(full) != 1:
                continue
            if math.prod(shape) != full[0]:
                raise CheckpointError(
                    f"{self.step_dir}: {key} is a flat range over {full[0]} elements but parameter {name} has shape "
                    f"{list(shape)} ({math.prod(shape)} elements); ZeRO ranges of a TP-sharded parameter must be "
                    "gathered in the DP group and saved with TP slice metadata"
                )
            self.flat_shapes[key] = shape

    def _check_coverage(self, key: str) -> None:
        pieces = self.pieces[key]
        full = pieces[0].region.full_shape
        # split every dim at every piece boundary; each grid cell must be covered exactly once
        cuts = []
        for d, size in enumerate(full):
            points = {0, size}
            for p in pieces:
                points.update((p.region.offsets[d], p.region.offsets[d] + p.region.shape[d]))
            cuts.append(sorted(points))
        if sum(p.region.numel for p in pieces) == math.prod(full) and len(pieces) == 1:
            return
        for cell in itertools.product(*[list(zip(c[:-1], c[1:], strict=True)) for c in cuts]):
            region = Region(full, tuple(a for a, _ in cell), tuple(b - a for a, b in cell))
            holders = [p for p in pieces if p.region.intersect(region) is not None]
            if not holders:
                raise corrupt(
                    self.step_dir,
                    f"{key}: region {region} is held by no shard (a rank's shard is missing or the layout is wrong)",
                )
            if len(holders) > 1:
                raise corrupt(
                    self.step_dir,
                    f"{key}: region {region} is held by {len(holders)} different slices ("
                    + ", ".join(f"{shard_name(p.rank)} {p.region}" for p in holders)
                    + ")",
                )

    # ------------------------------------------------------------------ reading
    def keys(self) -> list[str]:
        """Every tensor key of the checkpoint (``param.*``, ``optim.*``)."""
        return sorted(self.pieces)

    def full_shape(self, key: str) -> tuple[int, ...]:
        """The shape of the full tensor ``key`` (the N-D shape for flat ZeRO ranges)."""
        return self.flat_shapes.get(key) or self.pieces[key][0].region.full_shape

    def _handle(self, rank: int):
        if rank not in self._handles:
            path = self.step_dir / shard_name(rank)
            try:
                self._handles[rank] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for unreadable files
                raise corrupt(self.step_dir, f"{shard_name(rank)} is not a readable safetensors file ({exc})") from None
        return self._handles[rank]

    def _read_stored(self, key: str, want: Region) -> torch.Tensor:
        """``want`` (a region of the stored, possibly flat, tensor) assembled from the pieces that hold it."""
        out: torch.Tensor | None = None
        got = 0
        for p in self.pieces[key]:
            part = p.region.intersect(want)
            if part is None:
                continue
            data = self._handle(p.rank).get_slice(key)[p.region.local(part)] if part.shape else None
            if data is None:
                data = self._handle(p.rank).get_tensor(key)
            if out is None:
                out = torch.empty(want.shape, dtype=data.dtype)
            out[want.local(part)] = data
            got += part.numel
        if out is None or got != want.numel:
            raise corrupt(self.step_dir, f"{key}: the shards cover {got} of the {want.numel} elements of {want}")
        return out

    def read(self, key: str, region: Region | None = None) -> torch.Tensor:
        """Tensor ``key`` restricted to ``region`` (of its full, N-D shape); the whole tensor when None."""
        if key not in self.pieces:
            raise CheckpointError(f"{self.step_dir}: no tensor {key} in the checkpoint")
        shape = self.full_shape(key)
        region = region or Region.full(shape)
        if tuple(region.full_shape) != tuple(shape):
            raise CheckpointError(
                f"{self.step_dir}: {key} has full shape {list(shape)} in the checkpoint, the target layout expects "
                f"{list(region.full_shape)}; the model config differs from the one that wrote the checkpoint"
            )
        if key not in self.flat_shapes:
            return self._read_stored(key, region)
        # flat ranges: read the span of flat indices the region touches, then pick the region out of it
        strides = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        first = sum(o * s for o, s in zip(region.offsets, strides, strict=True))
        last = sum((o + n - 1) * s for o, n, s in zip(region.offsets, region.shape, strides, strict=True))
        span = self._read_stored(key, Region((math.prod(shape),), (first,), (last - first + 1,)))
        if region.numel == math.prod(shape):
            return span.view(shape)
        idx = torch.zeros(region.shape, dtype=torch.long)
        for d, (o, s) in enumerate(zip(region.offsets, strides, strict=True)):
            view = [1] * len(shape)
            view[d] = region.shape[d]
            idx = idx + (torch.arange(o, o + region.shape[d]) * s).view(view)
        return span[idx - first].clone()

    def close(self) -> None:
        """Drop the open shard handles."""
        self._handles.clear()


def load_full_tensors(
    step_dir: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    model_shapes: Mapping[str, Iterable[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (or those of ``names``, checkpoint keys like ``param.lm_head.weight``) at
    full shape, assembled from all shards whatever layout wrote them. Flat ZeRO ranges come back reshaped.

    Raises CheckpointCorrupt naming a region that no shard, or more than one distinct slice, holds.
    """
    index = CheckpointIndex.open(step_dir, model_shapes)
    keys = index.keys() if names is None else list(names)
    try:
        return {k: index.read(k) for k in keys}
    finally:
        index.close()


def load_for_layout(
    step_dir: str | os.PathLike[str],
    wanted: Mapping[str, Region | tuple[Iterable[int], Region | None]],
    model_shapes: Mapping[str, Iterable[int]] | None = None,
    missing_ok: bool = False,
) -> dict[str, torch.Tensor]:
    """The slices one rank needs: ``wanted`` maps checkpoint key -> :class:`Region` (or ``(full_shape, Region or
    None)``); each result has the region's shape. Only the overlapping parts of the shards are read.

    A key missing from the checkpoint raises CheckpointError, or is skipped when ``missing_ok``.
    """
    index = CheckpointIndex.open(step_dir, model_shapes)
    out: dict[str, torch.Tensor] = {}
    try:
        for key, spec in wanted.items():
            if isinstance(spec, tuple):
                full_shape, region = spec
                region = region or Region.full(full_shape)
            else:
                region = spec
            if key not in index.pieces:
                if missing_ok:
                    continue
                raise CheckpointError(f"{step_dir}: tensor {key} is not in the checkpoint (the model expects it)")
            out[key] = index.read(key, region)
    finally:
        index.close()
    return out


def param_keys(slices: Mapping[str, Region]) -> dict[str, Region]:
    """``{"param.<name>": region}`` for :func:`load_for_layout`."""
    return {f"{PARAM}{n}": r for n, r in slices.items()}


def load_optimizer_for_layout(
    step_dir: str | os.PathLike[str], slices: Mapping[str, Region]
) -> dict[str, torch.Tensor]:
    """Optimizer state of the parameters in ``slices`` (HF name -> Region), each cut like its parameter.

    Returns ``optim.<name>.<key>`` tensors: per-parameter state with the parameter's shape is sliced, scalar
    state (``step``) is returned whole. Parameters with no optimizer state in the checkpoint are absent.
    """
    index = CheckpointIndex.open(step_dir, {n: r.full_shape for n, r in slices.items()})
    out: dict[str, torch.Tensor] = {}
    try:
        for key in index.keys():
            if not key.startswith(OPTIM):
                continue
            name = key[len(OPTIM) :].rsplit(".", 1)[0]
            region = slices.get(name)
            if region is None:
                continue
            if tuple(index.full_shape(key)) == tuple(region.full_shape):
                out[key] = index.read(key, region)
            else:
                out[key] = index.read(key)
    finally:
        index.close()
    return out


def model_config_of_checkpoint(manifest: Mapping[str, Any]):
    """The LlamaConfig a checkpoint was written for, from its manifest (``model_shape``, else ``model``)."""
    from kuangchao_core.models.llama import LlamaConfig, config_from_model_section
    from kuangchao_core.models.moe import MoeConfig

    shape = manifest.get("model_shape")
    if isinstance(shape, dict):  # a MoE block is written as its fields (JSON)
        return LlamaConfig(**{**shape, "moe": MoeConfig.from_section(shape.get("moe"))})
    if isinstance(manifest.get("model"), dict):
        return config_from_model_section(manifest["model"])
    raise CheckpointError("the checkpoint manifest records no model config ('model_shape' or 'model')")
