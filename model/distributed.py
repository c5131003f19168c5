"""Data-parallel training through torch.distributed: DDP, its gradient reduction, and ZeRO support.

Every rank runs the same training code. Each takes a disjoint shard of every global batch (the
sampler), computes its gradient, and DDP averages gradients across ranks during backward through a
communication hook (``average_gradients_hook``): after it, every rank holds the gradient of the
whole global batch. With gradient accumulation, inner micro-batches run under ``no_sync`` (forward
and backward both), and only the window's last micro-batch reduces.

The loss is normalized by the target count of the whole global window divided by the world size,
so DDP's average over ranks gives exactly the single-process token mean of the global batch.
"""


import contextlib
import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def default_backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_from_env(device: str = "cpu", timeout_s: float = 120.0) -> tuple[int, int]:
    """Join the process group described by torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    Returns (rank, world_size); (0, 1) without initializing anything when WORLD_SIZE is unset or 1.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return 0, 1
    rank = int(os.environ["RANK"])
    dist.init_process_group(default_backend(device), rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s))
    return rank, size


def rank_seed(seed: int, rank: int) -> int:
    """A seed for rank-local randomness (dropout), distinct per rank and derived from the run seed."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def average_gradients_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: all-reduce one bucket of flattened gradients and divide by the world size.

    This is DDP's reduction, written out so it is a named place: after it, each gradient is the mean
    of the ranks' gradients.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer().div_(dist.get_world_size(group))
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_model(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """DDP around ``model`` with the averaging hook; the model itself when not distributed.

    DDP broadcasts rank 0's parameters at construction, so every replica starts identical.
    """
    if not is_distributed() or world_size() == 1:
        return model
    device_ids = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    ddp.register_comm_hook(None, average_gradients_hook)
    return ddp


def grad_sync_context(model: torch.nn.Module, sync: bool):
    """Wrap a micro-batch's forward AND backward: ``no_sync`` unless ``sync`` (the window's last one).

    DDP records in forward whether the coming backward must reduce, so the context has to cover
    both. A no-op for a model that is not DDP-wrapped.
    """
    if sync or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def global_target_count(local_count: int, device: str = "cpu") -> int:
    """The number of predicted tokens of the step summed over all ranks."""
    if not is_distributed():
        return local_count
    total = torch.tensor([local_count], dtype=torch.long, device=device)
    dist.all_reduce(total)
    return int(total)


def mean_over_ranks(value: float, device: str = "cpu") -> float:
    """The mean of a per-rank scalar (for logging the step's loss)."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()
