"""Expert parallelism in the built model (issue 40 item 2): the axis ``ep`` (``parallel.expert_parallel_size``, in
``axes.TABLE``, carved out of the data-parallel ranks) shards every MoE block's experts.

Every rank builds and initialises all the experts, as one process does; :func:`place_experts` then keeps this
rank's ``E / ep`` of them (``models.moe_dispatch``), records the slice they are of the full tensors (``regions``)
and their placement ``Shard(0, ep)`` on ``ep``, from which GradSync sums their gradients over the ranks holding
the same experts only (``PlacementRecord.apart``). The other parameters stay replicated over the whole dp.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kuangchao_core.models.layout import Region
from kuangchao_core.models.moe import MoeBlock
from kuangchao_core.models.moe_dispatch import ExpertShard, shard_experts
from kuangchao_core.parallel.placement import PlacementRecord, Shard

AXIS = "ep"
WEIGHTS = ("w_gate", "w_up", "w_down")


def place_experts(model: nn.Module, regions: dict[str, Region], placement: PlacementRecord, mesh: Any) -> None:
    """Shard the experts of ``model``'s MoE blocks over ``mesh``'s ep group (nothing at one rank), updating
    ``regions`` and ``placement`` in place."""
    size = getattr(mesh, AXIS, 1)
    if size == 1:
        return
    group = getattr(mesh, f"{AXIS}_group")
    for prefix, block in model.named_modules():
        if not isinstance(block, MoeBlock):
            continue
        shard = ExpertShard(group, block.cfg.num_experts)
        shard_experts(block.experts, shard)
        for w in WEIGHTS:
            name = f"{prefix}.experts.{w}"
            regions[name] = Region.split(regions[name].full_shape, 0, shard.first, shard.local)
            placement.params[name][AXIS] = Shard(0, size)
