"""Which modules a job has and what each one's token may name (used by the ``issue_tokens`` task).

Group names: the world group is ``world``; a parallel group is named by its kind and sorted member ranks,
``dp[0,2]``, ``tp[0,1]``, ``pp[0,4]`` (:func:`group_name`), so a token can list exactly the groups its rank
belongs to before any group exists. Rank layout (as :mod:`kuangchao_core.parallel.mesh`): tensor-parallel fastest
(consecutive ranks), then pipeline, then data-parallel: ``rank = dp_i * (pp * tp) + pp_i * tp + tp_i``.
"""

from __future__ import annotations

from kuangchao_core.perm.names import is_canonical_value

#: memory regions the HAL names (``memory_alloc(..., region=...)``); a trainer token grants all of them
DEFAULT_REGIONS = ("activations", "buffers", "comm", "grads", "optim", "params", "workspace")


def group_name(kind: str, ranks) -> str:
    """The canonical name of a parallel group: ``<kind>[<sorted ranks>]``."""
    return f"{kind}[{','.join(str(r) for r in sorted(int(r) for r in ranks))}]"


def group_layout(dp: int, tp: int = 1, pp: int = 1) -> dict[str, list[int]]:
    """Every group of a dp×tp×pp job: name -> global ranks (``world`` plus the tp, dp and pp groups)."""
    world = dp * tp * pp

    def rank(p, d, t):
        return d * (pp * tp) + p * tp + t

    groups: dict[str, list[int]] = {"world": list(range(world))}
    for p in range(pp):
        for d in range(dp):
            ranks = [rank(p, d, t) for t in range(tp)]
            groups[group_name("tp", ranks)] = ranks
    for p in range(pp):
        for t in range(tp):
            ranks = [rank(p, d, t) for d in range(dp)]
            groups[group_name("dp", ranks)] = ranks
    for d in range(dp):
        for t in range(tp):
            ranks = [rank(p, d, t) for p in range(pp)]
            groups[group_name("pp", ranks)] = ranks
    return groups


def groups_of_rank(layout: dict[str, list[int]], rank: int) -> list[str]:
    """Names of the groups ``rank`` belongs to."""
    return sorted(name for name, ranks in layout.items() if rank in ranks)


def dataset_resource_name(data_cfg) -> str | None:
    """The ``dataset:<name>`` value the data layer checks (``synthetic`` or the configured path), if canonical."""
    try:
        from kuangchao_core.data.dataset import dataset_name

        name = dataset_name(data_cfg)
    except ImportError:  # data layer absent: synthetic is the only safe guess
        name = "synthetic"
    return name if is_canonical_value("dataset", name) else None
