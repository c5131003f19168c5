"""DDP: the ddp recipe on 2 gloo ranks (a ``RankPool``; Trainer joins its process group through the
torchrun variables) trains like one process taking both ranks' batches. Each rank takes half of every
micro-batch, and Trainer gathers the token count over ranks (``average_tokens_across_devices``), so
the averaged gradients equal the single process's up to the order of fp32 sums."""

from __future__ import annotations

import dataclasses

import pytest

from faultbench.harness.launch import RankPool
from faultbench.targets.hf.hooks import train
from faultbench.targets.hf.recipes import RECIPES
from faultbench.targets.hf.run import build_run
from tests.hf.conftest import max_gap, params

TOL = 1e-5  # measured: parameters 1.1e-6 apart after 16 steps (all-reduce of two fp32 halves vs one sum)


def train_on_rank(rank: int, workdir: str) -> dict:
    """RankPool entry: the ddp recipe on this rank; its step records and final parameters."""
    import torch

    torch.set_num_threads(1)
    run = build_run(RECIPES["ddp"], 0, workdir, rank)
    train(run)
    return {"curve": [(r.loss, r.grad_norm, r.lr) for r in run.history], "params": params(run.model),
            "tokens": [r.tokens for r in run.history]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    with RankPool(2) as pool:
        return pool.run(train_on_rank, str(tmp_path_factory.mktemp("ddp")), timeout_s=300)


def test_two_ranks_equal_one_process(ranks, tmp_path):
    single = build_run(dataclasses.replace(RECIPES["ddp"], world_size=1), 0, tmp_path)
    train(single)
    assert single.config.micro_batch_size == 2 * RECIPES["ddp"].micro_batch_size
    for rank in ranks:
        assert max_gap(rank["params"], params(single.model)) < TOL
        for (loss, norm, lr), r in zip(rank["curve"], single.history, strict=True):
            assert abs(loss - r.loss) < TOL and abs(norm - r.grad_norm) < TOL * r.grad_norm and lr == r.lr
    # each rank trained on its own half of every batch
    assert [a + b for a, b in zip(ranks[0]["tokens"], ranks[1]["tokens"], strict=True)] == \
        [r.tokens for r in single.history]
