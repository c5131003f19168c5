"""A rank that raises or hangs never hangs the caller: bounded time, clear error, pool usable after."""

import pytest

from faultbench.harness.launch import RankFailure
from tests.distributed.cases import hang_on, raise_on, whoami


def test_pool_runs_on_every_rank_in_order(pool):
    assert pool.run(whoami) == [0, 1]


def test_a_raising_rank_is_reported_with_its_error(pool):
    with pytest.raises(RankFailure, match=r"rank 1 raised ValueError: boom on rank 1"):
        pool.run(raise_on, 1, timeout_s=60)
    assert pool.run(whoami) == [0, 1]  # rebuilt on the next call


def test_a_hanging_rank_times_out(pool):
    with pytest.raises(RankFailure, match=r"rank\(s\) \[0\] did not finish within 3s"):
        pool.run(hang_on, 0, timeout_s=3)
    assert pool.run(whoami) == [0, 1]
