"""The mesh of named axes (issues 30, 43): the one table of axes, and the one place that maps ranks to coordinates.

A job's processes form a grid of named axes, outermost first (:data:`TABLE`)::

    dp (data) · cp (context) · pp (pipeline) · tp (tensor)        — innermost last

    rank = ((dp_idx * cp + cp_idx) * pp + pp_idx) * tp + tp_idx

so tensor parallelism gets consecutive ranks (the fastest links), then pipeline, then context parallelism, and data
parallelism is outermost. The process groups (``parallel.mesh``), the tokens' groups (``perm.layout``), placement
(``parallel.placement``, ``sched.rank_placement``), validation and ``kc plan`` iterate the table, so an axis is one
:class:`Axis` entry and the code that uses it (:func:`extra_axis`: one for a block, a test's throw-away axis). Read
the table at call time (``axes.AXES``: ``from axes import AXES`` keeps a copy). A leaf: imports only ``errors``.

Groups of an axis: one per position of the other axes, enumerated in :data:`AXES` order (outermost varying
slowest), its ranks in order along the axis; every process builds them in :data:`BUILD_ORDER` (collective).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kuangchao_core.errors import PlanError


@dataclass(frozen=True)
class Axis:
    """``size_key``: its size's field in ``parallel``; ``built``: groups built at one rank too (the original three;
    an added axis only at more than one, so a job without it is unchanged); ``data``: its ranks see different
    tokens, so gradients are averaged over it (``Partial("avg")``; else ``Replicate()`` unless a region cuts it);
    ``within``: an axis carved out of another (its ranks are that axis's, in runs of ``size`` consecutive indices),
    so it adds no processes: its index is the parent's modulo its size, and besides its own groups the mesh builds
    ``<parent>_mod_<name>`` (:func:`mod_kind`), the parent's ranks sharing its index (issue 40: ``ep`` in ``dp``);
    ``needs``: the communication primitives it uses at more than one rank beyond every job's (``kc plan`` and
    ``permission.allowed_interfaces``); ``checks``: ``"module:function"`` of its own config rules, run by the job
    config's cross-checks with the ``model``, ``parallel`` and ``train`` sections (``(path, message)`` pairs);
    ``place``: ``"module:function"`` that places the model's parameters along it where the model is parallelized
    (``engine.parallel_model``), called with the model, its regions, its placement record and the mesh."""

    name: str
    size_key: str
    built: bool = False
    data: bool = False
    within: str | None = None
    needs: tuple[str, ...] = ()
    checks: str = ""
    place: str = ""


#: the axes, outermost first (innermost last)
TABLE: tuple[Axis, ...] = (
    Axis("dp", "data_parallel_size", built=True, data=True),  # replicas on different batches
    Axis("cp", "context_parallel_size", data=True),  # slices of each sequence
    Axis("pp", "pipeline_parallel_size", built=True),  # stages, each holding its layers
    Axis("tp", "tensor_parallel_size", built=True),  # slices of each layer's weights
    Axis(  # experts' shards (issue 40), carved out of the data-parallel ranks
        "ep",
        "expert_parallel_size",
        within="dp",
        needs=("all_to_all",),
        checks="kuangchao_core.config.expert_parallel_schema:expert_parallel_errors",
        place="kuangchao_core.engine.expert_parallel:place_experts",
    ),
)
#: groups that span several axes: ``dp_cp`` holds every replica of the same parameters (the ranks that share the
#: pp and tp coordinates), over which gradients are reduced and ZeRO shards when ``cp > 1``
JOINT: dict[str, tuple[str, ...]] = {"dp_cp": ("dp", "cp")}


def resolve(path: str) -> Any:
    """The function a ``"module:function"`` path of an :class:`Axis` names (imported when first called)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def mod_kind(a: Axis) -> str:
    """The group kind of a ``within`` axis's replicas: the parent's ranks with the same index along ``a``."""
    return f"{a.within}_mod_{a.name}"


