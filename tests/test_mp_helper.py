import torch
import torch.distributed as dist

from tests.mp import run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_run_distributed_collects_every_rank():
    assert run_distributed(_sum_ranks, world_size=3) == [3.0, 3.0, 3.0]


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_run_distributed_reports_the_failing_rank():
    import pytest

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_distributed(_fail_on_one, world_size=2, init_pg=False)
