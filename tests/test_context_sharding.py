"""Context parallelism's load-balanced sequence layout (issue 30, item 2), without processes.

Shard then unshard is the identity; each rank's tokens are its two mirrored chunks with their global positions;
every rank gets the same causal work (query-key pairs under the causal mask), where contiguous slices would give
the last rank nearly ``2·cp-1`` times the first rank's; a sequence that does not split into ``2·cp`` chunks is refused with
a message naming the fix; a batch's entries are sharded together and rotary positions default to the global ones.
"""

from __future__ import annotations

import pytest
import torch

from kuangchao_core.errors import PlanError
from kuangchao_core.parallel.context import (
    causal_pairs,
    chunk_ids,
    local_positions,
    shard_inputs,
    shard_sequence,
    unshard_shards,
)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_then_unshard_is_the_identity(cp):
    s = 8 * cp
    x = torch.arange(2 * s * 3).view(2, s, 3)
    shards = [shard_sequence(x, cp, r) for r in range(cp)]
    assert all(sh.shape == (2, s // cp, 3) for sh in shards)
    assert torch.equal(unshard_shards(shards), x)
    y = torch.randn(2, 4, s, 5)  # (batch, heads, seq, head_dim): the sequence on dim 2
    assert torch.equal(unshard_shards([shard_sequence(y, cp, r, dim=2) for r in range(cp)], dim=2), y)
    # control: shards in the wrong rank order do not give the sequence back
    if cp > 1:
        assert not torch.equal(unshard_shards(shards[::-1]), x)


def test_each_rank_holds_a_chunk_and_its_mirror_with_global_positions():
    cp, s = 4, 32
    assert [chunk_ids(cp, r) for r in range(cp)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    positions = torch.arange(s)[None]
    for r in range(cp):
        assert torch.equal(local_positions(s, cp, r), shard_sequence(positions, cp, r)[0])
    assert local_positions(s, cp, 1).tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    assert torch.equal(torch.cat([local_positions(s, cp, r) for r in range(cp)]).sort().values, torch.arange(s))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_rank_gets_equal_causal_work(cp):
    s = 16 * cp
    work = [causal_pairs(s, cp, r) for r in range(cp)]
    assert len(set(work)) == 1 and sum(work) == s * (s + 1) // 2, work
    # control: contiguous slices put the end of the sequence, and most of the work, on the last rank
    n = s // cp
    contiguous = [sum(p + 1 for p in range(r * n, (r + 1) * n)) for r in range(cp)]
    assert contiguous[-1] > 2 * (cp - 1) * contiguous[0]  # (2cp - 1 - 2(cp-1)/(n+1)) times: nearly 2cp-1


def test_a_sequence_that_does_not_split_into_2cp_chunks_is_refused():
    with pytest.raises(PlanError, match="divisible by 8"):
        shard_sequence(torch.zeros(1, 12), 4, 0)
    with pytest.raises(PlanError, match="CP rank 2"):
        chunk_ids(2, 2)


def test_a_batch_is_sharded_together_and_rotary_positions_default_to_global():
    cp, s = 2, 8
    ids = torch.arange(2 * s).view(2, s)
    batch = {"input_ids": ids, "labels": ids + 100, "segment_ids": (ids % s >= 3).long(), "step": torch.tensor(7)}
    local = shard_inputs(batch, cp, 1)
    assert local["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(local["labels"], local["input_ids"] + 100)
    assert local["segment_ids"].tolist() == [[0, 1, 1, 1], [0, 1, 1, 1]]
    assert local["position_ids"].tolist() == [[2, 3, 4, 5]] * 2  # the global positions: no position_ids given
    assert local["step"] is batch["step"]
    packed = shard_inputs({**batch, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)}, cp, 1)
    assert packed["position_ids"].tolist() == [[2, 0, 1, 2]] * 2  # per-document positions, sharded as given