def _derive() -> None:
    """Recompute the names read everywhere from :data:`TABLE` and :data:`JOINT`."""
    global AXES, GRID, SIZE_KEYS, BUILD_ORDER, MOD
    AXES = tuple(a.name for a in TABLE)
    GRID = tuple(a.name for a in TABLE if a.within is None)
    MOD = {mod_kind(a): a.name for a in TABLE if a.within is not None}
    SIZE_KEYS = {a.name: a.size_key for a in TABLE}
    # the order the mesh builds its groups in (collective: every rank the same): the original axes innermost first,
    # as they always were, then the axes added since, then the joint groups (the added ones only at size > 1)
    inner_first = TABLE[::-1]
    BUILD_ORDER = (
        *(a.name for a in inner_first if a.built),
        *(a.name for a in inner_first if not a.built),
        *JOINT,
        *MOD,
    )


AXES: tuple[str, ...]
GRID: tuple[str, ...]  # the axes whose product is the world size (those not ``within`` another)
MOD: dict[str, str]  # ``<parent>_mod_<axis>`` -> the within axis
SIZE_KEYS: dict[str, str]
BUILD_ORDER: tuple[str, ...]
_derive()


def axis(name: str) -> Axis:
    """The table's entry of ``name``; ValueError naming the table's axes for another name."""
    for a in TABLE:
        if a.name == name:
            return a
    raise ValueError(f"unknown axis {name!r}; the mesh's axes are {', '.join(AXES)}")


def spans(kind: str) -> tuple[str, ...]:
    """The axes a group kind spans: an axis itself, a joint kind's axes, a ``_mod_`` kind's within axis."""
    if kind in JOINT:
        return JOINT[kind]
    return (MOD[kind],) if kind in MOD else (kind,)


def shown_order() -> tuple[str, ...]:
    """The order sizes are written in messages and ``kc plan``: the data axes outermost first, then the others
    innermost first (``dp x cp x tp x pp``)."""
    return (*(a.name for a in TABLE if a.data), *(a.name for a in TABLE[::-1] if not a.data))


@contextmanager
def extra_axis(
    new: Axis, outside: str | None = None, joint: Mapping[str, tuple[str, ...]] | None = None
) -> Iterator[Axis]:
    """Add ``new`` to the table while the block runs (a test's throw-away axis; a lasting axis is a :data:`TABLE`
    entry): just outside axis ``outside`` (default: innermost), with the ``joint`` kinds it adds."""
    global TABLE, JOINT
    saved = TABLE, JOINT
    if new.name in AXES or new.size_key in SIZE_KEYS.values():
        raise ValueError(f"axis {new.name!r} ({new.size_key}) is in the table already")
    at = len(TABLE) if outside is None else AXES.index(outside)
    TABLE, JOINT = (*TABLE[:at], new, *TABLE[at:]), {**JOINT, **(joint or {})}
    _derive()
    try:
        yield new
    finally:
        TABLE, JOINT = saved
        _derive()


def group_name(kind: str, ranks: Iterable[int]) -> str:
    """The canonical name of a parallel group, ``<kind>[<sorted ranks>]`` (``tp[0,1]``), as tokens list it."""
    return f"{kind}[{','.join(str(r) for r in sorted(int(r) for r in ranks))}]"


def _get(section: Any, key: str, default: int = 1) -> int:
    value = section.get(key, default) if isinstance(section, Mapping) else getattr(section, key, default)
    return default if value is None else value


