"""The vision encoder's groups inside the job's mesh (issue 31, ``model.vision.parallel``).

The decoder's TP group of ``t`` ranks is cut into ``t / e`` encoder TP groups of ``e`` consecutive ranks
(``e`` = ``model.vision.tensor_parallel_size``; 1 under ``parallel: data``). Each encoder TP group runs one split
copy of the tower (:mod:`kuangchao_core.models.vision_tp`) on its share of a micro-batch's images; the ranks at the
same place of the ``t / e`` encoder TP groups form a *share group*: they hold the same slices, encode different
images, all-gather their features for the decoder and sum their encoder gradients (so, with the DP reduction, the
gradients are reduced over exactly the ranks that replicate each slice). ``e = t``: no share group (every rank of
the TP group encodes every image); ``e = 1`` (the ``data`` layout): the share group is the decoder's TP group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kuangchao_core.axes import group_name
from kuangchao_core.config.vision_schema import encoder_tp_size, vision_layout_errors
from kuangchao_core.errors import PlanError


@dataclass
class EncoderLayout:
    """This rank's encoder groups: ``tp_group`` splits the tower (None: whole), ``share_group`` shares the images
    (None: this rank encodes all of them); ``tp`` is the encoder's TP size, ``shares`` the share group's size."""

    tp: int
    tp_group: Any = None
    share_group: Any = None
    shares: int = 1


def encoder_group_lists(tp_groups: list[list[int]], e: int) -> tuple[list[list[int]], list[list[int]]]:
    """(encoder TP groups, share groups) of the decoder's ``tp_groups`` for an encoder TP size ``e`` that divides
    them: consecutive runs of ``e`` ranks, and the ranks at the same place of each run."""
    tps, shares = [], []
    for ranks in tp_groups:
        runs = [ranks[i : i + e] for i in range(0, len(ranks), e)]
        tps.extend(runs)
        shares.extend([run[j] for run in runs] for j in range(e))
    return tps, shares


def encoder_group_plan(section: Any, tp_groups: list[list[int]]) -> list[tuple[str, list[int]]]:
    """The groups :func:`encoder_layout` builds for ``model.vision`` ``section`` over the decoder's ``tp_groups``, as
    ``(kind, ranks)`` in construction order: ``vtp`` then ``vshare`` groups when ``1 < e < t``, else none (the
    decoder's TP group serves, or no group is needed). ``kc plan`` lists the encoder's communicators from it."""
    t = len(tp_groups[0]) if tp_groups else 1
    e = encoder_tp_size(section, t)
    if t == 1 or e in (1, t):
        return []
    tps, shares = encoder_group_lists(tp_groups, e)
    return [("vtp", r) for r in tps] + [("vshare", r) for r in shares]


def encoder_layout(section: Any, mesh: Any) -> EncoderLayout:
    """The encoder's groups for ``model.vision`` ``section`` in ``mesh`` (a
    :class:`~kuangchao_core.parallel.mesh.ParallelMesh`). Collective when new groups are needed (``1 < e <
    tp``): every rank builds every group of :func:`encoder_group_plan`, in the same order. Raises PlanError naming
    ``model.vision.…`` when the layout does not fit."""
    t = mesh.tp
    errors = vision_layout_errors(section, t)
    if errors:
        raise PlanError(errors)
    e = encoder_tp_size(section, t)
    if t == 1:
        return EncoderLayout(1)
    if e == 1:
        return EncoderLayout(1, None, mesh.tp_group, t)
    if e == t:
        return EncoderLayout(e, mesh.tp_group, None, 1)
    from kuangchao_core.comm import CommGroup

    mine: dict[str, Any] = {}
    for kind, ranks in encoder_group_plan(section, mesh.layout.groups("tp")):  # all of them, on every rank
        group = CommGroup(ranks, backend=mesh.backend, timeout_ms=mesh.timeout_ms, name=group_name(kind, ranks))
        if mesh.rank in ranks:
            mine[kind] = group
    return EncoderLayout(e, mine["vtp"], mine["vshare"], t // e)
