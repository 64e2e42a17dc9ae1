"""The test harness itself: a hung collective fails fast and the next job gets a working pool."""

from types import SimpleNamespace

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
    dist_harness.run(2, _ranks)  # (a pool past GROUPS_KEPT is retired here: this one makes no groups)
    first = dist_harness._POOLS[2]
    dist_harness.run(2, _ranks)
    assert dist_harness._POOLS[2] is first


def _pid_and_groups(new: int) -> tuple[int, int]:
    """This rank's pid and how many process groups it has made, after making ``new`` more."""
    import os

    import torch.distributed as dist

    for _ in range(new):
        dist.new_group([0, 1])
    return os.getpid(), dist.get_pg_count()


def test_a_pool_that_made_many_groups_is_retired_after_its_job():
    """gloo's threads of every group a job made stay, busy, for the process's life: a pool past
    ``GROUPS_KEPT`` groups gives the next job fresh processes; one below it is kept."""
    dist_harness.retire(2)
    (pid, groups), _ = dist_harness.run(2, _pid_and_groups, 0)
    assert groups <= dist_harness.GROUPS_KEPT
    (same, groups), _ = dist_harness.run(2, _pid_and_groups, dist_harness.GROUPS_KEPT - groups)
    assert same == pid and groups == dist_harness.GROUPS_KEPT
    (kept, groups), _ = dist_harness.run(2, _pid_and_groups, 1)
    assert kept == pid and groups == dist_harness.GROUPS_KEPT + 1  # kept up to GROUPS_KEPT: this was its last job
    (fresh, groups), _ = dist_harness.run(2, _pid_and_groups, 0)
    assert fresh != pid and groups <= dist_harness.GROUPS_KEPT


def test_a_files_last_test_ends_the_pools():
    """Pools live through a file's tests and end after its last (``conftest.pytest_runtest_teardown``)."""
    from tests import conftest

    dist_harness.run(2, _ranks)
    pool = dist_harness._POOLS[2]
    here, there = SimpleNamespace(path="test_a.py"), SimpleNamespace(path="test_b.py")
    conftest.pytest_runtest_teardown(here, SimpleNamespace(path="test_a.py"))
    assert dist_harness._POOLS[2] is pool and pool.alive()
    conftest.pytest_runtest_teardown(here, there)
    assert dist_harness._POOLS == {} and not any(p.is_alive() for p in pool.procs)
    conftest.pytest_runtest_teardown(there, None)  # the session's last test: nothing left to end
    assert dist_harness.run(2, _ranks) == [(0, 2), (1, 2)]  # the next file's job forks a fresh pool
