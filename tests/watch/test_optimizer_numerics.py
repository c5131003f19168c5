"""bb_golden_update (optimizer.numerics.update-ratio) and bb_state_precision (optimizer.numerics.state-precision).

Hand-broken optimizers written for the contracts, each reporting the configuration a correct one reports: one that
steps with a larger LR than its groups say, one that forgets its moments at every step, one whose state comes back
empty at a resume, one that keeps its moments in bf16. The correct loop on other seeds than the golden's, and a
correct resume, stay silent.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

import faultbench
from tests.watch import nanogpt
from tests.watch.loops import watched_steps

torch.set_num_threads(1)

STEPS, RESUME = 16, 8
DETECTORS = ["bb_golden_update", "bb_state_precision"]


class UserAdamW(torch.optim.Optimizer):
    """A user's AdamW (decoupled decay, bias correction), reporting its groups as a correct one does; ``bug``:
    "hidden_lr" steps with 4 x the groups' LR, "forgetful" drops its moments before every step (each update is
    Adam's first: the bias-corrected sign of the gradient), "bf16_state" keeps its moments in bf16 between steps."""

    def __init__(self, params, lr: float, betas, bug: str | None = None):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": 0.0, "eps": 1e-8})
        self.bug = bug

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (b1, b2) = group["lr"] * (4.0 if self.bug == "hidden_lr" else 1.0), group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state or self.bug == "forgetful":
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["step"] += 1
                t, m, v = state["step"], state["m"].float(), state["v"].float()
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.mul_(1 - lr * group["weight_decay"])
                p.addcdiv_(m / (1 - b1**t), (v / (1 - b2**t)).sqrt_().add_(group["eps"]), value=-lr)
                dtype = torch.bfloat16 if self.bug == "bf16_state" else torch.float32
                state["m"], state["v"] = m.to(dtype), v.to(dtype)


def _parts(seed: int, user_optimizer: bool = False, bug: str | None = None):
    """The nanoGPT loop's model and its AdamW, or the user's own AdamW (with ``bug``) over the same groups."""
    model, optimizer, _ = nanogpt.build(seed=seed)
    if user_optimizer:
        optimizer = UserAdamW(optimizer.param_groups, optimizer.defaults["lr"], optimizer.defaults["betas"], bug)
    return model, optimizer


def _segment(model, optimizer, seed: int, start: int, stop: int, golden=None, previous=None):
    torch.manual_seed(seed + 1000)  # the data order: the same for a run and its resumed segment
    batches = [nanogpt.get_batch("train", 8, 32) for _ in range(stop)]
    return watched_steps(model, optimizer, batches[start:stop], golden=golden, detectors=DETECTORS, step=start,
                         previous=previous)


@functools.cache
def _golden() -> dict:
    return faultbench.record_golden([_segment(*_parts(s), s, 0, STEPS) for s in (100, 101)])


def _findings(w) -> list[tuple[str, str, str]]:
    return [(f.detector, f.subsystem, f.where) for f in w.findings]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_correct_loop_and_a_correct_resume_are_silent(seed):
    assert _golden()["steps"][0]["updates"]  # the envelope spans the ratio per group
    assert _findings(_segment(*_parts(seed), seed, 0, STEPS, golden=_golden())) == []
    assert _findings(_segment(*_parts(seed, user_optimizer=True), seed, 0, STEPS, golden=_golden())) == []
    model, optimizer = _parts(seed)
    first = _segment(model, optimizer, seed, 0, RESUME, golden=_golden())
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    model, optimizer = _parts(seed + 50)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    assert _findings(_segment(model, optimizer, seed, RESUME, STEPS, golden=_golden(), previous=first)) == []


@pytest.mark.parametrize("bug", ["hidden_lr", "forgetful"])
def test_an_update_rule_unlike_the_golden_is_an_optimizer_finding(bug):
    w = _segment(*_parts(0, True, bug), 0, 0, STEPS, golden=_golden())
    assert _findings(w) == [("bb_golden_update", "optimizer", "optimizer")], w.report()


def test_an_optimizer_state_lost_at_the_resume_is_a_checkpoint_finding():
    model, optimizer = _parts(0)
    first = _segment(model, optimizer, 0, 0, RESUME, golden=_golden())
    weights = model.state_dict()
    model, optimizer = _parts(50)
    model.load_state_dict(weights)  # the optimizer's state is not loaded
    for group in optimizer.param_groups:
        group["lr"] = first.ctx.optimizer.param_groups[0]["lr"]
    w = _segment(model, optimizer, 0, RESUME, STEPS, golden=_golden(), previous=first)
    assert _findings(w)[:1] == [("bb_golden_update", "checkpoint", "optimizer")], w.report()


def test_moments_kept_in_bf16_are_a_precision_finding():
    w = _segment(*_parts(0, True, "bf16_state"), 0, 0, 4)
    assert _findings(w) == [("bb_state_precision", "precision", "optimizer")], w.report()
    assert w.findings[0].evidence["state"] == {"m": "bfloat16", "v": "bfloat16"}


def test_weights_moved_where_the_known_good_runs_did_not_are_a_finding_not_an_error():
    """Known-good runs whose warmup starts at LR 0 record an update ratio of 0 at their first steps (a span [0, 0]):
    a run that moves its weights there is outside the span by any factor, said as such (no division by the 0)."""
    golden = copy.deepcopy(_golden())
    for step in golden["steps"]:
        step["updates"] = [[0.0, 0.0] for _ in step["updates"]]
    w = _segment(*_parts(0), 0, 0, STEPS, golden=golden)
    assert w.errors == {}
    assert _findings(w) == [("bb_golden_update", "optimizer", "optimizer")], w.report()
    assert float(w.findings[0].evidence["steps"][0]["times"]) == math.inf
    assert "where nothing moved in" in w.findings[0].message
