"""tests/dist_utils.py's DistPool: it restarts its processes once a task leaves a rank in more than MAX_GROUPS
process groups (each gloo group polls its sockets until the process ends)."""
from __future__ import annotations

import os

import pytest
from dist_utils import MAX_GROUPS, DistPool


def _make_groups(rank, world, n):
    """n new process groups over every rank; this process's pid and the groups it is in."""
    import torch.distributed as dist
    from dist_utils import _groups_alive
    for _ in range(n):
        dist.new_group(list(range(world)))
    return os.getpid(), _groups_alive()


@pytest.mark.dist
def test_pool_restarts_past_max_groups():
    with DistPool(2, timeout=60.0) as pool:
        first = pool.run(_make_groups, 0)
        assert [g for _, g in first] == [1, 1]  # the default group alone
        kept = pool.run(_make_groups, MAX_GROUPS - 1)
        assert [pid for pid, _ in kept] == [pid for pid, _ in first] and [g for _, g in kept] == [MAX_GROUPS] * 2
        crowded = pool.run(_make_groups, 1)  # MAX_GROUPS + 1 after this task: the next one starts afresh
        assert [pid for pid, _ in crowded] == [pid for pid, _ in first]
        fresh = pool.run(_make_groups, 0)
        assert not {pid for pid, _ in fresh} & {pid for pid, _ in first} and [g for _, g in fresh] == [1, 1]
