"""Context parallelism's sequence layout: every sequence split over the CP ranks, balanced for causal attention.

A sequence of ``s`` tokens is cut into ``2·cp`` equal chunks of ``c = s / (2·cp)`` tokens; CP rank ``r`` holds chunk
``r`` and its mirror ``2·cp-1-r``, in that order (one from the front, one from the back). Under a causal mask a
query at global position ``p`` attends to ``p + 1`` keys, so chunk ``i`` costs ``c·i·c + c(c+1)/2`` query-key pairs
and a mirrored pair ``c²(2·cp-1) + c(c+1)``, the same for every rank (:func:`causal_pairs`): no rank waits for the
one holding the end of the sequence, as it would with contiguous slices (rank ``cp-1`` would do ``2·cp-1`` times
rank 0's work).

Every (batch, seq, ...) tensor of a batch is sharded the same way (:func:`shard_sequence`, :func:`shard_inputs`):
input ids, labels (already shifted by the data pipeline, so aligned with the inputs), rotary ``position_ids`` and
packed documents' ``segment_ids``. Attention needs each local token's global position for the causal mask
(:func:`local_positions`); rotary embeddings need the sharded ``position_ids`` (the global positions themselves
when the batch has none). :func:`gather_sequence` puts a sharded tensor back in sequence order over the CP group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kuangchao_core.comm import primitives as P
from kuangchao_core.comm.group import CommGroup
from kuangchao_core.errors import PlanError

#: the batch entries :func:`shard_inputs` shards along the sequence (dim 1)
SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "segment_ids")


def chunk_size(seq_len: int, cp: int) -> int:
    """Tokens per chunk, ``seq_len / (2·cp)``; a ``PlanError`` unless ``seq_len`` divides into ``2·cp`` chunks."""
    if cp < 1:
        raise PlanError([("parallel.context_parallel_size", f"must be at least 1, got {cp}")])
    if seq_len <= 0 or seq_len % (2 * cp):
        raise PlanError(
            [
                (
                    "data.seq_len",
                    f"context parallelism over {cp} ranks splits each sequence into 2*{cp} = {2 * cp} equal chunks, "
                    f"but the sequence has {seq_len} tokens; use a sequence length divisible by {2 * cp}",
                )
            ]
        )
    return seq_len // (2 * cp)


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks CP rank ``rank`` holds, in local order: ``(rank, 2·cp-1-rank)``."""
    if not 0 <= rank < cp:
        raise PlanError([("parallel.context_parallel_size", f"CP rank {rank} is outside 0..{cp - 1}")])
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions (0-based, sequence order) of rank ``rank``'s ``seq_len / cp`` tokens, in local order."""
    c = chunk_size(seq_len, cp)
    a, b = chunk_ids(cp, rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` along ``dim`` (the sequence): its two chunks, concatenated (a new tensor)."""
    c = chunk_size(x.shape[dim], cp)
    a, b = chunk_ids(cp, rank)
    return torch.cat([x.narrow(dim, a * c, c), x.narrow(dim, b * c, c)], dim=dim)


def unshard_shards(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every CP rank's shard (``shards[r]`` from rank ``r``): the inverse of
    :func:`shard_sequence`."""
    cp = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    ordered = [halves[i][0] for i in range(cp)] + [halves[cp - 1 - j][1] for j in range(cp)]
    return torch.cat(ordered, dim=dim)


def gather_sequence(local: torch.Tensor, group: CommGroup, dim: int = 1) -> torch.Tensor:
    """Collective over the CP ``group``: every rank's shard gathered and put back in sequence order (the same full
    tensor on every member). Not differentiable: for evaluation, decoding and tests."""
    parts = P.all_gather(None, local.contiguous(), group=group)
    return unshard_shards(parts, dim=dim)


def causal_pairs(seq_len: int, cp: int, rank: int) -> int:
    """Query-key pairs a causal mask keeps for rank ``rank``'s queries (a query at position ``p`` sees ``p + 1``
    keys): the attention work of that rank, equal on every rank."""
    return int((local_positions(seq_len, cp, rank) + 1).sum())


def shard_inputs(batch: Mapping[str, torch.Tensor], cp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of a batch: every :data:`SEQUENCE_KEYS` entry sharded along the sequence; without
    ``position_ids`` the rotary positions are the tokens' global positions (one sequence per row), so each rank
    rotates its tokens as the full sequence would. Other entries are kept as they are."""
    out = dict(batch)
    ids = batch["input_ids"]
    if "position_ids" not in batch:
        out["position_ids"] = local_positions(ids.shape[1], cp, rank, ids.device).expand(ids.shape[0], -1)
    for key in SEQUENCE_KEYS:
        if key in batch:
            out[key] = shard_sequence(batch[key], cp, rank, dim=1)
    return out


def shard_micro_batches(batches: Sequence[Mapping[str, torch.Tensor]], mesh) -> list:
    """This rank's shard (:func:`shard_inputs`) of each micro-batch its DP replica read, at ``mesh.cp > 1`` (every
    CP rank of a replica reads the same micro-batches); the batches as they are at cp 1."""
    if getattr(mesh, "cp", 1) == 1:
        return list(batches)
    return [shard_inputs(b, mesh.cp, mesh.cp_rank) for b in batches]
