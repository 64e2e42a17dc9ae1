"""The test harness itself: a hung collective fails fast and the next job gets a working pool."""

import pytest

from tests import dist_harness


def _rank0_waits_alone():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins
    return dist.get_rank()


def _ranks():
    import torch.distributed as dist

    dist.barrier()
    return dist.get_rank(), dist.get_world_size()


def test_hung_collective_times_out_and_pool_recovers():
    with pytest.raises(TimeoutError, match="_rank0_waits_alone did not finish on 2 ranks within 5 s"):
        dist_harness.run(2, _rank0_waits_alone, timeout=5)
    assert dist_harness.run(2, _ranks) == [(0, 2), (1, 2)]


def test_pools_are_reused():
    first = dist_harness._POOLS.get(2) or (dist_harness.run(2, _ranks) and dist_harness._POOLS[2])
    dist_harness.run(2, _ranks)
    assert dist_harness._POOLS[2] is first
