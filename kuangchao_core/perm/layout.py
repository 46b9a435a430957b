"""Which modules a job has and what each one's token may name (used by the ``issue_tokens`` task).

Group names: the world group is ``world``; a parallel group is named by its kind and sorted member ranks,
``dp[0,2]``, ``tp[0,1]``, ``pp[0,4]``, ``cp[0,2]`` (:func:`~kuangchao_core.axes.group_name`), so a token can
list exactly the groups its rank belongs to before any group exists. The rank lists are the mesh's own
(:class:`~kuangchao_core.parallel.mesh.MeshLayout`, which reads ``kuangchao_core.axes``): one rank formula, so
tokens always grant the groups the mesh builds.
"""

from __future__ import annotations

from collections.abc import Mapping

from kuangchao_core.axes import group_name
from kuangchao_core.data.dataset import dataset_name
from kuangchao_core.parallel.mesh import MeshLayout, dp_subgroups
from kuangchao_core.perm.names import is_canonical_value

#: memory regions the HAL names (``memory_alloc(..., region=...)``); a trainer token grants all of them
DEFAULT_REGIONS = ("activations", "buffers", "comm", "grads", "optim", "params", "workspace")


__all__ = ["DEFAULT_REGIONS", "dataset_resource_name", "group_layout", "group_name", "groups_of_rank"]


def group_layout(
    sizes: Mapping[str, int], node_of_rank: list[int] | None = None, hierarchical: str = "off"
) -> dict[str, list[int]]:
    """Every group of the job whose mesh has ``sizes`` (``{axis: size}``): name -> global ranks (``world`` and
    ``host`` — every rank, for device tensors and for host coordination — plus every group the mesh builds, of each
    kind of ``MeshLayout.kinds()``, and the DP groups' node-local ``dpn`` / cross-node ``dpx`` subgroups when the
    hierarchical all-reduce applies)."""
    mesh = MeshLayout(sizes)
    every = list(range(mesh.world_size))
    groups: dict[str, list[int]] = {"world": every, "host": list(every)}
    groups.update(mesh.named_groups())
    for kind, ranks in dp_subgroups(mesh, node_of_rank, hierarchical):
        groups[group_name(kind, ranks)] = list(ranks)
    return groups


def groups_of_rank(layout: dict[str, list[int]], rank: int) -> list[str]:
    """Names of the groups ``rank`` belongs to."""
    return sorted(name for name, ranks in layout.items() if rank in ranks)


def dataset_resource_name(data_cfg) -> str | None:
    """The ``dataset:<name>`` value the data layer checks (``synthetic`` or the configured path), if canonical."""
    name = dataset_name(data_cfg)
    return name if is_canonical_value("dataset", name) else None
