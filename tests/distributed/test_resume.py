"""Checkpoint/resume under DDP and ZeRO is bit-identical to the uninterrupted run."""

import pytest
import torch

from faultbench.harness.training import train_on_rank
from faultbench.model.config import get_preset

STEPS = 12


@pytest.mark.parametrize("zero", [False, True], ids=["ddp", "zero"])
def test_resume_under_ddp_is_bit_identical(pool, tmp_path, zero):
    # dropout on: the per-rank RNG states must be saved and restored too
    cfg = get_preset("tiny").replace(
        model={"dropout": 0.1}, train={"steps": STEPS, "warmup_steps": 4, "world_size": 2, "zero": zero},
    )
    whole = pool.run(train_on_rank, cfg.to_dict(), {"with_params": True})
    ckpt = tmp_path / "ckpt"
    pool.run(train_on_rank, cfg.to_dict(), {"until": STEPS // 2, "save": str(ckpt)})
    resumed = pool.run(train_on_rank, cfg.to_dict(), {"resume": str(ckpt), "with_params": True})
    for rank in (0, 1):
        assert [r["loss"] for r in resumed[rank]["history"]] == [r["loss"] for r in whole[rank]["history"]]
        for name, value in whole[rank]["state"].items():
            assert torch.equal(resumed[rank]["state"][name], value), f"rank {rank}: {name} differs"
