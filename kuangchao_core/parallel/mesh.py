"""The device mesh (SPEC L3.4): one object, built once from the config, that owns every TP, PP and DP group.

Ranks are laid out with tensor parallelism innermost (consecutive ranks, the fastest links), then pipeline, then
data parallelism::

    rank = dp_idx * (pp * tp) + pp_idx * tp + tp_idx

Every process constructs every group, in the same order (all TP groups, then all PP groups, then all DP groups),
because group construction is collective. The mesh is passed explicitly to whoever needs a group; there are no
module-level globals. :func:`mesh_layout` computes the same rank lists without any process group (for ``kc plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kuangchao_core.config.access import setting
from kuangchao_core.errors import PlanError


def validate_sizes(dp: int, tp: int, pp: int, world_size: int | None = None) -> None:
    """Raise PlanError (every number shown) unless dp, tp, pp are >= 1 and dp*tp*pp equals ``world_size``."""
    errors: list[tuple[str, str]] = []
    for key, value in (("data_parallel_size", dp), ("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(value, int) or value < 1:
            errors.append((f"parallel.{key}", f"must be an integer >= 1, got {value!r}"))
    if not errors and world_size is not None and dp * tp * pp != world_size:
        errors.append(
            (
                "parallel",
                f"data_parallel_size {dp} x tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {dp * tp * pp}"
                f" processes, but the world size is {world_size}; change the sizes so their product is {world_size}"
                f" or launch {dp * tp * pp} processes",
            )
        )
    if errors:
        raise PlanError(errors)


def rank_of(dp_idx: int, pp_idx: int, tp_idx: int, tp: int, pp: int) -> int:
    """Global rank at mesh coordinates (dp_idx, pp_idx, tp_idx) — TP innermost, then PP, then DP."""
    return dp_idx * (pp * tp) + pp_idx * tp + tp_idx


def group_name(kind: str, ranks) -> str:
    """The canonical name of a parallel group, ``<kind>[<sorted ranks>]`` (``tp[0,1]``), as tokens list it."""
    return f"{kind}[{','.join(str(r) for r in sorted(int(r) for r in ranks))}]"


def coords_of(rank: int, tp: int, pp: int) -> tuple[int, int, int]:
    """Mesh coordinates (dp_rank, tp_rank, pp_rank) of a global rank."""
    return rank // (pp * tp), rank % tp, (rank // tp) % pp


@dataclass(frozen=True)
class MeshLayout:
    """Rank lists of every group of a dp x tp x pp layout (pure arithmetic; no process groups)."""

    dp: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        """Processes the layout needs."""
        return self.dp * self.tp * self.pp

    def tp_groups(self) -> list[list[int]]:
        """One TP group per (dp, pp) position, consecutive ranks; index i is group ``tp{i}``."""
        return [
            [rank_of(d, p, t, self.tp, self.pp) for t in range(self.tp)] for d in range(self.dp) for p in range(self.pp)
        ]

    def pp_groups(self) -> list[list[int]]:
        """One PP group per (dp, tp) position, stages in order; index i is group ``pp{i}``."""
        return [
            [rank_of(d, p, t, self.tp, self.pp) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)
        ]

    def dp_groups(self) -> list[list[int]]:
        """One DP group per (pp, tp) position; index i is group ``dp{i}``."""
        return [
            [rank_of(d, p, t, self.tp, self.pp) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)
        ]

    def describe(self) -> dict[str, Any]:
        """Sizes and every group's rank list, keyed by group name."""
        return {
            "sizes": {"dp": self.dp, "tp": self.tp, "pp": self.pp, "world_size": self.world_size},
            "tp_groups": {f"tp{i}": g for i, g in enumerate(self.tp_groups())},
            "pp_groups": {f"pp{i}": g for i, g in enumerate(self.pp_groups())},
            "dp_groups": {f"dp{i}": g for i, g in enumerate(self.dp_groups())},
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


def mesh_layout(dp: int, tp: int, pp: int, world_size: int | None = None) -> MeshLayout:
    """Validated layout of a dp x tp x pp mesh (raises PlanError with every number)."""
    validate_sizes(dp, tp, pp, world_size)
    return MeshLayout(dp, tp, pp)


class ParallelMesh:
    """This process's place in a dp x tp x pp mesh, and the communication groups it belongs to.

    Attributes: ``dp``, ``tp``, ``pp`` (sizes), ``rank``, ``world_size``, ``dp_rank``, ``tp_rank``, ``pp_rank``
    (coordinates), ``tp_group``, ``pp_group``, ``dp_group`` (this rank's :class:`~kuangchao_core.comm.CommGroup`),
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
    ) -> None:
        import torch.distributed as dist

        if rank is None or world_size is None:
            if not dist.is_initialized():
                raise PlanError(
                    [("parallel", "ParallelMesh needs rank and world_size, or an initialised process group")]
                )
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        self.layout = mesh_layout(dp, tp, pp, world_size)
        if not 0 <= rank < world_size:
            raise PlanError([("parallel", f"rank {rank} is outside [0, world size {world_size})")])
        self.dp, self.tp, self.pp = dp, tp, pp
        self.rank, self.world_size = rank, world_size
        self.backend, self.timeout_ms = backend, timeout_ms
        self.dp_rank, self.tp_rank, self.pp_rank = coords_of(rank, tp, pp)
        self.tp_group = self._build("tp", self.layout.tp_groups())
        self.pp_group = self._build("pp", self.layout.pp_groups())
        self.dp_group = self._build("dp", self.layout.dp_groups())
        self.node_of_rank = list(node_of_rank) if node_of_rank is not None else [0] * world_size
        self.dp_intra_group = self.dp_inter_group = None
        if dp_subgroups(self.layout, self.node_of_rank, hierarchical):
            self._build_dp_subgroups()

    def _build_dp_subgroups(self) -> None:
        from kuangchao_core.comm import CommGroup

        for kind, ranks in dp_subgroups(self.layout, self.node_of_rank, "on"):
            group = CommGroup(ranks, backend=self.backend, timeout_ms=self.timeout_ms, name=group_name(kind, ranks))
            if self.rank in ranks:
                if kind == "dpn":
                    self.dp_intra_group = group
                else:
                    self.dp_inter_group = group

    def _build(self, kind: str, groups: list[list[int]]):
        from kuangchao_core.comm import CommGroup

        mine = None
        for ranks in groups:  # all of them, in order, on every rank: construction is collective
            group = CommGroup(ranks, backend=self.backend, timeout_ms=self.timeout_ms, name=group_name(kind, ranks))
            if self.rank in ranks:
                mine = group
        return mine

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
        )

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
        out["coords"] = {"dp": self.dp_rank, "tp": self.tp_rank, "pp": self.pp_rank}
        out["mine"] = {"tp": self.tp_group.name, "pp": self.pp_group.name, "dp": self.dp_group.name}
        return out

    def __repr__(self) -> str:
        return (
            f"ParallelMesh(dp={self.dp}, tp={self.tp}, pp={self.pp}, rank={self.rank}, coords(dp,tp,pp)={self.coords})"
        )
