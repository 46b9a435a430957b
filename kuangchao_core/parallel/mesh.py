"""The device mesh (SPEC L3.4): one object, built once from the config, that owns every TP, PP, DP and CP group.

The grid and its rank formula are :mod:`kuangchao_core.axes` (issue 30): axes ``dp``, ``cp``, ``pp``, ``tp``,
innermost last — tensor parallelism on consecutive ranks (the fastest links), then pipeline, then context, then
data parallelism::

    rank = ((dp_idx * cp + cp_idx) * pp + pp_idx) * tp + tp_idx

Every process constructs every group, in the same order (all TP groups, then all PP groups, then all DP groups,
then — when ``cp > 1`` — all CP groups), because group construction is collective. The mesh is passed explicitly
to whoever needs a group; there are no module-level globals. :func:`mesh_layout` computes the same rank lists
without any process group (for ``kc plan``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kuangchao_core import axes as table
from kuangchao_core.axes import MeshAxes, group_name, validated
from kuangchao_core.config.access import setting
from kuangchao_core.errors import PlanError

__all__ = [
    "MeshLayout",
    "ParallelMesh",
    "ReduceGroups",
    "dp_subgroups",
    "group_name",
    "mesh_group_lists",
    "mesh_layout",
]


class MeshLayout(MeshAxes):
    """The group kinds a mesh of these sizes builds and every group's rank list (pure arithmetic on
    :class:`~kuangchao_core.axes.MeshAxes`; no process groups)."""

    def kinds(self) -> tuple[str, ...]:
        """The group kinds the mesh builds, in construction order (an added axis such as ``cp`` only when it has
        more than one rank)."""
        return self.active()

    def describe(self) -> dict[str, Any]:
        """Sizes and every group's rank list, keyed by group name (an added axis only when it is built)."""
        kinds = [k for k in self.active() if k not in table.JOINT]
        return {
            "sizes": {**{a: self.sizes[a] for a in self.shown()}, "world_size": self.world_size},
            **{f"{kind}_groups": self.indexed_groups(kind) for kind in kinds},
        }


def dp_subgroups(layout: MeshLayout, node_of_rank: list[int] | None, mode: str) -> list[tuple[str, list[int]]]:
    """The node-local (``dpn``) and cross-node (``dpx``) subgroups of every DP group, in construction order, when
    the hierarchical all-reduce applies (``mode``: ``parallel.hierarchical_allreduce``); empty otherwise."""
    from kuangchao_core.comm.hierarchical import subgroup_lists, use_hierarchical

    nodes = list(node_of_rank) if node_of_rank is not None else [0] * layout.world_size
    groups = layout.groups("dp")
    if not use_hierarchical(mode, groups, nodes):
        return []
    return [("dpn" if kind == "n" else "dpx", ranks) for kind, ranks in subgroup_lists(groups, nodes)]


def mesh_group_lists(
    layout: MeshLayout, node_of_rank: list[int] | None = None, hierarchical: str = "off"
) -> list[tuple[str, list[int]]]:
    """Every group :class:`ParallelMesh` builds, as ``(kind, ranks)`` in construction order: the groups of each of
    ``layout.kinds()`` (tp, pp, dp, then cp and dp_cp: ``axes.BUILD_ORDER``), then the DP groups' ``dpn`` / ``dpx`` subgroups when the
    hierarchical all-reduce applies. The mesh builds exactly this list and ``kc plan`` lists its communicators
    from it (``engine.plan_comms``)."""
    out = [(kind, list(ranks)) for kind in layout.kinds() for ranks in layout.groups(kind)]
    return out + dp_subgroups(layout, node_of_rank, hierarchical)


def mesh_layout(sizes: Mapping[str, int], world_size: int | None = None) -> MeshLayout:
    """Validated layout of the mesh of ``sizes`` (``{axis: size}``; raises PlanError with every number)."""
    return MeshLayout(validated(sizes, world_size).sizes)


