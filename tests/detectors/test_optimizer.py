"""Optimizer detectors: param-group, schedule, optimizer_step, clip and train_step probes on hand-broken code."""

import math
import time

import pytest
import torch

from faultbench.detectors.optimizer import GradHygiene, LrSchedule, OptimizerConfig, TrainStepContract, expected_lr
from faultbench.model.optim import configure_optimizer, lr_at
from faultbench.model.run import build_run
from faultbench.model.train import StepRecord, clip_gradients, forward_loss, optimizer_step
from faultbench.targets.ref.recipes import RECIPES
from tests.detectors.helpers import start_findings as findings


@pytest.fixture(scope="module")
def run():
    return build_run(RECIPES["accum"].config(0))


@pytest.mark.parametrize("recipe", ["fp32", "accum", "fp16"])
def test_the_formula_is_the_documented_schedule(recipe):
    cfg = RECIPES[recipe].config(0).train
    for step in range(cfg.steps + 3):
        assert expected_lr(step, cfg) == pytest.approx(lr_at(step, cfg), rel=1e-12)


def test_silent_on_the_reference(run):
    for cls in (OptimizerConfig, LrSchedule, GradHygiene, TrainStepContract):
        assert findings(cls, run) == [], cls.id


def test_swapped_betas_and_missing_group(run):
    saved = run.optimizer
    try:
        groups = configure_optimizer(run.model, run.config.train).param_groups
        run.optimizer = torch.optim.AdamW([{"params": groups[0]["params"], "weight_decay": 0.1}], lr=3e-3,
                                          betas=(0.95, 0.9))
        found = findings(OptimizerConfig, run)
    finally:
        run.optimizer = saved
    assert [(f.seam, f.confidence) for f in found] == [("model.optim.configure_optimizer", 0.9)]
    assert "in no param group" in found[0].message and "betas" in found[0].message


def test_schedule_seams(run, monkeypatch):
    def undivided(step, cfg):
        return cfg.lr * (step + 1) if step < cfg.warmup_steps else lr_at(step, cfg)

    def absolute(optimizer, cfg):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg))

    with monkeypatch.context() as patch:  # as an injection does: make_scheduler's lambda calls the broken lr_at
        patch.setattr("faultbench.model.optim.lr_at", undivided)
        assert [f.seam for f in findings(LrSchedule, run)] == ["model.optim.lr_at"]
    assert [f.seam for f in findings(LrSchedule, run, **{"model.optim.make_scheduler": absolute})] == [
        "model.optim.make_scheduler"]


def test_optimizer_step_and_clip_contracts(run):
    def no_zero_grad(optimizer, scaler, scheduler):
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        return False

    def zero_first(optimizer, scaler, scheduler):
        optimizer.zero_grad(set_to_none=True)
        return optimizer_step(optimizer, scaler, scheduler)

    def no_clip(model, optimizer, scaler, max_norm):
        return clip_gradients(model, optimizer, scaler, 0.0)

    for seam, broken in (("model.train.optimizer_step", no_zero_grad), ("model.train.optimizer_step", zero_first),
                         ("model.train.clip_gradients", no_clip)):
        found = findings(GradHygiene, run, **{seam: broken})
        assert [(f.seam, f.confidence) for f in found] == [(seam, 0.9)], broken.__name__


def _train_step_variant(clip_first=False, schedule_per_micro=False):
    """A train_step written out with one deliberate mistake (the structure of model.train.train_step)."""

    def step(run, micro_batches):
        tcfg = run.config.train
        lr, scale = run.optimizer.param_groups[0]["lr"], run.scaler.get_scale()
        targets = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
        if clip_first:
            grad_norm = clip_gradients(run.model, run.optimizer, run.scaler, tcfg.grad_clip)
        loss = 0.0
        for batch in micro_batches:
            micro = forward_loss(run.train_model, batch, targets, tcfg.precision)
            run.scaler.scale(micro).backward()
            loss += micro.item()
            if schedule_per_micro:
                run.scheduler.step()
        if not clip_first:
            grad_norm = clip_gradients(run.model, run.optimizer, run.scaler, tcfg.grad_clip)
        skipped = optimizer_step(run.optimizer, run.scaler, run.scheduler)
        record = StepRecord(run.step, loss, grad_norm, lr, scale, skipped, 0, time.perf_counter())
        run.step += 1
        run.history.append(record)
        return record

    return step


def test_train_step_contract(run):
    found = findings(TrainStepContract, run, **{"model.train.train_step": _train_step_variant()})
    assert found == []
    for broken, hint in ((_train_step_variant(clip_first=True), "logged pre-clip grad norm 0,"),
                         (_train_step_variant(schedule_per_micro=True), "schedule advanced")):
        found = findings(TrainStepContract, run, **{"model.train.train_step": broken})
        assert [(f.seam, f.confidence) for f in found] == [("model.train.train_step", 0.85)]
        assert hint in found[0].message
    assert math.isfinite(found[0].evidence["reference_grad_norm"])
