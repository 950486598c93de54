"""``tests.dist_pool.threaded_world``: every rank a thread of this process on torch's ``threaded`` backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_pool import threaded_world


def _sum_of_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _rank_2_fails_before_a_collective(rank: int, world: int) -> None:
    if rank == 2:
        raise ValueError("rank 2 is broken")
    dist.barrier()  # the others wait here for rank 2


def test_each_thread_is_a_rank_and_collectives_move_data() -> None:
    assert threaded_world(4, _sum_of_ranks) == [6.0] * 4


def test_a_failing_rank_fails_the_call_with_its_traceback_and_releases_its_peers() -> None:
    with pytest.raises(AssertionError, match=r"rank 2 of 3 failed:[\s\S]*ValueError: rank 2 is broken"):
        threaded_world(3, _rank_2_fails_before_a_collective, timeout=60)
    assert threaded_world(2, _sum_of_ranks) == [1.0, 1.0]  # the next world starts clean
