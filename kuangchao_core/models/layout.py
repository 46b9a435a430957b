"""Who holds which slice of which parameter: :class:`Region` and :class:`TargetLayout` (one rank's place in a
dp×tp×pp layout), the single source the engine, checkpoints (resharding) and Hugging Face import/export use.

A TP rank holds the slices :func:`~kuangchao_core.models.tp_llama.tp_shard_slices` names (from ``TP_PLAN``); a
pipeline stage owns the layers :func:`~kuangchao_core.parallel.pipeline.partition_layers` gives it (embedding on
the first stage, final norm and head on the last). DP and ZeRO do not change which parameter slices a rank holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Region:
    """A rectangular slice ``[offsets, offsets + shape)`` of a tensor of ``full_shape``."""

    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def full(cls, shape: Iterable[int]) -> Region:
        """The whole tensor of ``shape``."""
        shape = tuple(int(s) for s in shape)
        return cls(shape, (0,) * len(shape), shape)

    @classmethod
    def split(cls, full_shape: Iterable[int], dim: int, start: int, length: int) -> Region:
        """``length`` entries from ``start`` along ``dim``; every other dim whole."""
        full_shape = tuple(int(s) for s in full_shape)
        offsets = tuple(start if d == dim else 0 for d in range(len(full_shape)))
        shape = tuple(length if d == dim else s for d, s in enumerate(full_shape))
        return cls(full_shape, offsets, shape)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Region:
        """From the writer's slice metadata ``{"full_shape", "offsets", "shape"}``."""
        return cls(tuple(meta["full_shape"]), tuple(meta["offsets"]), tuple(meta["shape"]))

    def to_meta(self) -> dict[str, list[int]]:
        """The writer's slice metadata for this region."""
        return {"full_shape": list(self.full_shape), "offsets": list(self.offsets), "shape": list(self.shape)}

    @property
    def numel(self) -> int:
        """Elements in the region."""
        return math.prod(self.shape)

    def intersect(self, other: Region) -> Region | None:
        """The common part of two regions of the same full tensor, or None."""
        lo = [max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True)]
        hi = [
            min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.shape, other.offsets, other.shape, strict=True)
        ]
        if any(h <= l_ for l_, h in zip(lo, hi, strict=True)):
            return None
        return Region(self.full_shape, tuple(lo), tuple(h - l_ for l_, h in zip(lo, hi, strict=True)))

    def local(self, inner: Region) -> tuple[slice, ...]:
        """Index of ``inner`` (a sub-region) inside a tensor holding this region."""
        return tuple(
            slice(o - so, o - so + s) for o, s, so in zip(inner.offsets, inner.shape, self.offsets, strict=True)
        )

    def __str__(self) -> str:
        rng = ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.shape, strict=True))
        return f"[{rng}] of {list(self.full_shape)}"


@dataclass(frozen=True)
class TargetLayout:
    """Where one rank sits in the layout it wants to load into.

    ``tp``/``tp_rank`` split tensors as :func:`kuangchao_core.models.tp_llama.tp_shard_slices` says (kv heads
    replicated when fewer than ``tp``); ``pp``/``pp_rank``/``virtual`` decide which layers it owns
    (:func:`kuangchao_core.parallel.pipeline.partition_layers`: embedding on the first stage, norm + head on the
    last). DP and ZeRO do not change which parameter slices a rank holds.
    """

    tp: int = 1
    pp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    virtual: int = 1

    def owns(self, cfg: Any) -> Callable[[str], bool]:
        """Predicate: does this rank's pipeline stage hold the parameter named (HF name)?"""
        if self.pp == 1:
            return lambda name: True
        from kuangchao_core.parallel.pipeline import partition_layers

        chunks = partition_layers(cfg.num_layers, self.pp, self.virtual)[self.pp_rank]
        layers = {i for c in chunks for i in range(c.start, c.end)}
        first = any(c.has_embedding for c in chunks)
        last = any(c.has_head for c in chunks)

        def owns(name: str) -> bool:
            if name.startswith("model.layers."):
                return int(name.split(".")[2]) in layers
            if name == "model.embed_tokens.weight":
                return first or (last and cfg.tie_embeddings)
            return last  # model.norm.weight, lm_head.weight

        return owns

    def param_slices(self, cfg: Any) -> dict[str, Region]:
        """HF name -> Region of the full parameter this rank holds, for the parameters it owns."""
        from kuangchao_core.models.tp_llama import full_shapes, tp_shard_slices

        shapes = full_shapes(cfg)
        split = tp_shard_slices(cfg, self.tp, self.tp_rank)
        owns = self.owns(cfg)
        out: dict[str, Region] = {}
        for name, shape in shapes.items():
            if not owns(name):
                continue
            s = split.get(name)
            out[name] = Region.full(shape) if s is None else Region.split(shape, *s)
        return out


def slices_for_rank(
    cfg: Any, tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0, virtual: int = 1
) -> dict[str, Region]:
    """Shortcut for ``TargetLayout(tp, pp, tp_rank, pp_rank, virtual).param_slices(cfg)``."""
    return TargetLayout(tp, pp, tp_rank, pp_rank, virtual).param_slices(cfg)
