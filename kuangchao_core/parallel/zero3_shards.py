"""ZeRO-3's layout: a set of parameters cut by unit into padded buckets, each rank keeping its chunk of every one.

:func:`shard_units` lays the given parameters of each unit (:func:`~kuangchao_core.parallel.zero3.block_units`)
end to end in one bucket, padded to a multiple of the DP size ``N``, keeps this rank's chunk of every bucket in one
flat tensor (every replica starting from the first one's values) and empties the module's parameters (their names
and shapes stay in the layout). :class:`~kuangchao_core.parallel.zero3.Zero3Optimizer` shards the trainable
parameters so; with LoRA (:mod:`~kuangchao_core.parallel.zero3_lora`) the frozen base is a second such layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kuangchao_core.comm import primitives as comm
from kuangchao_core.errors import KuangchaoError
from kuangchao_core.parallel.zero_layout import Bucket, Slot


@dataclass
class UnitShards:
    """One bucket per unit; ``flat``: this rank's chunks, end to end (``offsets[b]``: where bucket ``b``'s starts);
    ``attrs[i]``: ``(module, attribute, index into params[i])`` of every place unit ``i``'s parameters are bound;
    ``params[i]``: unit ``i``'s ``(name, Parameter)`` in bucket order."""

    buckets: list[Bucket]
    attrs: list[list[tuple[nn.Module, str, int]]]
    params: list[list[tuple[str, nn.Parameter]]]
    flat: torch.Tensor
    offsets: list[int]

    def chunk(self, b: int) -> torch.Tensor:
        """This rank's chunk of bucket ``b`` (a view of ``flat``)."""
        return self.flat[self.offsets[b] : self.offsets[b] + self.buckets[b].chunk]


def _per_unit(units: Sequence[nn.Module], named: list[tuple[str, nn.Parameter]]):
    names = {id(p): n for n, p in named}
    owner: dict[int, int] = {}
    per_unit: list[list[tuple[str, nn.Parameter]]] = []
    all_attrs: list[list[tuple[nn.Module, str, int]]] = []
    for i, module in enumerate(units):
        params: list[tuple[str, nn.Parameter]] = []
        attrs: list[tuple[nn.Module, str, int]] = []
        for sub in module.modules():
            for attr, p in sub._parameters.items():
                if p is None or id(p) not in names:
                    continue
                if owner.setdefault(id(p), i) != i:
                    raise KuangchaoError(
                        f"ZeRO-3: parameter {names[id(p)]} is used by two units (tied embeddings?); "
                        "set model.tie_embeddings false or parallel.zero_stage 2"
                    )
                if all(q is not p for _, q in params):
                    params.append((names[id(p)], p))
                attrs.append((sub, attr, next(k for k, (_, q) in enumerate(params) if q is p)))
        per_unit.append(params)
        all_attrs.append(attrs)
    missing = [n for n, p in named if id(p) not in owner]
    if missing:
        raise KuangchaoError(f"ZeRO-3: parameters {missing[:3]} belong to no unit; they would never be gathered")
    return per_unit, all_attrs


@torch.no_grad()
def shard_units(
    units: Sequence[nn.Module], named: list[tuple[str, nn.Parameter]], group, dtype: torch.dtype, device
) -> UnitShards:
    """Shard ``named`` (each used by exactly one of ``units``) over ``group`` (module docstring); collective: every
    replica starts from the values of the group's first rank."""
    size, rank = group.size, group.rank
    per_unit, attrs = _per_unit(units, named)
    buckets: list[Bucket] = []
    start = 0
    for params in per_unit:
        total = sum(p.numel() for _, p in params)
        padded = max(1, math.ceil(total / size)) * size
        bucket = Bucket(start=start, size=padded, slots=[], chunk=padded // size)
        off = 0
        for name, p in params:
            placeholder = torch.empty(p.shape, dtype=p.dtype, device="meta")
            bucket.slots.append(Slot(name, placeholder, len(buckets), off, p.numel(), len(bucket.slots)))
            off += p.numel()
        buckets.append(bucket)
        start += padded
    offsets = [bk.start // size for bk in buckets]
    shards = UnitShards(buckets, attrs, per_unit, torch.zeros(start // size, dtype=dtype, device=device), offsets)
    for b, params in enumerate(per_unit):
        bk = buckets[b]
        full = torch.zeros(bk.size, dtype=dtype, device=device)
        for s, (_, p) in zip(bk.slots, params, strict=True):
            full[s.offset : s.offset + s.numel].copy_(p.detach().reshape(-1))
        if size > 1:  # every replica starts from the first one's values
            comm.broadcast(full, src=group.ranks[0], group=group)
        shards.chunk(b).copy_(full[rank * bk.chunk : (rank + 1) * bk.chunk])
        for _, p in params:
            p.data = torch.empty(0, dtype=dtype, device=device)
    return shards
