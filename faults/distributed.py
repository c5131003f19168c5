"""Faults in the `distributed` subsystem: DDP, ZeRO, per-rank seeding, gradient sync."""

import torch
import torch.distributed as dist

from faults.registry import Manifest, fault


@fault(
    "ddp_double_reduction",
    seam="model.distributed.average_gradients_hook",
    title="Gradients all-reduced again after DDP already averaged them",
    subsystem="distributed",
    also_acceptable=("optimizer",),
    trigger="multi-rank",
    symptoms=("divergence",),
    explanation="The hook averages each bucket and then all-reduces it once more (the manual "
    "average_gradients() of the classic tutorial, kept after switching to DDP). Every gradient is "
    "world_size times too large: the pre-clip norm doubles on 2 ranks, clipping fires where it should "
    "not, and anything not scale-invariant (SGD, eps, clipping, logging) is off by the world size.",
    fix="Reduce once: either DDP (its hook) or a manual all-reduce divided by the world size, never both.",
    references=(
        "PyTorch forums: 'Gradients are doubled when using DDP' (manual all_reduce kept next to DDP)",
        "PyTorch distributed tutorial 'Writing Distributed Applications': average_gradients()",
    ),
    manifest=Manifest(check="grad_norm_ratio", scenario="ddp", steps=4, params={"min_ratio": 1.9, "max_ratio": 2.1}),
)
def average_gradients_hook_twice(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket, then all-reduces (sums) it a second time."""
    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer().div_(dist.get_world_size(group))
    dist.all_reduce(tensor, group=group)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
