"""bb_gradient_check: the gradients the optimizer steps with are the derivative of the loss, by finite differences.

Correct loops (plain, clipped, two micro-batches accumulated, a loss the model computes from its labels) are silent
and the check ran on each; hand-broken components are found and the wrong tensor named: a forward that detaches the
queries' path, a gradient hook that doubles one tensor's gradient, a custom activation whose backward is wrong.
Dropout in train mode makes the forward not reproducible: not applicable, said why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import faultbench
from tests.watch.test_conventions import SinusoidalLM, batch

torch.set_num_threads(1)


class WrongGelu(torch.autograd.Function):
    """GELU whose backward forgets the Gaussian density term (a hand-written kernel's bug)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 0.5 * (1 + torch.erf(x / 2 ** 0.5))


class Broken(SinusoidalLM):
    """The correct model with one bug: "detach" (the queries' path cut: q computed from x.detach()), "gelu" (the
    MLP's activation with a wrong backward)."""

    def __init__(self, bug: str):
        super().__init__()
        self.bug = bug
        if bug == "gelu":
            self.mlp[1] = _Act()
        if bug == "detach":
            self.qkv.register_forward_pre_hook(lambda m, args: (args[0].detach(),))


class _Act(nn.Module):
    def forward(self, x):
        return WrongGelu.apply(x)


def run(model: nn.Module, accumulate: int = 1, clip: float | None = None, hook: bool = False, steps: int = 2):
    rng = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if hook:  # a hook of the user's that doubles the head's weight gradient
        model.head.weight.register_hook(lambda g: g * 2)
    with faultbench.watch(model, optimizer, report=False, detectors=["bb_gradient_check"]) as w:
        for _ in range(steps):
            for _ in range(accumulate):
                (model(**batch(rng)).loss / accumulate).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert w.errors == {}
    return w


def _seeded(cls, *args):
    torch.manual_seed(0)
    return cls(*args)


@pytest.mark.parametrize(("accumulate", "clip"), [(1, None), (1, 0.05), (2, None)], ids=["plain", "clipped", "accum2"])
def test_a_correct_loop_passes_the_gradient_check(accumulate, clip):
    w = run(_seeded(SinusoidalLM), accumulate, clip)
    assert w.findings == [] and w.not_applicable == {}
    assert "bb_gradient_check" in w.step_seconds  # it ran


@pytest.mark.parametrize(("bug", "hook", "where"), [
    ("detach", False, "emb"), (None, True, "head"), ("gelu", False, "mlp.0")], ids=["detach", "hook", "backward"])
def test_a_gradient_that_is_not_the_derivative_is_found_and_the_tensor_named(bug, hook, where):
    model = _seeded(Broken, bug) if bug else _seeded(SinusoidalLM)
    w = run(model, hook=hook)
    assert [(f.detector, f.subsystem, f.where) for f in w.findings] == [("bb_gradient_check", "model", where)]
    assert w.findings[0].evidence["disagreement"] > 0.02


def test_dropout_in_train_mode_makes_the_check_not_applicable():
    model = _seeded(SinusoidalLM)
    model.mlp.append(nn.Dropout(0.2))
    w = run(model)
    assert w.findings == [] and "replay" in w.not_applicable["bb_gradient_check"]
