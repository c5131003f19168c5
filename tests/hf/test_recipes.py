"""The HF recipes' epochs: ``Recipe.crosses_epoch`` says what Trainer does, and the combined recipe crosses an
epoch after its resume, so a fault in the sampler's reshuffle (``set_epoch``) runs where it can show."""

from __future__ import annotations

import dataclasses

import pytest

from faultbench.faults.registry import all_faults
from faultbench.harness.matcher import recipes_for
from faultbench.model.corpus import SMALL_EPOCH
from faultbench.targets.hf.hooks import checkpoint_dir, train
from faultbench.targets.hf.recipes import RECIPES
from faultbench.targets.hf.run import build_run

SMALL = dataclasses.replace(RECIPES["fp32"].data, **SMALL_EPOCH)  # 143 training documents: 9 steps of 16, one short


@pytest.mark.parametrize("steps", [9, 10])
def test_crosses_epoch_is_what_trainer_does(trained, steps):
    """At 9 steps the run ends on the epoch's last (short) batch; at 10 Trainer is in its second epoch."""
    run = trained("fp32", steps=steps, warmup_steps=0, data=SMALL)
    assert run.config.crosses_epoch == (steps == 10)
    assert run.config.crosses_epoch == (run.trainer.state.epoch > 1), run.trainer.state.epoch


def test_combined_crosses_its_epoch_after_the_resume(tmp_path):
    """The combined recipe as its cases run it: saved at ``resume_at``, resumed by a fresh Trainer that reaches
    the second epoch (the only recipe that does)."""
    recipe = RECIPES["combined"]
    assert [r.name for r in RECIPES.values() if r.crosses_epoch] == ["combined"]
    train(build_run(recipe, 0, tmp_path), stop_at=recipe.resume_at)
    resumed = build_run(recipe, 0, tmp_path)
    train(resumed, resume=checkpoint_dir(str(tmp_path), recipe.resume_at))
    assert resumed.step == recipe.steps and resumed.trainer.state.epoch > 1


def test_a_fault_longer_than_an_epoch_runs_where_an_epoch_ends():
    """The sampler fault's proof trains past an epoch of a small corpus: only a recipe that crosses one can
    show it (the corpus size itself is a tuning key, the recipe's own stands in)."""
    manifest = all_faults("hf")["hf_sampler_epoch_never_advances"].manifest
    assert recipes_for(manifest, "hf") == ["combined"]
    short = dataclasses.replace(manifest, steps=4)  # the same variant within one epoch: any recipe will do
    assert recipes_for(short, "hf")[0] == "fp32"
