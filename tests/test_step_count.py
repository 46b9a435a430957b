"""The step's labelled-token count without communication (issue 39): the loader counts every dp rank's windows from
the sampler's global batch (``TokenDataset.labelled_tokens``), checked against the rank's own micro-batches, so the
loss normalisation skips its all-reduce. Unit checks here; the fp64 comparison with one process is
``tests/test_step_count_dp.py``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kuangchao_core.data.dataset import TokenDataset
from kuangchao_core.data.loader import PrefetchLoader
from kuangchao_core.data.sampler import ResumableBatchSampler
from kuangchao_core.data.tokenizer import get_tokenizer
from kuangchao_core.parallel.step_loss import known_global_count, labelled_tokens


def _dataset(starts) -> TokenDataset:
    tokens = torch.arange(400, dtype=torch.int32) % 251
    return TokenDataset(tokens, 8, "t", get_tokenizer("byte", 260), None, starts)


# documents of 1..9 tokens, a start repeated (an empty document): windows hold 0 to several boundaries
STARTS = np.array([0, 3, 3, 11, 12, 20, 29, 30, 38, 47, 55, 56, 64, 65, 73, 81, 90, 98, 200, 201, 399])


@pytest.mark.parametrize("starts", [None, STARTS], ids=["concat", "documents"])
def test_collate_and_labelled_tokens_equal_the_windows_read_one_by_one(starts):
    ds = _dataset(starts)
    indices = [0, 1, 5, 7, 12, 25, -1, 3]
    items = [ds[i] for i in indices]
    stacked = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    got = ds.collate(indices)
    assert got.keys() == stacked.keys()
    for k in got:
        assert got[k].dtype == stacked[k].dtype and torch.equal(got[k], stacked[k]), k
    for i in range(len(ds)):  # every window, one at a time
        assert ds.labelled_tokens([i]) == int((ds[i]["labels"] != -100).sum()), i
    assert ds.labelled_tokens(indices) == int((stacked["labels"] != -100).sum())
    if starts is not None:  # the control: the windows do hold masked labels, so the count is not n × seq_len
        assert ds.labelled_tokens(indices) < len(indices) * ds.seq_len
    with pytest.raises(IndexError):
        ds.collate([len(ds)])


def test_the_loader_counts_every_ranks_micro_batches_of_the_step():
    ds = _dataset(STARTS)
    per_rank = []
    for rank in (0, 1):
        sampler = ResumableBatchSampler(len(ds), 3, 2, rank, 2, seed=4)
        with PrefetchLoader(ds, sampler, depth=0) as loader:
            per_rank.append([loader.next_step() for _ in range(3)])
    for step in range(3):
        own = [labelled_tokens(per_rank[r][step]) for r in (0, 1)]
        assert per_rank[0][step].labelled_per_rank == per_rank[1][step].labelled_per_rank == tuple(own)
    assert any(a != b for a, b in (r[0].labelled_per_rank for r in zip(*per_rank, strict=True)))


def test_a_count_that_disagrees_with_the_rank_s_own_batches_is_an_error():
    ds = _dataset(STARTS)
    mesh, replicas = SimpleNamespace(dp=2, cp=1, dp_rank=1), SimpleNamespace(size=2)
    with PrefetchLoader(ds, ResumableBatchSampler(len(ds), 3, 1, 1, 2, seed=4), depth=0) as loader:
        batches = loader.next_step()
    assert known_global_count(batches, replicas, mesh) == sum(batches.labelled_per_rank)
    assert known_global_count(batches, SimpleNamespace(size=4), mesh) is None  # replicas beyond dp×cp: all-reduce
    batches.labelled_per_rank = (batches.labelled_per_rank[0], batches.labelled_per_rank[1] + 1)
    with pytest.raises(RuntimeError, match="dp rank 1"):
        known_global_count(batches, replicas, mesh)
