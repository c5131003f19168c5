"""Overfitting one fixed batch: the most basic "can this stack learn at all" check.

Eight distinct documents that share the same context (BOS at position 0) cannot be told apart before
their first token, so no causal model can beat the memorization floor 8*ln(8) / N_targets nats per
token (the best it can do is give each document probability 1/8). Eight full-length (64-token)
documents keep that floor (0.033) below the 0.05 target; eight typical short documents would not
(their floor is ~0.23).
"""

from __future__ import annotations

import math

import pytest

from faultbench.model.data import collate
from faultbench.model.loss import count_targets
from faultbench.model.run import build_run
from faultbench.model.train import train_step

TARGET = 0.05
# Measured with constant lr 3e-3, seeds 0/1/2: loss < 0.05 first at step 82 / 83 / 84.
MAX_STEPS = 100


@pytest.fixture(scope="module")
def overfit_history(tiny_cfg, long_docs):
    lr = tiny_cfg.train.lr
    cfg = tiny_cfg.replace(train={"lr": lr, "min_lr": lr, "warmup_steps": 0, "steps": MAX_STEPS}, seed=0)
    run = build_run(cfg)
    docs = list(long_docs[:8])
    batch = collate(docs, run.tokenizer.pad_id, cfg.data.pad_side)
    records = []
    for _ in range(MAX_STEPS):
        records.append(train_step(run, [batch]))
        if records[-1].loss < TARGET:
            break
    floor = len(docs) * math.log(len(docs)) / count_targets(batch["labels"])
    return docs, records, floor


def test_constant_lr_schedule(overfit_history, tiny_cfg):
    # the replace() above really gives a constant learning rate
    _, records, _ = overfit_history
    assert [r.lr for r in records] == pytest.approx([tiny_cfg.train.lr] * len(records))


def test_overfits_one_batch(overfit_history):
    docs, records, _ = overfit_history
    assert len(set(docs)) == len(docs)
    assert records[0].loss > 5.0  # starts near ln(vocab): nothing memorized yet
    assert records[-1].loss < TARGET, (
        f"loss {records[-1].loss:.4f} after {len(records)} steps; measured < {TARGET} by step 84"
    )


def test_never_beats_the_memorization_floor(overfit_history):
    # a loss below the floor is impossible for a causal model: it means the model sees the answer
    _, records, floor = overfit_history
    assert floor == pytest.approx(8 * math.log(8) / (8 * 63))
    assert min(r.loss for r in records) > floor - 1e-4
