"""tests/dist_utils.py's DistPool: it restarts its processes once a task leaves a rank in more than MAX_GROUPS
process groups (each gloo group polls its sockets until the process ends), and its ranks, forked by a
forkserver without CUDA, run in the environment of their start."""
from __future__ import annotations

import os

import pytest
from dist_utils import MAX_GROUPS, START_METHOD, DistPool


def _make_groups(rank, world, n):
    """n new process groups over every rank; this process's pid and the groups it is in."""
    import torch.distributed as dist
    from dist_utils import _groups_alive
    for _ in range(n):
        dist.new_group(list(range(world)))
    return os.getpid(), _groups_alive()


def _env(rank, world):
    """Where this rank came from and the environment variables the test set."""
    return os.getppid(), os.environ.get("FASTOPT_POOL_PROBE"), os.environ.get("FASTOPT_POOL_ENV")


@pytest.mark.dist
def test_pool_restarts_past_max_groups(monkeypatch):
    """A task that leaves the ranks in more than MAX_GROUPS groups has them restarted before the next; each start
    hands the ranks the parent's environment of that moment plus the pool's `env`, though (without CUDA) they fork
    from a forkserver started with the first pool's."""
    monkeypatch.setenv("FASTOPT_POOL_PROBE", "first")
    with DistPool(2, timeout=60.0, env={"FASTOPT_POOL_ENV": "mine"}) as pool:
        first = pool.run(_make_groups, 0)
        assert [g for _, g in first] == [1, 1]  # the default group alone
        envs = pool.run(_env)
        assert [e[1:] for e in envs] == [("first", "mine")] * 2
        if START_METHOD == "forkserver":  # both forked by the forkserver, not started by this process
            assert envs[0][0] == envs[1][0] != os.getpid()
        kept = pool.run(_make_groups, MAX_GROUPS - 1)
        assert [pid for pid, _ in kept] == [pid for pid, _ in first] and [g for _, g in kept] == [MAX_GROUPS] * 2
        crowded = pool.run(_make_groups, 1)  # MAX_GROUPS + 1 after this task: the next one starts afresh
        assert [pid for pid, _ in crowded] == [pid for pid, _ in first]
        monkeypatch.setenv("FASTOPT_POOL_PROBE", "second")
        fresh = pool.run(_make_groups, 0)
        assert not {pid for pid, _ in fresh} & {pid for pid, _ in first} and [g for _, g in fresh] == [1, 1]
        assert [e[1:] for e in pool.run(_env)] == [("second", "mine")] * 2
