"""DDP and ZeRO (world size 2, gloo) against the single-process reference on the same global batch."""

import pytest
import torch

from faultbench.harness.training import train_on_rank, train_reference
from faultbench.model.config import get_preset

STEPS = 16


def _cfg(**train):
    return get_preset("tiny").replace(train={"steps": STEPS, "warmup_steps": 4, **train})


def _ddp(pool, cfg, **kwargs):
    return pool.run(train_on_rank, cfg.to_dict(), {"with_params": True, **kwargs})


def _max_param_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _losses(summary):
    return torch.tensor([r["loss"] for r in summary["history"]], dtype=torch.float64)


def test_ddp_is_bit_identical_to_single_process_accumulating_the_same_shards(pool):
    # One process accumulating the two ranks' shards as two micro-batches does the same arithmetic:
    # each rank's loss is divided by half the global count (an exact factor of 2), DDP averages
    # (another exact factor), and a sum of two terms does not depend on order.
    single = train_reference(_cfg(accum=2), with_params=True)
    ranks = _ddp(pool, _cfg(world_size=2))
    for rank in ranks:
        assert _max_param_diff(rank["state"], single["state"]) == 0.0
        assert torch.equal(_losses(rank), _losses(single))


@pytest.mark.parametrize(("single_accum", "ddp_accum"), [(1, 1), (4, 2)], ids=["global-batch", "accum"])
def test_ddp_matches_single_process_on_the_global_batch(pool, single_accum, ddp_accum):
    # Padding to another length and another summation order change gradients by float noise (~1e-11
    # absolute); AdamW divides by sqrt(v) + 1e-8, which amplifies that noise on near-zero gradient
    # coordinates. Measured after 16 steps: 2.5e-6 (global batch) and 5.8e-6 (accumulation).
    single = train_reference(_cfg(accum=single_accum), with_params=True)
    ranks = _ddp(pool, _cfg(accum=ddp_accum, world_size=2))
    assert _max_param_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0  # replicas never diverge
    assert _max_param_diff(ranks[0]["state"], single["state"]) < 2e-5
    assert torch.allclose(_losses(ranks[0]), _losses(single), atol=2e-6, rtol=0)
    assert torch.equal(_losses(ranks[0]), _losses(ranks[1]))  # the logged loss is the global mean


def test_zero_equals_ddp_including_clipping(pool):
    # a small max norm makes clipping act on every step, so the norm must be the global one
    ddp = _ddp(pool, _cfg(world_size=2, grad_clip=0.05))
    zero = _ddp(pool, _cfg(world_size=2, grad_clip=0.05, zero=True))
    assert all(r["grad_norm"] > 0.05 for r in ddp[0]["history"]), "clipping was not exercised"
    assert _max_param_diff(zero[0]["state"], ddp[0]["state"]) < 1e-6
    assert _max_param_diff(zero[0]["state"], zero[1]["state"]) == 0.0
    assert torch.allclose(_losses(zero[0]), _losses(ddp[0]), atol=1e-6, rtol=0)
