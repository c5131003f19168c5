"""bb_updates_applied: an optimizer step changes the parameters it has gradients for, and a training run steps.

Hand-broken loops: a user's optimizer whose update rebinds a name instead of writing the weight, a loop whose step
call is gone, and one that updates the weights by hand beside an optimizer it never steps; their correct twins
(including a warmup from LR 0, whose first step changes nothing by design) stay silent.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import faultbench

torch.set_num_threads(1)

VOCAB, DIM = 16, 8


class Bigram(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.head = torch.nn.Embedding(VOCAB, DIM), torch.nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        return self.head(self.wte(idx))


class SGD(torch.optim.Optimizer):
    """A user's SGD; ``rebind``: its update rebinds the loop variable (``p = p - lr * g``), so no weight changes."""

    def __init__(self, params, lr: float, rebind: bool = False):
        super().__init__(params, {"lr": lr})
        self.rebind = rebind

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.rebind:
                    p = p - group["lr"] * p.grad  # noqa: PLW2901 - the bug: a new tensor, the weight untouched
                else:
                    p.add_(p.grad, alpha=-group["lr"])


def run(bug: str | None = None, steps: int = 6, warmup_from_zero: bool = False):
    model = Bigram()
    optimizer = SGD(model.parameters(), lr=0.1, rebind=bug == "rebind")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: s / 3 if warmup_from_zero else 1.0)
    idx = torch.arange(2 * 12).view(2, 12) % VOCAB
    with faultbench.watch(model, optimizer, scheduler=scheduler, report=False,
                          detectors=["bb_updates_applied"]) as w:
        for _ in range(steps):
            logits = model(idx)
            F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten()).backward()
            if bug == "by_hand":
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
            if bug not in ("no_step", "by_hand"):
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    assert w.errors == {}
    return [(f.subsystem, f.where, f.evidence) for f in w.findings]


@pytest.mark.parametrize("warmup_from_zero", [False, True], ids=["constant", "warmup_from_0"])
def test_a_correct_loop_is_silent(warmup_from_zero):
    assert run(warmup_from_zero=warmup_from_zero) == []


def test_a_step_that_writes_its_update_nowhere_is_an_optimizer_finding():
    findings = run("rebind")
    assert [(s, w) for s, w, _ in findings] == [("optimizer", "optimizer")]
    assert findings[0][2] == {"step": 1, "params": 3}


@pytest.mark.parametrize(("bug", "changed"), [("no_step", False), ("by_hand", True)])
def test_a_training_run_whose_optimizer_never_steps_is_an_optimizer_finding(bug, changed):
    findings = run(bug)
    assert [(s, w) for s, w, _ in findings] == [("optimizer", "optimizer")]
    assert findings[0][2]["weights_changed"] is changed
