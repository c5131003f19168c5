"""``FaultbenchCallback`` on the HF target's Trainer runs: silent on clean runs, and the top finding in the fault's
subsystem on faults of three subsystems (optimizer, collate, eval). Each run trains once per module (~3 s)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from faultbench import targets

torch.set_num_threads(1)
targets.get("hf")  # sets HF_HUB_OFFLINE before transformers is imported

from faultbench.faults.inject import injected  # noqa: E402
from faultbench.faults.registry import get_fault  # noqa: E402
from faultbench.hf import FINDINGS_METRIC, FaultbenchCallback  # noqa: E402
from faultbench.targets.hf.recipes import RECIPES  # noqa: E402
from faultbench.targets.hf.run import build_run  # noqa: E402

# fault -> (recipe, where the top finding must point)
FAULTS = {
    "hf_missing_zero_grad": ("fp32", "optimizer"),
    "hf_pad_labels_not_ignored": ("fp32", "batch"),
    "hf_pad_side_mismatch": ("left_pad", "batch"),
    "hf_eval_in_train_mode": ("fp32", "eval"),
}


@functools.cache
def trained(recipe: str, fault: str | None, tmp: str):
    """(callback, run) of a Trainer run of ``recipe`` (with ``fault`` injected), evaluating at its 8th step."""
    with injected(fault) if fault else contextlib.nullcontext():
        run = build_run(RECIPES[recipe], 0, f"{tmp}/{recipe}-{fault}")
        run.trainer.args.eval_strategy, run.trainer.args.eval_steps = "steps", 8  # an evaluation inside train()
        callback = FaultbenchCallback(report=False)
        run.trainer.add_callback(callback)
        run.trainer.train()
    return callback, run


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hf_callback"))


@pytest.mark.parametrize("recipe", ["fp32", "left_pad"])
def test_the_callback_is_silent_on_clean_runs(recipe, tmp):
    callback, run = trained(recipe, None, tmp)
    watch = callback.watch
    assert watch.ctx.step == RECIPES[recipe].steps and not watch.attached
    assert watch.findings == [], [f"{f.detector}: {f.message}" for f in watch.findings]
    assert watch.errors == {}
    # the monitors that apply to a Trainer run did run
    assert {"bb_lr_shape", "bb_grads_cleared", "bb_pad_ids", "bb_eval_mode"}.isdisjoint(watch.not_applicable)
    assert any("eval_loss" in log for log in run.trainer.state.log_history)  # eval forwards were watched too
    logged = [log[FINDINGS_METRIC] for log in run.trainer.state.log_history if "loss" in log]
    assert logged and set(logged) == {0}  # the finding count reaches Trainer's log history
    assert watch.ctx.scheduler is run.trainer.lr_scheduler and all(r.lrs for r in watch.ctx.history)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_the_callback_names_the_faults_subsystem_first(fault, tmp):
    recipe, where = FAULTS[fault]
    watch = trained(recipe, fault, tmp)[0].watch
    assert watch.findings, f"{fault}: no finding"
    top = watch.findings[0]
    assert (top.subsystem, top.where) == (get_fault(fault).subsystem, where), [
        f"{f.detector} [{f.subsystem}] {f.where}: {f.message}" for f in watch.findings]


def test_findings_reach_the_log_history_as_they_are_made(tmp):
    """Gradients never cleared are seen within the first steps: later logs of the run carry the count."""
    callback, run = trained("fp32", "hf_missing_zero_grad", tmp)
    counts = [log[FINDINGS_METRIC] for log in run.trainer.state.log_history if FINDINGS_METRIC in log]
    assert counts == sorted(counts) and 0 < counts[-1] <= len(callback.watch.findings)


def test_attach_puts_the_callback_ahead_of_the_reporting_ones(tmp):
    run = build_run(RECIPES["fp32"], 0, f"{tmp}/attach")
    callback = FaultbenchCallback(report=False).attach(run.trainer)
    assert run.trainer.callback_handler.callbacks[0] is callback


# ---- a resumed Trainer: the callback watches it from state.global_step, handed the first segment's watch ----------
RESUMED = {
    None: None,
    "hf_resume_optimizer_not_restored": ("bb_resume_continuity", "optimizer"),
    "hf_resume_scheduler_not_restored": ("bb_golden_lr", "scheduler"),
    "hf_resume_rng_not_restored": ("bb_rng_continuity", "checkpoint"),
}


@functools.cache
def resumed(fault: str | None, tmp: str, seed: int = 0):
    """(first watch, resumed watch) of the resume recipe: train to resume_at with a checkpoint, then a fresh Trainer
    resumed from it, each with a FaultbenchCallback; the golden is two clean runs of the recipe on other seeds."""
    from faultbench.targets.hf.hooks import checkpoint_dir, train
    from faultbench.watch import record_golden

    recipe = RECIPES["resume"]

    def segments(seed, golden, folder):
        run = build_run(recipe, seed, folder)
        first = FaultbenchCallback(report=False, golden=golden)
        run.trainer.add_callback(first)
        train(run, stop_at=recipe.resume_at)
        again = build_run(recipe, seed, folder)
        second = FaultbenchCallback(previous=first.watch, report=False, golden=golden)
        again.trainer.add_callback(second)
        train(again, resume=checkpoint_dir(folder, recipe.resume_at))
        return first.watch, second.watch

    golden = record_golden([[*a.ctx.history, *b.ctx.history] for a, b in
                            (segments(s, None, f"{tmp}/golden-{s}") for s in (1000, 1001))])
    with injected(fault) if fault else contextlib.nullcontext():
        return segments(seed, golden, f"{tmp}/resume-{fault}-{seed}")


@pytest.mark.parametrize("fault", list(RESUMED), ids=str)
def test_a_resumed_trainer_is_watched_from_its_global_step(fault, tmp):
    first, second = resumed(fault, tmp)
    at = RECIPES["resume"].resume_at
    assert second.ctx.start_step == at and second.ctx.previous is first.ctx
    assert [r.step for r in second.ctx.history] == list(range(at + 1, RECIPES["resume"].steps + 1))
    assert first.findings == [], [f"{f.detector}: {f.message}" for f in first.findings]
    if fault is None:
        assert second.findings == [], [f"{f.detector}: {f.message}" for f in second.findings]
        assert second.ctx.history[0].opt_count == at + 1
        return
    top = second.findings[0]
    assert (top.detector, top.subsystem, top.where) == (*RESUMED[fault][:1], "checkpoint", RESUMED[fault][1]), [
        f"{f.detector} [{f.subsystem}] {f.where}: {f.message}" for f in second.findings]


@pytest.mark.parametrize("fault", [None, "hf_eval_in_train_mode"], ids=str)
def test_an_evaluate_after_train_is_watched_until_close(fault, tmp):
    """trainer.evaluate() after train(): its forwards reach the watch (the model in train mode is found), and after
    close() the model carries no hook of the watch."""
    with injected(fault) if fault else contextlib.nullcontext():
        run = build_run(RECIPES["fp32"], 0, f"{tmp}/evaluate-{fault}")
        callback = FaultbenchCallback(report=False)
        run.trainer.add_callback(callback)
        run.trainer.train()
        assert not callback.watch.attached and callback.watch.findings == []
        run.trainer.evaluate()
    watch = callback.watch
    if fault is None:
        assert watch.findings == [], [f"{f.detector}: {f.message}" for f in watch.findings]
    else:
        assert [(f.detector, f.subsystem, f.where) for f in watch.findings] == [("bb_eval_mode", "eval", "eval")]
    evaluated = [r.evals for r in watch.ctx.history if r.evals]
    assert evaluated and evaluated[-1][0] > 0  # the evaluated documents were counted on the last step's record
    callback.close()
    assert not run.model._forward_hooks and not run.model._forward_pre_hooks
