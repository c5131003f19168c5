"""DDP for the HF target on an already-initialized process group (a ``harness.launch.RankPool`` rank).

``Trainer`` learns it is distributed from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK);
accelerate's ``PartialState`` then finds ``torch.distributed`` initialized and joins that group
instead of creating one, wraps the model in ``DistributedDataParallel`` and shards every batch.
"""

from __future__ import annotations

import os

import torch.distributed as dist

_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank_environment(world_size: int) -> dict[str, str]:
    """The torchrun variables of this process's rank, read from the initialized group.

    ``world_size`` 1 needs nothing (an empty dict); otherwise the group must exist and be that size.
    """
    if world_size == 1:
        return {}
    if not dist.is_initialized() or dist.get_world_size() != world_size:
        found = dist.get_world_size() if dist.is_initialized() else "no process group"
        raise ValueError(f"the recipe needs {world_size} ranks in an initialized process group, found {found}")
    rank = dist.get_rank()
    # MASTER_* are never used to connect (the group exists); accelerate only checks they are set
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def set_environment(env: dict[str, str]) -> None:
    """Make ``env`` this process's torchrun variables (the others of ``_KEYS`` unset)."""
    for key in _KEYS:
        if key in env:
            os.environ[key] = env[key]
        else:
            os.environ.pop(key, None)
