"""Per-rank functions the distributed tests run in the pool (importable by the worker processes)."""

import os
import signal
import time

from faultbench.model.config import RunConfig
from faultbench.model.run import build_run


def shard_indices(rank: int, cfg_dict: dict, steps: int) -> list[list[int]]:
    """The dataset indices this rank's sampler hands out for ``steps`` steps of a real run."""
    run = build_run(RunConfig.from_dict(cfg_dict), rank)
    return [run.sampler.next_indices() for _ in range(steps)]


def raise_on(rank: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise ValueError(f"boom on rank {rank}")
    return rank


def hang_on(rank: int, bad_rank: int) -> int:
    if rank == bad_rank:
        time.sleep(3600)  # a rank stuck forever; the pool must time out, not the test session
    return rank


def kill_on(rank: int, bad_rank: int) -> int:
    if rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer or a user's kill -9 does to one rank
    return rank


def whoami(rank: int) -> int:
    return rank
