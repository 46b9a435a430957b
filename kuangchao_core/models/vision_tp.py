"""The vision tower split across its own tensor-parallel group (issue 31, ``model.vision.parallel: tp``).

Megatron's plan on CLIP's encoder layers, with the decoder's building blocks
(:mod:`kuangchao_core.parallel.tensor`): in attention, q/k/v are column-parallel (each rank keeps
``num_heads / tp`` whole heads, weights and biases split by output rows) behind one copy-to-TP-region for the three,
and ``out_proj`` is row-parallel (weight split by input columns, partial results all-reduced, the bias added once
after the sum); in the MLP ``fc1`` is column-parallel and ``fc2`` row-parallel. The embeddings, the norms and the
row-parallel biases stay replicated: every TP rank computes the same hidden states, so the encoder's output is whole
on each rank and no gather follows. One all-reduce per attention block and per MLP forward, one of each backward.

:func:`shard_tower` converts a whole tower, already initialised (from the seed, or loaded), in place: each rank keeps
its slices of the full weights, so the split tower computes what the whole one computes. Parameter names do not
change; :func:`tower_regions` gives the slice of the full tensor each holds (for checkpoints, which record regions of
whole tensors and so stay layout-independent).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kuangchao_core.models.layout import Region
from kuangchao_core.models.vision import VisionAttention, VisionMLP, VisionTower
from kuangchao_core.parallel.tensor import ColumnParallelLinear, RowParallelLinear, copy_to_tp_region

#: layer kind -> how its weight is split (``column``: output rows, dim 0, bias split alike; ``row``: input columns,
#: dim 1, bias replicated); every other tower parameter is replicated
VISION_TP_PLAN = {
    "q_proj": "column",
    "k_proj": "column",
    "v_proj": "column",
    "out_proj": "row",
    "fc1": "column",
    "fc2": "row",
}


def split_dim(name: str) -> int | None:
    """The dimension a tower parameter (``encoder.layers.0.self_attn.q_proj.bias`` …) is split along, or None."""
    parts = name.split(".")
    kind = VISION_TP_PLAN.get(parts[-2]) if len(parts) >= 2 else None
    if kind == "column":
        return 0
    if kind == "row" and parts[-1] == "weight":
        return 1
    return None


class BiasedColumnLinear(ColumnParallelLinear):
    """A column-parallel copy of ``full`` (an ``nn.Linear`` with bias): this rank's output rows and their biases."""

    def __init__(self, full: nn.Linear, group: Any, copy_input: bool = True) -> None:
        w = full.weight
        super().__init__(
            full.in_features, full.out_features, group, weight=w, dtype=w.dtype, device=w.device, copy_input=copy_input
        )
        start, length = self.row_slice
        self.bias = nn.Parameter(full.bias.detach()[start : start + length].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias


class BiasedRowLinear(RowParallelLinear):
    """A row-parallel copy of ``full`` (an ``nn.Linear`` with bias): this rank's input columns; the whole bias is
    added once, after the partial results are summed."""

    def __init__(self, full: nn.Linear, group: Any) -> None:
        w = full.weight
        super().__init__(full.in_features, full.out_features, group, weight=w, dtype=w.dtype, device=w.device)
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias


class TPVisionAttention(VisionAttention):
    """:class:`VisionAttention` over this rank's heads; its input enters the TP region once for q, k and v."""

    def __init__(self, full: VisionAttention, group: Any) -> None:
        nn.Module.__init__(self)
        self.head_dim, self.group = full.head_dim, group
        self.q_proj, self.k_proj, self.v_proj = (
            BiasedColumnLinear(getattr(full, n), group, copy_input=False) for n in ("q_proj", "k_proj", "v_proj")
        )
        self.out_proj = BiasedRowLinear(full.out_proj, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(copy_to_tp_region(x, self.group))


class TPVisionMLP(VisionMLP):
    """:class:`VisionMLP` over this rank's share of the intermediate width."""

    def __init__(self, full: VisionMLP, group: Any) -> None:
        nn.Module.__init__(self)
        self.act = full.act
        self.fc1 = BiasedColumnLinear(full.fc1, group)
        self.fc2 = BiasedRowLinear(full.fc2, group)


def shard_tower(tower: VisionTower, group: Any) -> VisionTower:
    """Split ``tower``'s attention and MLP across ``group`` in place (None or one rank: left whole); returns it."""
    if group is None or group.size == 1:
        return tower
    for layer in tower.encoder.layers:
        layer.self_attn = TPVisionAttention(layer.self_attn, group)
        layer.mlp = TPVisionMLP(layer.mlp, group)
    return tower


def tower_regions(tower: VisionTower, prefix: str = "vision_tower.") -> dict[str, Region]:
    """``prefix + name`` -> the region of the full tensor this rank's parameter holds (whole when not split)."""
    out: dict[str, Region] = {}
    for name, module in tower.named_modules():
        split = isinstance(module, (BiasedColumnLinear, BiasedRowLinear)) and module.tp > 1
        for pname, p in module.named_parameters(recurse=False):
            full = Region.full(p.shape)
            if split and split_dim(f"{name}.{pname}") is not None:
                dim, start, length = module.shard_spec()
                shape = (module.out_features, module.in_features) if pname == "weight" else (module.out_features,)
                full = Region.split(shape, dim, start, length)
            out[f"{prefix}{name}.{pname}" if name else f"{prefix}{pname}"] = full
    return out