@dataclass(frozen=True, init=False)
class MeshAxes:
    """The sizes of the table's axes (``MeshAxes(dp=2, tp=2)`` or ``MeshAxes({"dp": 2})``; an axis left out has
    one rank, read as ``axes.dp``); pure arithmetic on ranks (no process groups)."""

    given: dict[str, int]

    def __init__(self, sizes: Mapping[str, int] | None = None, **kw: int) -> None:
        given = {**(sizes or {}), **kw}
        for name in given:
            axis(name)  # ValueError for a name outside the table
        object.__setattr__(self, "given", {a: int(given.get(a, 1)) for a in AXES})

    def __getattr__(self, name: str) -> int:
        if name in AXES:
            return self.given.get(name, 1)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @classmethod
    def from_parallel(cls, parallel: Any) -> MeshAxes:
        """The axes of a config's ``parallel`` section (an object or a dict; a missing size is 1)."""
        return cls({a.name: int(_get(parallel, a.size_key)) for a in TABLE})

    @property
    def sizes(self) -> dict[str, int]:
        """``{axis: size}`` in :data:`AXES` order."""
        return {a: self.given.get(a, 1) for a in AXES}

    @property
    def world_size(self) -> int:
        """Processes the grid holds: the product of the sizes."""
        n = 1
        for a in GRID:
            n *= self.sizes[a]
        return n

    def active(self, order: Sequence[str] | None = None) -> tuple[str, ...]:
        """The kinds whose groups the mesh builds, in ``order`` (default :data:`BUILD_ORDER`): an axis built always
        (one-rank groups included), another axis or a joint kind when an axis it spans that is not has more than
        one rank."""
        sizes = self.sizes
        added = [[a for a in spans(k) if not axis(a).built] for k in order or BUILD_ORDER]
        return tuple(
            k for k, new in zip(order or BUILD_ORDER, added, strict=True) if not new or any(sizes[a] > 1 for a in new)
        )

    def rank_of(self, coords: Mapping[str, int] | None = None, **kw: int) -> int:
        """The global rank at ``coords`` (``{axis: index}``; a missing axis is at 0; a ``within`` axis's index is
        its parent's, so it is not read)."""
        at, sizes = {**(coords or {}), **kw}, self.sizes
        rank = 0
        for a in GRID:
            size, idx = sizes[a], int(at.get(a, 0))
            if not 0 <= idx < size:
                raise ValueError(f"{a} index {idx} is outside [0, {size})")
            rank = rank * size + idx
        return rank

    def coords_of(self, rank: int) -> dict[str, int]:
        """``{axis: index}`` of a global rank, in :data:`AXES` order (a ``within`` axis only at more than one
        rank)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, world size {self.world_size})")
        out: dict[str, int] = {}
        for a in reversed(GRID):
            rank, out[a] = divmod(rank, self.sizes[a])
        for a in TABLE:
            if a.within is not None and self.sizes[a.name] > 1:  # (an axis within another only when it is cut)
                out[a.name] = out[a.within] % self.sizes[a.name]
        return {a: out[a] for a in AXES if a in out}

    def ranks_in_order(self, outer_first: Sequence[str] | None = None) -> list[int]:
        """Every rank, enumerated with the axes nested as ``outer_first`` says (default :data:`AXES`; the last
        varies fastest; a ``within`` axis, part of its parent, is left out)."""
        outer_first = [a for a in (AXES if outer_first is None else outer_first) if a in GRID]
        if sorted(outer_first) != sorted(GRID):
            raise ValueError(f"an order of all of {GRID} is needed, got {tuple(outer_first)}")
        out: list[int] = []

        def walk(level: int, at: dict[str, int]) -> None:
            if level == len(outer_first):
                out.append(self.rank_of(at))
                return
            for i in range(self.sizes[outer_first[level]]):
                walk(level + 1, {**at, outer_first[level]: i})

        walk(0, {})
        return out

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind``: one per position of the other axes (in :data:`AXES` order), its ranks in order
        along the axis. Index ``i`` is the group ``<kind><i>`` of :meth:`indexed_groups`. A joint kind of
        :data:`JOINT` (``dp_cp``) spans its axes, the first outermost. A ``within`` axis's groups are runs of its
        size along each parent group; a ``_mod_`` kind's are the parent group's ranks with the same index along it."""
        if kind in MOD or kind in AXES and axis(kind).within is not None:
            a = axis(MOD.get(kind, kind))
            n = self.sizes[a.name]
            runs = [g[i : i + n] for g in self.groups(a.within) for i in range(0, len(g), n)]
            return runs if kind == a.name else [g[j::n] for g in self.groups(a.within) for j in range(n)]
        spans = JOINT.get(kind, (kind,))
        if any(a not in AXES for a in spans):
            raise ValueError(f"axis must be one of {', '.join((*AXES, *JOINT))}, got {kind!r}")
        flat = self.ranks_in_order([*(a for a in AXES if a not in spans), *spans])
        n = 1
        for a in spans:
            n *= self.sizes[a]
        return [flat[i : i + n] for i in range(0, len(flat), n)]

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along axis ``kind``."""
        if kind not in GRID:
            return next(g for g in self.groups(kind) if rank in g)
        at = self.coords_of(rank)
        return [self.rank_of({**at, kind: i}) for i in range(self.sizes[kind])]

    def indexed_groups(self, kind: str) -> dict[str, list[int]]:
        """``{"<kind><i>": ranks}`` (``tp0``, ``dp3``), as ``kc plan`` lists them."""
        return {f"{kind}{i}": g for i, g in enumerate(self.groups(kind))}

    def named_groups(self, kinds: Sequence[str] | None = None) -> dict[str, list[int]]:
        """``{canonical name: ranks}`` of every group of ``kinds`` (default: :meth:`active`), in build order."""
        return {group_name(k, g): list(g) for k in (self.active() if kinds is None else kinds) for g in self.groups(k)}

    def shown(self) -> tuple[str, ...]:
        """The axes messages and ``kc plan`` write, in :func:`shown_order`: those built always, the others when
        they have more than one rank."""
        return tuple(a for a in shown_order() if axis(a).built or self.sizes[a] != 1)


def size_problems(sizes: Mapping[str, Any], world_size: int | None = None) -> list[tuple[str, str]]:
    """``(dotted path, message)`` for each size (``{axis: size}``) that is not an integer >= 1 or names no axis of
    the table, or, when they all are, for a product that is not ``world_size`` (every number shown)."""
    errors = [
        ("parallel", f"unknown axis {a!r}; the mesh's axes are {', '.join(AXES)}") for a in sizes if a not in AXES
    ]
    errors += [
        (f"parallel.{SIZE_KEYS[a]}", f"must be an integer >= 1, got {v!r}")
        for a in AXES
        if a in sizes
        for v in [sizes[a]]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1
    ]
    errors = errors or within_problems(sizes)
    if errors or world_size is None:
        return errors
    axes = MeshAxes(sizes)
    if axes.world_size == world_size:
        return []
    terms = " x ".join(f"{SIZE_KEYS[a]} {axes.sizes[a]}" for a in axes.shown() if a in GRID)
    return [
        (
            "parallel",
            f"{terms} = {axes.world_size} processes, but the world size is {world_size}; change the sizes so their"
            f" product is {world_size} or launch {axes.world_size} processes",
        )
    ]


def within_problems(sizes: Mapping[str, int]) -> list[tuple[str, str]]:
    """``(dotted path, message)`` for each axis within another whose size (integers >= 1) does not divide it."""
    return [
        (f"parallel.{a.size_key}", f"{n} must divide {SIZE_KEYS[a.within]} {sizes.get(a.within, 1)}")
        for a in TABLE
        if a.within is not None
        for n in [sizes.get(a.name, 1)]
        if isinstance(n, int) and n >= 1 and sizes.get(a.within, 1) % n
    ]


def validated(sizes: Mapping[str, Any], world_size: int | None = None) -> MeshAxes:
    """The :class:`MeshAxes` of ``sizes``; raises PlanError naming each bad size's config field (and the world size
    mismatch with every number)."""
    errors = size_problems(sizes, world_size)
    if errors:
        raise PlanError(errors)
    return MeshAxes(sizes)