class ParallelMesh:
    """This process's place in the mesh of named axes, and the communication groups it belongs to.

    Attributes, for each axis ``a`` of ``axes.AXES`` (dp, cp, pp, tp): ``a`` (its size), ``a_rank`` (this rank's
    coordinate) and ``a_group`` (this rank's :class:`~kuangchao_core.comm.CommGroup`, None where the axis is not
    built: ``cp`` at one rank); ``k_group`` for each joint kind it builds (``dp_cp``); ``rank``,
    ``world_size``, ``layout`` (the :class:`MeshLayout`). Construction is collective: every rank of the job must
    build the mesh.
    """

    def __init__(
        self,
        sizes: Mapping[str, int] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        backend: str = "auto",
        timeout_ms: int = 300_000,
        node_of_rank: list[int] | None = None,
        hierarchical: str = "off",
        **axis_sizes: int,
    ) -> None:
        import torch.distributed as dist

        if rank is None or world_size is None:
            if not dist.is_initialized():
                raise PlanError(
                    [("parallel", "ParallelMesh needs rank and world_size, or an initialised process group")]
                )
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        self.layout = mesh_layout({**(sizes or {}), **axis_sizes}, world_size)
        if not 0 <= rank < world_size:
            raise PlanError([("parallel", f"rank {rank} is outside [0, world size {world_size})")])
        self.rank, self.world_size = rank, world_size
        self.backend, self.timeout_ms = backend, timeout_ms
        coords = self.layout.coords_of(rank)
        for axis in table.AXES:
            setattr(self, axis, self.layout.sizes[axis])
            setattr(self, f"{axis}_rank", coords.get(axis, 0))
        for axis in table.AXES:
            setattr(self, f"{axis}_group", None)  # an axis the mesh does not build (``layout.kinds()``) has none
        self.node_of_rank = list(node_of_rank) if node_of_rank is not None else [0] * world_size
        self.dp_intra_group = self.dp_inter_group = None
        attr = {"dpn": "dp_intra_group", "dpx": "dp_inter_group"}
        for kind, ranks in mesh_group_lists(self.layout, self.node_of_rank, hierarchical):  # every rank, in order
            group = self._build(kind, ranks)
            if rank in ranks:
                setattr(self, attr.get(kind, f"{kind}_group"), group)

    def _build(self, kind: str, ranks: list[int]):
        from kuangchao_core.comm import CommGroup

        # construction is collective: every rank builds every group, members or not
        return CommGroup(ranks, backend=self.backend, timeout_ms=self.timeout_ms, name=group_name(kind, ranks))

    @classmethod
    def from_config(
        cls,
        parallel_cfg: Any,
        rank: int | None = None,
        world_size: int | None = None,
        backend: str | None = None,
        node_of_rank: list[int] | None = None,
    ) -> ParallelMesh:
        """Build the mesh from the job config's ``parallel`` section (object or dict); ``node_of_rank`` (the node
        index of every rank) decides whether DP gradients are reduced hierarchically."""
        return cls(
            MeshAxes.from_parallel(parallel_cfg).sizes,
            rank=rank,
            world_size=world_size,
            backend=backend or setting(parallel_cfg, "backend", "auto"),
            timeout_ms=int(setting(parallel_cfg, "timeout_ms", 300_000)),
            node_of_rank=node_of_rank,
            hierarchical=str(setting(parallel_cfg, "hierarchical_allreduce", "off")),
        )

    def reduce_groups(self, replica_axes: tuple[str, ...], apart: Mapping[str, str] | None = None) -> ReduceGroups:
        """The groups GradSync reduces over when every parameter is averaged over ``replica_axes`` (a placement
        record's :meth:`~kuangchao_core.parallel.placement.PlacementRecord.replica_axes`: dp, and cp when it
        has more than one rank, whose ranks train the same replica on their slices of the sequences), but those
        held apart (``PlacementRecord.apart``: name -> the group kind of the ranks holding the same values)."""
        axes = tuple(a for a in replica_axes if table.axis(a).built or getattr(self, a) > 1)
        group = getattr(self, f"{'_'.join(axes)}_group")
        alone = group is self.dp_group  # the hierarchical subgroups split DP groups only
        sub = (self.dp_intra_group, self.dp_inter_group) if alone else (None, None)
        held = {name: getattr(self, f"{kind}_group") for name, kind in (apart or {}).items()}
        # an axis within another holds parts of the model besides its copies: the norm sums over it too
        within = tuple(getattr(self, f"{a.name}_group") for a in table.TABLE if a.within and getattr(self, a.name) > 1)
        return ReduceGroups(group, self.tp_group, self.pp_group, *sub, held, within)

    @property
    def coords(self) -> dict[str, int]:
        """``{axis: index}`` of this process, in ``axes.AXES`` order."""
        return self.layout.coords_of(self.rank)

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the first pipeline stage."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage."""
        return self.pp_rank == self.pp - 1

    def describe(self) -> dict[str, Any]:
        """Every group's rank list (as :meth:`MeshLayout.describe`) plus this rank's coordinates and group names."""
        out = self.layout.describe()
        out["rank"] = self.rank
        kinds = self.layout.kinds()
        out["coords"] = {a: getattr(self, f"{a}_rank") for a in self.layout.shown()}
        out["mine"] = {k: getattr(self, f"{k}_group").name for k in kinds}
        return out

    def __repr__(self) -> str:
        shown = self.layout.shown()
        sizes = ", ".join(f"{a}={getattr(self, a)}" for a in shown)
        return f"ParallelMesh({sizes}, rank={self.rank}, coords={ {a: getattr(self, f'{a}_rank') for a in shown} })"


@dataclass(frozen=True)
class ReduceGroups:
    """What GradSync reduces over: ``replicas`` (the ranks holding the same parameters, whose gradients it averages
    and over which ZeRO shards), their node-local / cross-node subgroups when hierarchical (else None), the TP
    and PP groups the global gradient norm sums over, ``apart`` (parameter name -> the group of the ranks holding
    its values, a part of ``replicas``, for parameters sharded within it) and ``norm_groups`` (the groups of those
    axes, which the norm sums over too)."""

    replicas: Any
    tp_group: Any
    pp_group: Any
    intra: Any = None
    inter: Any = None
    apart: dict[str, Any] = field(default_factory=dict)
    norm_groups: tuple[Any, ...] = ()
