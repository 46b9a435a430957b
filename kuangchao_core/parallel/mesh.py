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

from dataclasses import dataclass
from typing import Any

from kuangchao_core.axes import MeshAxes, group_name, validated
from kuangchao_core.config.access import setting
from kuangchao_core.errors import PlanError

__all__ = [
    "MeshLayout",
    "ParallelMesh",
    "ReduceGroups",
    "coords_of",
    "dp_subgroups",
    "group_name",
    "mesh_group_lists",
    "mesh_layout",
    "rank_of",
    "validate_sizes",
]


def validate_sizes(dp: int, tp: int, pp: int, world_size: int | None = None, cp: int = 1) -> None:
    """Raise PlanError (every number shown) unless dp, tp, pp, cp are >= 1 and dp*cp*tp*pp equals ``world_size``."""
    validated({"dp": dp, "tp": tp, "pp": pp, "cp": cp}, world_size)


def rank_of(dp_idx: int, pp_idx: int, tp_idx: int, tp: int, pp: int) -> int:
    """Global rank at mesh coordinates (dp_idx, pp_idx, tp_idx) of a mesh without CP (``axes.MeshAxes.rank_of``)."""
    return MeshAxes(dp=dp_idx + 1, pp=pp, tp=tp).rank_of(dp=dp_idx, pp=pp_idx, tp=tp_idx)


def coords_of(rank: int, tp: int, pp: int, cp: int = 1) -> tuple[int, int, int]:
    """Mesh coordinates (dp_rank, tp_rank, pp_rank) of a global rank (``axes.MeshAxes.coords_of``)."""
    at = MeshAxes(dp=rank + 1, cp=cp, pp=pp, tp=tp).coords_of(rank)  # dp: any size that holds the rank
    return at["dp"], at["tp"], at["pp"]


