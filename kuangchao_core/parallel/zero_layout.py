"""Where every parameter sits in ZeRO's flat buffer (SPEC L3.5): buckets, slots, and the ranges each DP rank owns.

Trainable parameters are taken in *reverse registration order* (roughly the order backward produces their
gradients) and cut into buckets of at most ``cap`` elements. Each bucket is padded to a multiple of the DP size
``N`` and split into ``N`` equal chunks; DP rank ``r`` owns chunk ``r`` of every bucket. Pure bookkeeping: no
tensors are allocated here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from kuangchao_core.errors import KuangchaoError


@dataclass
class Slot:
    """One parameter's place: ``numel`` elements from ``offset`` inside bucket ``bucket``."""

    name: str
    param: torch.nn.Parameter
    bucket: int
    offset: int  # start inside the bucket
    numel: int
    index: int  # position inside the bucket's slot list


@dataclass
class Bucket:
    """``size`` elements (padded to a multiple of N) from ``start`` of the flat buffer, cut into N chunks."""

    start: int  # start inside the flat buffer
    size: int  # padded size (multiple of N)
    slots: list[Slot]
    chunk: int  # size // N; DP rank r owns [r * chunk, (r + 1) * chunk) of the bucket


def named_trainable(params) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every distinct parameter that requires a gradient (plain ones named ``param_<i>``)."""
    items = list(params)
    if not items:
        raise KuangchaoError("ZeroOptimizer: got no parameters; pass model.parameters() or model.named_parameters()")
    if isinstance(items[0], tuple):
        named = [(str(n), p) for n, p in items]
    else:
        named = [(f"param_{i}", p) for i, p in enumerate(items)]
    seen: set[int] = set()
    out = []
    for n, p in named:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        out.append((n, p))
    if not out:
        raise KuangchaoError("ZeroOptimizer: none of the given parameters requires a gradient; nothing to optimize")
    return out


def plan_buckets(
    named: Iterable[tuple[str, torch.nn.Parameter]], cap: int, dp_size: int
) -> tuple[list[Bucket], list[Slot]]:
    """Buckets of at most ``cap`` elements (a larger parameter gets a bucket of its own) and every slot, in order."""
    groups: list[list[tuple[str, torch.nn.Parameter]]] = []
    current: list[tuple[str, torch.nn.Parameter]] = []
    count = 0
    for name, p in reversed(list(named)):
        if current and count + p.numel() > cap:
            groups.append(current)
            current, count = [], 0
        current.append((name, p))
        count += p.numel()
    groups.append(current)
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    start = 0
    for params in groups:
        total = sum(p.numel() for _, p in params)
        padded = math.ceil(total / dp_size) * dp_size
        bucket = Bucket(start=start, size=padded, slots=[], chunk=padded // dp_size)
        off = 0
        for name, p in params:
            slot = Slot(name=name, param=p, bucket=len(buckets), offset=off, numel=p.numel(), index=len(bucket.slots))
            bucket.slots.append(slot)
            slots.append(slot)
            off += p.numel()
        buckets.append(bucket)
        start += padded
    return buckets, slots


def pieces_of(buckets: Iterable[Bucket], rank: int) -> list[tuple[Slot, int, int, int]]:
    """``(slot, lo, hi, chunk_off)`` for every parameter range ``[lo, hi)`` that DP rank ``rank`` owns;
    ``chunk_off`` is where it starts inside that rank's chunk of the bucket."""
    out = []
    for bk in buckets:
        c_lo, c_hi = rank * bk.chunk, (rank + 1) * bk.chunk
        for s in bk.slots:
            lo, hi = max(s.offset, c_lo), min(s.offset + s.numel, c_hi)
            if lo < hi:
                out.append((s, lo - s.offset, hi - s.offset, lo - c_lo))
    return out


def owned_sum_of_squares(
    shards: list[torch.Tensor], pieces: list[tuple[Slot, int, int, int]], weight: Mapping[str, float]
) -> torch.Tensor:
    """Sum over this rank's owned ranges (``pieces``, from :func:`pieces_of`) of the squared gradient elements in
    its ``shards`` (one per bucket), each parameter's range weighted by ``weight[name]``: a float64 scalar on the
    shards' device; padding is never counted."""
    sq = torch.zeros((), dtype=torch.float64, device=shards[0].device if shards else None)
    for slot, lo, hi, offset in pieces:
        piece = shards[slot.bucket][offset : offset + hi - lo]
        sq += piece.double().pow(2).sum() * weight[slot.name]
    return sq
