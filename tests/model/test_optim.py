"""Optimizer setup and learning-rate schedule."""

from __future__ import annotations

import pytest

from faultbench.model.config import TrainConfig
from faultbench.model.optim import configure_optimizer, lr_at
from faultbench.model.run import build_run
from faultbench.model.train import train

CFG = TrainConfig(steps=100, lr=1e-3, min_lr=1e-4, warmup_steps=10)


def test_warmup_is_linear_to_lr():
    assert [lr_at(s, CFG) for s in range(10)] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])


def test_cosine_decays_to_min_lr():
    assert lr_at(10, CFG) == pytest.approx(1e-3)
    assert lr_at(55, CFG) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # half way: the mean
    assert lr_at(100, CFG) == pytest.approx(1e-4)
    assert lr_at(500, CFG) == pytest.approx(1e-4)  # stays at the floor past the end
    decay = [lr_at(s, CFG) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))


def test_recorded_lr_follows_the_schedule(tiny_cfg):
    run = build_run(tiny_cfg.replace(train={"steps": 30, "warmup_steps": 5}, seed=0))
    train(run, until=12)
    expected = [lr_at(s, run.config.train) for s in range(12)]
    assert [r.lr for r in run.history] == pytest.approx(expected, rel=1e-12)
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(12, run.config.train))


def test_weight_decay_only_on_linear_matrices(tiny_cfg):
    run = build_run(tiny_cfg)
    model = run.model
    opt = configure_optimizer(model, tiny_cfg.train)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == tiny_cfg.train.weight_decay > 0 and no_decay["weight_decay"] == 0.0
    # exactly the linear layers' matrices are decayed: not the tied embedding/head matrix, biases or norms
    linear = {n for n, p in model.named_parameters() if p.dim() == 2 and n != "wte.weight"}
    assert linear and {names[id(p)] for p in decay["params"]} == linear
    assert {names[id(p)] for p in no_decay["params"]} == set(names.values()) - linear
    # every parameter exactly once (the tied matrix is shared, not duplicated)
    all_ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(all_ids) == len(set(all_ids)) == len(list(model.parameters()))
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params()
    assert model.lm_head.weight is model.wte.weight


def test_adam_hyperparameters_come_from_the_config(tiny_cfg):
    # regression guard: betas are (beta1, beta2) in that order; swapping them trains ~0.075 nats worse
    cfg = tiny_cfg.replace(train={"betas": (0.8, 0.97), "eps": 1e-7})
    optimizer = configure_optimizer(build_run(cfg).model, cfg.train)
    for group in optimizer.param_groups:
        assert group["betas"] == (0.8, 0.97) and group["eps"] == 1e-7 and group["lr"] == cfg.train.lr
