"""bb_resume_state: a resumed segment starts from the weights and optimizer state its checkpoint saved at that step.
The loop saves inside its watched loop, as real loops do; the resume is a fresh model and optimizer loaded from it.
Silent on a correct resume and on one from a checkpoint of another step; found when the model or the optimizer is
not restored, a moment is saved in half precision, or the tied head comes back as a copy."""

from __future__ import annotations

import pytest
import torch

import faultbench
from tests.watch.test_monitors import STEPS, _batches, _parts

RESUME = 6


def _train(parts, batches, start, stop, *, previous=None, save_at=()):
    model, optimizer, scheduler = parts
    saved = {}
    w = faultbench.watch(model, optimizer, scheduler=scheduler, report=False, detectors=["bb_resume_state"],
                         step=start, previous=previous)
    with w:
        for s in range(start, stop):
            x, y = batches[s]
            model(x, y)[1].backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if s + 1 in save_at:  # the loop's checkpoint, deep-copied as torch.save would write it
                saved[s + 1] = {k: _copy(o.state_dict()) for k, o in zip(("model", "optimizer", "scheduler"), parts,
                                                                         strict=True)}
    return w, saved


def _copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


def _resume(seed: int, bug: str | None = None, resume_at: int = RESUME):
    batches = _batches(seed)
    first, saved = _train(_parts(seed), batches, 0, RESUME, save_at=(RESUME - 2, RESUME))
    state = saved[resume_at]
    if bug == "half_moments":  # the checkpoint writer keeps the moments in bf16 to save space
        for per_param in state["optimizer"]["state"].values():
            for key in ("exp_avg", "exp_avg_sq"):
                per_param[key] = per_param[key].bfloat16().float()
    load = {"model_lost": ("optimizer", "scheduler"), "optimizer_lost": ("model", "scheduler")}.get(
        bug, ("model", "optimizer", "scheduler"))
    parts = _parts(seed + 50, state, load)
    if bug == "untied":  # the resumed head gets a copy of the embedding instead of sharing it
        model = parts[0]
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    second, _ = _train(parts, batches, resume_at, STEPS, previous=first)
    return second


@pytest.mark.parametrize("seed", [0, 1])
def test_a_correct_resume_is_silent(seed):
    second = _resume(seed)
    assert second.findings == [] and second.errors == {}
    assert "bb_resume_state" not in second.not_applicable  # it compared


def test_a_resume_from_an_older_checkpoint_compares_with_that_one():
    assert _resume(0, resume_at=RESUME - 2).findings == []


@pytest.mark.parametrize(("bug", "kind"), [("model_lost", "weights"), ("optimizer_lost", "optimizer"),
                                           ("half_moments", "optimizer"), ("untied", "layout")])
def test_state_the_checkpoint_did_not_restore_is_found(bug, kind):
    findings = _resume(0, bug).findings
    assert [(f.detector, f.subsystem, f.evidence["kind"]) for f in findings] == [("bb_resume_state", "checkpoint",
                                                                                   kind)]
    assert findings[0].step == RESUME


def test_a_loop_that_saves_nothing_the_watch_sees_is_not_judged():
    batches = _batches(0)
    first, _ = _train(_parts(0), batches, 0, RESUME)
    second, _ = _train(_parts(50), batches, RESUME, STEPS, previous=first)  # not even loaded: nothing to compare
    assert second.findings == [] and "bb_resume_state" in second.not_applicable
