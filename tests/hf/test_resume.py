"""Resume: Trainer stopped at step 8 with a checkpoint, then a fresh Trainer resumed from it with
``resume_from_checkpoint``, trains exactly like a run never stopped: model, optimizer, scheduler, RNG
(attention dropout 0.1 draws from it) and data position all restored. Measured: bit-identical."""

from __future__ import annotations

import dataclasses

from faultbench.targets.hf.hooks import checkpoint_dir, train
from faultbench.targets.hf.recipes import RECIPES
from faultbench.targets.hf.run import build_run
from tests.hf.conftest import max_gap, params


def curve(run) -> list[tuple]:
    return [(r.step, r.loss, r.grad_norm, r.lr, r.tokens) for r in run.history]


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    recipe = RECIPES["resume"]
    assert recipe.model.attention_dropout > 0 and recipe.resume_at == 8
    uninterrupted = build_run(dataclasses.replace(recipe, resume_at=None), 1, tmp_path / "whole")
    train(uninterrupted)
    first = build_run(recipe, 1, tmp_path / "halves")
    train(first, stop_at=recipe.resume_at)
    assert first.step == 8
    resumed = build_run(recipe, 1, tmp_path / "halves")
    train(resumed, resume=checkpoint_dir(str(tmp_path / "halves"), 8))
    assert curve(first) + curve(resumed) == curve(uninterrupted)
    assert max_gap(params(resumed.model), params(uninterrupted.model)) == 0.0
