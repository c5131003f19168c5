"""Positive tests of distributed detectors whose no-op versions passed every test (benchmarks/detector_mutation.py).

Each case runs on the two ranks of the session's pool (a gloo process group): the detector, built through the
registry as the Suite builds it, gets a hand-broken collective or replica on both ranks and must report it with
its subsystem and seam; with the correct one it stays silent. The functions run on the ranks are top-level (the pool
pickles them) and return the (subsystem, seam) of each finding.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from faultbench.detectors.api import all_detectors
from faultbench.model.config import get_preset
from tests.detectors.helpers import context

TARGET_COUNT, MEAN = "model.distributed.global_target_count", "model.distributed.mean_over_ranks"


def count_not_reduced(local_count: int, device: str = "cpu") -> int:
    """global_target_count without its all-reduce: each rank keeps its own count."""
    return local_count


def mean_not_divided(value: float, device: str = "cpu") -> float:
    """mean_over_ranks that sums over the ranks and forgets to divide by their number."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def _fake_run(rank: int, world_size: int | None = None, **parts) -> SimpleNamespace:
    world_size = dist.get_world_size() if world_size is None else world_size
    return SimpleNamespace(world_size=world_size, rank=rank, config=get_preset("tiny"), step=0, **parts)


def collectives_on_rank(rank: int, broken: str | None) -> list:
    replaced = {"count_not_reduced": {TARGET_COUNT: count_not_reduced},
                "mean_not_divided": {MEAN: mean_not_divided}}.get(broken, {})
    det = all_detectors()["rank_collectives"]()
    det.on_start(context(_fake_run(rank), **replaced))
    return [(f.subsystem, f.seam) for f in det.findings]


def agreement_on_rank(rank: int, broken: str | None) -> list:
    """One data-parallel step of a linear model (the same initial weights on both ranks, each rank its own data):
    ``same_batches``: every rank trains on rank 0's token batch; ``grads_not_reduced``: no gradient all-reduce."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ctx = context(_fake_run(rank, model=model))
    det = all_detectors()["rank_agreement"]()
    ids = torch.arange(8).view(2, 4) + (0 if broken == "same_batches" else 100 * rank)
    det.on_batch(ctx, [{"input_ids": ids}])
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    if broken != "grads_not_reduced":
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    det.on_before_step(ctx)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    det.on_after_step(ctx, SimpleNamespace(step=0))
    det.on_end(ctx, {})
    return [(f.subsystem, f.seam) for f in det.findings]


@pytest.mark.xdist_group("rank_pool")
@pytest.mark.parametrize(("broken", "seam"), [(None, None), ("count_not_reduced", TARGET_COUNT),
                                              ("mean_not_divided", MEAN)], ids=str)
def test_rank_collectives_names_the_collective_that_is_not_a_sum_or_a_mean(rank_pool, broken, seam):
    expected = [("distributed", seam)] if broken else []  # each rank sees the wrong value it got
    assert rank_pool.run(collectives_on_rank, broken) == [expected, expected]


@pytest.mark.xdist_group("rank_pool")
@pytest.mark.parametrize(("broken", "seam"), [
    (None, None),
    ("same_batches", "model.sampler.ResumableSampler.next_indices"),
    ("grads_not_reduced", "model.distributed.grad_sync_context"),
], ids=str)
def test_rank_agreement_finds_unsharded_data_and_unreduced_gradients(rank_pool, broken, seam):
    expected = [("distributed", seam)] if broken else []
    assert rank_pool.run(agreement_on_rank, broken) == [expected, expected]


# ---- rank_grad_norm_agreement: the logged norm is the whole gradient's (a local check: no process group needed) ----
def clip_by_local_shard(model, max_norm: float) -> float:
    """A ZeRO-style clip written wrong: the norm of this rank's half of the parameters only (no all-reduce of the
    squared shard norms), used to clip everything and logged."""
    params = list(model.parameters())
    return float(torch.nn.utils.clip_grad_norm_(params[: len(params) // 2], max_norm))


@pytest.mark.parametrize("broken", [False, True], ids=["whole_gradient", "local_shard"])
def test_rank_grad_norm_agreement_flags_a_logged_norm_that_is_not_the_whole_gradients(broken):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    run = _fake_run(0, world_size=2, model=model)
    ctx = context(run)
    model(torch.randn(16, 8)).pow(2).sum().backward()
    clip = run.config.train.grad_clip
    assert float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])) > 2 * clip  # clipping acts
    if broken:
        logged = clip_by_local_shard(model, clip)
    else:
        logged = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
    det = all_detectors()["rank_grad_norm_agreement"]()
    det.on_before_step(ctx)
    det.on_after_step(ctx, SimpleNamespace(step=0, grad_norm=logged))
    assert [(f.subsystem, f.seam) for f in det.findings] == ([("optimizer", "model.train.clip_gradients")]
                                                             if broken else [])
