"""The mesh of named axes (issue 30): the one place that maps global ranks to mesh coordinates and back.

A job's processes form a grid of four named axes, outermost first::

    dp (data) · cp (context) · pp (pipeline) · tp (tensor)        — innermost last

    rank = ((dp_idx * cp + cp_idx) * pp + pp_idx) * tp + tp_idx

so tensor parallelism gets consecutive ranks (the fastest links), then pipeline, then context parallelism, and data
parallelism is outermost. With ``cp = 1`` this is the three-axis formula the mesh always had. Every layer reads the
grid from here — the process groups (``parallel.mesh``), the tokens' group lists (``perm.layout``), placement
(``sched.rank_placement``, ``sched.perf_groups``), traffic and ``kc plan`` (``engine``) — so adding an axis is one
entry in :data:`AXES`, one config field, and the code that uses the axis. This module is a leaf beside ``errors``:
every package may import it, and it imports nothing but ``errors``.

Groups of an axis: one per position of the other axes, enumerated in :data:`AXES` order (outermost varying
slowest); the ranks of a group in order along the axis. Group construction is collective, so this order is the
order every process builds them in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kuangchao_core.errors import PlanError

#: the axes, outermost first (innermost last)
AXES = ("dp", "cp", "pp", "tp")
#: each axis's size in the config's ``parallel`` section
SIZE_KEYS = {
    "dp": "data_parallel_size",
    "cp": "context_parallel_size",
    "pp": "pipeline_parallel_size",
    "tp": "tensor_parallel_size",
}
#: groups that span several axes: ``dp_cp`` holds every replica of the same parameters (the ranks that share the
#: pp and tp coordinates), over which gradients are reduced and ZeRO shards when ``cp > 1``
JOINT = {"dp_cp": ("dp", "cp")}
#: the order the mesh builds its groups in (collective: every rank the same): the three original axes as they
#: always were, then the axes added since, then the joint groups (only when ``cp > 1``: nothing changes at cp 1)
BUILD_ORDER = ("tp", "pp", "dp", "cp", "dp_cp")


def group_name(kind: str, ranks: Iterable[int]) -> str:
    """The canonical name of a parallel group, ``<kind>[<sorted ranks>]`` (``tp[0,1]``), as tokens list it."""
    return f"{kind}[{','.join(str(r) for r in sorted(int(r) for r in ranks))}]"


def _get(section: Any, key: str, default: int = 1) -> int:
    value = section.get(key, default) if isinstance(section, Mapping) else getattr(section, key, default)
    return default if value is None else value


@dataclass(frozen=True)
class MeshAxes:
    """The sizes of the four axes; pure arithmetic on ranks (no process groups)."""

    dp: int = 1
    cp: int = 1
    pp: int = 1
    tp: int = 1

    @classmethod
    def from_parallel(cls, parallel: Any) -> MeshAxes:
        """The axes of a config's ``parallel`` section (an object or a dict; a missing size is 1)."""
        return cls(**{axis: int(_get(parallel, key)) for axis, key in SIZE_KEYS.items()})

    @property
    def sizes(self) -> dict[str, int]:
        """``{axis: size}`` in :data:`AXES` order."""
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def world_size(self) -> int:
        """Processes the grid holds: the product of the sizes."""
        n = 1
        for size in self.sizes.values():
            n *= size
        return n

    def active(self, order: Sequence[str] = BUILD_ORDER) -> tuple[str, ...]:
        """The axes whose groups the mesh builds, in ``order``: the original three always (as they always were,
        one-rank groups included), an added axis (``cp``) and the joint ``dp_cp`` only when cp has more than one
        rank."""
        return tuple(a for a in order if a in ("tp", "pp", "dp") or getattr(self, a if a in AXES else "cp") > 1)

    def rank_of(self, coords: Mapping[str, int] | None = None, **kw: int) -> int:
        """The global rank at ``coords`` (``{axis: index}``; a missing axis is at 0)."""
        at = {**(coords or {}), **kw}
        rank = 0
        for axis in AXES:
            size, idx = getattr(self, axis), int(at.get(axis, 0))
            if not 0 <= idx < size:
                raise ValueError(f"{axis} index {idx} is outside [0, {size})")
            rank = rank * size + idx
        return rank

    def coords_of(self, rank: int) -> dict[str, int]:
        """``{axis: index}`` of a global rank, in :data:`AXES` order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, world size {self.world_size})")
        out: dict[str, int] = {}
        for axis in reversed(AXES):
            rank, out[axis] = divmod(rank, getattr(self, axis))
        return {axis: out[axis] for axis in AXES}

    def ranks_in_order(self, outer_first: Sequence[str] = AXES) -> list[int]:
        """Every rank, enumerated with the axes nested as ``outer_first`` says (the last varies fastest)."""
        if sorted(outer_first) != sorted(AXES):
            raise ValueError(f"an order of all of {AXES} is needed, got {tuple(outer_first)}")
        out: list[int] = []

        def walk(level: int, at: dict[str, int]) -> None:
            if level == len(outer_first):
                out.append(self.rank_of(at))
                return
            axis = outer_first[level]
            for i in range(getattr(self, axis)):
                walk(level + 1, {**at, axis: i})

        walk(0, {})
        return out

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis``: one per position of the other axes (in :data:`AXES` order), its ranks in order
        along ``axis``. Index ``i`` is the group ``<axis><i>`` of :meth:`indexed_groups`. A joint kind of
        :data:`JOINT` (``dp_cp``) spans its axes, the first outermost."""
        spans = JOINT.get(axis, (axis,))
        if any(a not in AXES for a in spans):
            raise ValueError(f"axis must be one of {', '.join((*AXES, *JOINT))}, got {axis!r}")
        flat = self.ranks_in_order([*(a for a in AXES if a not in spans), *spans])
        n = 1
        for a in spans:
            n *= getattr(self, a)
        return [flat[i : i + n] for i in range(0, len(flat), n)]

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``axis``."""
        at = self.coords_of(rank)
        return [self.rank_of({**at, axis: i}) for i in range(getattr(self, axis))]

    def indexed_groups(self, axis: str) -> dict[str, list[int]]:
        """``{"<axis><i>": ranks}`` (``tp0``, ``dp3``), as ``kc plan`` lists them."""
        return {f"{axis}{i}": g for i, g in enumerate(self.groups(axis))}

    def named_groups(self, axes: Sequence[str] | None = None) -> dict[str, list[int]]:
        """``{canonical name: ranks}`` of every group of ``axes`` (default: :meth:`active`), in build order."""
        return {group_name(a, g): list(g) for a in (self.active() if axes is None else axes) for g in self.groups(a)}


def size_problems(sizes: Mapping[str, Any], world_size: int | None = None) -> list[tuple[str, str]]:
    """``(dotted path, message)`` for each size (``{axis: size}``) that is not an integer >= 1, or, when they all
    are, for a product that is not ``world_size`` (every number shown)."""
    errors = [
        (f"parallel.{SIZE_KEYS[a]}", f"must be an integer >= 1, got {v!r}")
        for a in ("dp", "tp", "pp", "cp")
        if a in sizes
        for v in [sizes[a]]
        if not isinstance(v, int) or v < 1
    ]
    if errors or world_size is None:
        return errors
    shown = [a for a in ("dp", "cp", "tp", "pp") if a != "cp" or sizes.get("cp", 1) != 1]
    product = MeshAxes(**{a: sizes.get(a, 1) for a in AXES}).world_size
    if product == world_size:
        return []
    terms = " x ".join(f"{SIZE_KEYS[a]} {sizes.get(a, 1)}" for a in shown)
    return [
        (
            "parallel",
            f"{terms} = {product} processes, but the world size is {world_size}; change the sizes so their product"
            f" is {world_size} or launch {product} processes",
        )
    ]


def validated(sizes: Mapping[str, Any], world_size: int | None = None) -> MeshAxes:
    """The :class:`MeshAxes` of ``sizes``; raises PlanError naming each bad size's config field (and the world size
    mismatch with every number)."""
    errors = size_problems(sizes, world_size)
    if errors:
        raise PlanError(errors)
    return MeshAxes(**{a: sizes.get(a, 1) for a in AXES})
