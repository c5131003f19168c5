"""Convergence: the tiny preset, trained for its whole default schedule, gets close to the loss floor.

The corpus is a Markov source whose exact probability of every document is known, so the
Bayes-optimal val loss (``corpus.loss_floor``) is known too. The gap to it measures how well the
whole stack learns; a subtle bug (bad schedule, wrong decay groups, weak attention) widens it.
"""

from __future__ import annotations

import pytest

from faultbench.model.evaluate import evaluate
from faultbench.model.run import build_run
from faultbench.model.train import train

# Measured gaps (val - floor, floor = 1.6614) after 300 steps, seeds 0..4:
# 0.1079, 0.1008, 0.1116, 0.1071, 0.1134. The margin leaves ~0.035 headroom over the worst seed.
MARGIN = 0.15


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1], ids=lambda s: f"seed{s}")
def test_tiny_preset_reaches_the_loss_floor(tiny_cfg, seed):
    run = build_run(tiny_cfg.replace(seed=seed))
    train(run)
    # train() ran every step of the configured schedule, one after the other
    assert [r.step for r in run.history] == list(range(run.config.train.steps))
    val = evaluate(run.model, run.corpus.val, run.tokenizer.pad_id, 64)
    gap = val - run.corpus.loss_floor
    assert gap < MARGIN, f"val {val:.4f} is {gap:.4f} above the floor {run.corpus.loss_floor:.4f}"
    # the floor is a true lower bound: landing under it means the model peeks at its targets
    assert gap > 0.0
    # and the train loss really fell from its ~ln(vocab) start
    assert run.history[0].loss > 5.0 and run.history[-1].loss < 2.5
