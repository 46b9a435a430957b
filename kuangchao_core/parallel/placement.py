"""Where every parameter lives on the mesh (issue 43): per named axis, sharded along a dimension, replicated, or
holding a partial sum of its gradient (DTensor's placements and Megatron-Core's parameter attributes are the model).

Built once where the model is parallelized (``engine.parallel_model``, the encoder in ``engine.vlm_model``); read by
GradSync (its replica group: :meth:`PlacementRecord.replica_axes`), the clipping weights
(:meth:`PlacementRecord.norm_weight`) and the extra sums (:mod:`~kuangchao_core.parallel.partial_sums`). The axes
are the mesh's plus any a part of the model cuts one into (the encoder's ``vtp`` × ``vshare`` = ``tp``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kuangchao_core import axes as table
from kuangchao_core.errors import PlanError


@dataclass(frozen=True)
class Shard:
    """Dimension ``dim`` cut in ``parts`` equal slices, each held by ``size / parts`` ranks (replicated key/value
    heads); ``dim`` None: the model is cut (each pipeline stage holds its own parameters)."""

    dim: int | None
    parts: int


@dataclass(frozen=True)
class Replicate:
    """Every rank of the axis holds the same values and computes the same gradient (the same inputs)."""


@dataclass(frozen=True)
class Partial:
    """The same values on every rank, a partial gradient: ``avg`` over the data axes (GradSync), ``sum`` elsewhere,
    inside each backward by the layer (``in_backward``) or after the step's backwards (``partial_sums``)."""

    op: str = "sum"
    in_backward: bool = False


Placement = Shard | Replicate | Partial


def tensor_axis(region: Any, size: int, partial: bool = False, in_backward: bool = False) -> Placement:
    """The placement over a TP axis of ``size`` ranks of a parameter holding ``region`` (a ``models.layout.Region``):
    sharded where its shape is cut, else replicated, or a partial sum when ``partial``."""
    cut = [d for d, (mine, full) in enumerate(zip(region.shape, region.full_shape, strict=True)) if mine != full]
    if size > 1 and cut:
        return Shard(cut[0], region.full_shape[cut[0]] // region.shape[cut[0]])
    return Partial("sum", in_backward) if partial and size > 1 else Replicate()


@dataclass
class PlacementRecord:
    """``params``: parameter name -> {axis: placement} for every parameter this rank holds; ``sizes``: every axis
    a placement names -> its number of ranks."""

    sizes: dict[str, int]
    params: dict[str, dict[str, Placement]] = field(default_factory=dict)

    @classmethod
    def of_regions(
        cls, regions: Mapping[str, Any], sizes: Mapping[str, int], in_backward: Iterable[str] = ()
    ) -> PlacementRecord:
        """The record of a model on the mesh axes ``sizes``: ``tp`` as its ``regions`` say, the others as
        :meth:`stage_axes`; the names in ``in_backward`` hold partial sums over ``tp`` (when whole) that their layers
        sum in backward."""
        partial = set(in_backward)
        out = cls(dict(sizes))
        for name, region in regions.items():
            out.params[name] = {
                **out.stage_axes(),
                "tp": tensor_axis(region, sizes.get("tp", 1), name in partial, True),
            }
        return out

    def stage_axes(self, apart: Iterable[str] = ("tp",)) -> dict[str, Placement]:
        """What every parameter of a pipeline stage shares: averaged over the data axes, held by its stage, the same
        on every other axis of the table but those the caller places ``apart`` (``tp``, from the regions)."""
        data, skip = [a.name for a in table.TABLE if a.data], {"pp", *apart}
        out: dict[str, Placement] = {a: Replicate() for a in table.AXES if a in self.sizes and a not in skip}
        out.update({a: Partial("avg") for a in data if a in self.sizes})
        return {**out, "pp": Shard(None, self.sizes.get("pp", 1))}

    def replica_axes(self) -> tuple[str, ...]:
        """The axes every parameter's gradient is averaged over (GradSync's group); PlanError when they differ."""
        found = {tuple(a for a, p in axes.items() if p == Partial("avg")) for axes in self.params.values()}
        if len(found) > 1:
            raise PlanError([("parallel", f"parameters are averaged over different axes {sorted(found)}")])
        return found.pop() if found else tuple(a.name for a in table.TABLE if a.data and a.name in self.sizes)

    def apart(self) -> dict[str, str]:
        """Name -> the group kind its gradient is summed over, for each parameter sharded along an axis within
        another (``axes.Axis.within``): the parent's ranks holding the same part (``<parent>_mod_<axis>``)."""
        return {
            name: table.mod_kind(table.axis(a))
            for name, axes in self.params.items()
            for a, p in axes.items()
            if isinstance(p, Shard) and a in table.AXES and table.axis(a).within is not None and p.parts > 1
        }

    def first_holder(self, name: str, coords: dict[str, int]) -> bool:
        """Whether the rank at ``coords`` is the first of the replicas holding ``name``'s values (it writes them to
        a checkpoint): index 0 along each replica axis, counted in runs of the axes within it that shard ``name``."""
        for a in self.replica_axes():
            index = coords.get(a, 0)
            for w, p in self.params.get(name, {}).items():
                if isinstance(p, Shard) and w in table.AXES and table.axis(w).within == a:
                    index //= self.sizes[w]
            if index:
                return False
        return True

    def norm_weight(self) -> dict[str, float]:
        """Name -> 1 / the ranks outside the replica axes holding the same reduced gradient (a global norm counts
        each element once)."""
        out = {}
        for name, axes in self.params.items():
            holders = 1
            for axis, p in axes.items():
                if p != Partial("avg"):
                    holders *= self.sizes[axis] // p.parts if isinstance(p, Shard) else self.sizes[axis]
            out[name] = 1.0 / holders
        return out
