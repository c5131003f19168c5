"""A rank that raises, hangs or is killed never hangs the caller: bounded time, clear error, pool usable after;
a killed rank is a failure of the machine, never cached as the case's outcome."""

from pathlib import Path

import pytest

from faultbench.harness import bench
from faultbench.harness.case import execute
from faultbench.harness.launch import RankFailure
from faultbench.harness.record import Case, failed_record
from tests.distributed.cases import hang_on, kill_on, raise_on, whoami

LEAKY = Path(__file__).with_name("leaky_fault.py")


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


def test_a_killed_rank_is_reported_never_cached_and_the_pool_restarts(pool, tmp_path, monkeypatch):
    with pytest.raises(RankFailure, match=r"rank 1 died \(exit code -9\)") as info:
        pool.run(kill_on, 1, timeout_s=60)
    assert pool.run(whoami) == [0, 1]
    monkeypatch.setattr(bench, "CACHE", tmp_path)
    case = Case("ddp", 0, ("label_permute",), ("forward_loss_contract",))
    bench.keep(case, failed_record(case, "RankFailure", str(info.value)), "digest")
    assert list(tmp_path.iterdir()) == []  # a rerun runs the case again
    bench.keep(case, failed_record(case, "ValueError", "the fault's own crash"), "digest")
    assert len(list(tmp_path.iterdir())) == 1  # an outcome of the case is cached


def test_a_fault_case_leaves_nothing_in_the_ranks_for_the_next_case(pool):
    """A fault that patches a module for the whole process (here F.cross_entropy) runs on ranks that are retired
    after its case: the clean case after it trains exactly as the clean case before it."""
    clean = Case("ddp", 0)
    before = execute(clean, None, pool)["history"]
    leaky = execute(Case("ddp", 0, ("test_leaky_global_patch",), (), (str(LEAKY),)), None, pool)
    assert leaky["crash"] is None
    assert leaky["history"][1]["loss"] > 1.5 * before[1]["loss"]  # the patch took effect in the fault's own case
    after = execute(clean, None, pool)["history"]
    assert [r["loss"] for r in after] == [r["loss"] for r in before]