@dataclass(frozen=True)
class MeshLayout:
    """Rank lists of every group of a dp x cp x pp x tp layout (pure arithmetic, :class:`~kuangchao_core.axes.MeshAxes`;
    no process groups)."""

    dp: int
    tp: int
    pp: int
    cp: int = 1

    @property
    def axes(self) -> MeshAxes:
        """The grid of named axes."""
        return MeshAxes(dp=self.dp, cp=self.cp, pp=self.pp, tp=self.tp)

    @property
    def world_size(self) -> int:
        """Processes the layout needs."""
        return self.axes.world_size

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` (``tp``, ``pp``, ``dp``, ``cp``); index i is group ``<kind>{i}``."""
        return self.axes.groups(kind)

    def kinds(self) -> tuple[str, ...]:
        """The group kinds the mesh builds, in construction order (``cp`` only when ``cp > 1``)."""
        return self.axes.active()

    def tp_groups(self) -> list[list[int]]:
        """One TP group per (dp, cp, pp) position, consecutive ranks; index i is group ``tp{i}``."""
        return self.groups("tp")

    def pp_groups(self) -> list[list[int]]:
        """One PP group per (dp, cp, tp) position, stages in order; index i is group ``pp{i}``."""
        return self.groups("pp")

    def dp_groups(self) -> list[list[int]]:
        """One DP group per (cp, pp, tp) position; index i is group ``dp{i}``."""
        return self.groups("dp")

    def cp_groups(self) -> list[list[int]]:
        """One CP group per (dp, pp, tp) position, sequence slices in order; index i is group ``cp{i}``."""
        return self.groups("cp")

    def describe(self) -> dict[str, Any]:
        """Sizes and every group's rank list, keyed by group name (``cp`` only when ``cp > 1``)."""
        kinds = self.axes.active(("tp", "pp", "dp", "cp"))
        sizes = {"dp": self.dp, "tp": self.tp, "pp": self.pp, **({"cp": self.cp} if "cp" in kinds else {})}
        return {
            "sizes": {**sizes, "world_size": self.world_size},
            **{f"{kind}_groups": self.axes.indexed_groups(kind) for kind in kinds},
        }


def dp_subgroups(layout: MeshLayout, node_of_rank: list[int] | None, mode: str) -> list[tuple[str, list[int]]]:
    """The node-local (``dpn``) and cross-node (``dpx``) subgroups of every DP group, in construction order, when
    the hierarchical all-reduce applies (``mode``: ``parallel.hierarchical_allreduce``); empty otherwise."""
    from kuangchao_core.comm.hierarchical import subgroup_lists, use_hierarchical

    nodes = list(node_of_rank) if node_of_rank is not None else [0] * layout.world_size
    groups = layout.dp_groups()
    if not use_hierarchical(mode, groups, nodes):
        return []
    return [("dpn" if kind == "n" else "dpx", ranks) for kind, ranks in subgroup_lists(groups, nodes)]


def mesh_group_lists(
    layout: MeshLayout, node_of_rank: list[int] | None = None, hierarchical: str = "off"
) -> list[tuple[str, list[int]]]:
    """Every group :class:`ParallelMesh` builds, as ``(kind, ranks)`` in construction order: the groups of each of
    ``layout.kinds()`` (tp, pp, dp, then cp and dp_cp), then the DP groups' ``dpn`` / ``dpx`` subgroups when the
    hierarchical all-reduce applies. The mesh builds exactly this list and ``kc plan`` lists its communicators
    from it (``engine.plan_comms``)."""
    out = [(kind, list(ranks)) for kind in layout.kinds() for ranks in layout.groups(kind)]
    return out + dp_subgroups(layout, node_of_rank, hierarchical)


def mesh_layout(dp: int, tp: int, pp: int, world_size: int | None = None, cp: int = 1) -> MeshLayout:
    """Validated layout of a dp x cp x pp x tp mesh (raises PlanError with every number)."""
    validate_sizes(dp, tp, pp, world_size, cp)
    return MeshLayout(dp, tp, pp, cp)


class ParallelMesh:
    """This process's place in a dp x cp x pp x tp mesh, and the communication groups it belongs to.

    Attributes: ``dp``, ``tp``, ``pp``, ``cp`` (sizes), ``rank``, ``world_size``, ``dp_rank``, ``tp_rank``,
    ``pp_rank``, ``cp_rank`` (coordinates), ``tp_group``, ``pp_group``, ``dp_group``, ``cp_group`` (this rank's
    :class:`~kuangchao_core.comm.CommGroup`; ``cp_group`` is None at ``cp`` 1, where no CP group is built),
    ``layout`` (the :class:`MeshLayout`). Construction is collective: every rank of the job must build the mesh.
    """

    def __init__(
        self,
        dp: int,
        tp: int,
        pp: int,
        rank: int | None = None,
        world_size: int | None = None,
        backend: str = "auto",
        timeout_ms: int = 300_000,
        node_of_rank: list[int] | None = None,
        hierarchical: str = "off",
        cp: int = 1,
    ) -> None:
        import torch.distributed as dist

        if rank is None or world_size is None:
            if not dist.is_initialized():
                raise PlanError(
                    [("parallel", "ParallelMesh needs rank and world_size, or an initialised process group")]
                )
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        self.layout = mesh_layout(dp, tp, pp, world_size, cp)
        if not 0 <= rank < world_size:
            raise PlanError([("parallel", f"rank {rank} is outside [0, world size {world_size})")])
        self.dp, self.tp, self.pp, self.cp = dp, tp, pp, cp
        self.rank, self.world_size = rank, world_size
        self.backend, self.timeout_ms = backend, timeout_ms
        at = self.layout.axes.coords_of(rank)
        self.dp_rank, self.cp_rank, self.pp_rank, self.tp_rank = at["dp"], at["cp"], at["pp"], at["tp"]
        self.cp_group = None  # no CP group at cp 1 (the mesh builds the groups of ``layout.kinds()``)
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
            int(setting(parallel_cfg, "data_parallel_size", 1)),
            int(setting(parallel_cfg, "tensor_parallel_size", 1)),
            int(setting(parallel_cfg, "pipeline_parallel_size", 1)),
            rank=rank,
            world_size=world_size,
            backend=backend or setting(parallel_cfg, "backend", "auto"),
            timeout_ms=int(setting(parallel_cfg, "timeout_ms", 300_000)),
            node_of_rank=node_of_rank,
            hierarchical=str(setting(parallel_cfg, "hierarchical_allreduce", "off")),
            cp=int(setting(parallel_cfg, "context_parallel_size", 1) or 1),
        )

    def reduce_groups(self, replica_axes: tuple[str, ...]) -> ReduceGroups:
        """The groups GradSync reduces over when every parameter is averaged over ``replica_axes`` (a placement
        record's :meth:`~kuangchao_core.parallel.placement.PlacementRecord.replica_axes`: dp, and cp when it
        has more than one rank, whose ranks train the same replica on their slices of the sequences)."""
        axes = tuple(a for a in replica_axes if a == "dp" or getattr(self, a) > 1)
        group = getattr(self, f"{'_'.join(axes)}_group")
        alone = group is self.dp_group  # the hierarchical subgroups split DP groups only
        sub = (self.dp_intra_group, self.dp_inter_group) if alone else (None, None)
        return ReduceGroups(group, self.tp_group, self.pp_group, *sub)

    @property
    def coords(self) -> tuple[int, int, int]:
        """(dp_rank, tp_rank, pp_rank) of this process."""
        return self.dp_rank, self.tp_rank, self.pp_rank

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
        out["coords"] = {k: getattr(self, f"{k}_rank") for k in ("dp", "tp", "pp", "cp") if k in kinds}
        out["mine"] = {k: getattr(self, f"{k}_group").name for k in kinds}
        return out

    def __repr__(self) -> str:
        return (
            f"ParallelMesh(dp={self.dp}, tp={self.tp}, pp={self.pp}{f', cp={self.cp}' if self.cp > 1 else ''}, "
            f"rank={self.rank}, coords(dp,tp,pp)={self.coords}{f', cp_rank={self.cp_rank}' if self.cp > 1 else ''})"
        )


@dataclass(frozen=True)
class ReduceGroups:
    """What GradSync reduces over: ``replicas`` (the ranks holding the same parameters, whose gradients it averages
    and over which ZeRO shards), their node-local / cross-node subgroups when hierarchical (else None), and the TP
    and PP groups the global gradient norm sums over."""

    replicas: Any
    tp_group: Any
    pp_group: Any
    intra: Any = None
    inter: Any = None
