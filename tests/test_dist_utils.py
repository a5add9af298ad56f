import torch
import torch.distributed as dist

from dist_utils import run_distributed


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_run_distributed_returns_each_rank():
    assert run_distributed(_all_reduce_rank, 2) == [3.0, 3.0]


def test_run_distributed_reports_the_failing_rank():
    import pytest

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_distributed(_fail_on_rank_one, 2)
