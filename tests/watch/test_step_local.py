"""bb_step_local_backward: a step's backward differentiates that step's forwards only (contract loss.state.step-local).

Hand-written loops over the nanoGPT-style model (tests/watch/nanogpt.py), each watched by this detector alone: two
ways to break the contract (a running loss kept as a tensor and backpropagated with retain_graph; the backward issued
after the optimizer step) and correct loops that look close to them (micro-batch accumulation, two backwards within one
step, a running loss kept as a number, a backward after the watch exited) stay silent. With AdamW both broken loops
end in PyTorch's "modified by an inplace operation" error (the step changed weights the earlier graph saved): the
finding, made as the backward reaches the earlier forward's logits, names the cause that error leaves out.
"""

from __future__ import annotations

import pytest
import torch

import faultbench
from tests.watch.nanogpt import SPLITS, TrainConfig, build

DETECTOR = "bb_step_local_backward"
STEPS = 4


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g, data, out = torch.Generator().manual_seed(0), SPLITS["train"], []
    for _ in range(n):
        ix = torch.randint(len(data) - 33, (4,), generator=g)
        out.append((torch.stack([data[i:i + 32] for i in ix]), torch.stack([data[i + 1:i + 33] for i in ix])))
    return out


def _loop(shape: str):
    """A loop of ``shape`` under a watch of the detector alone; returns (watch, what the loop raised or None)."""
    torch.set_num_threads(1)
    model, optimizer, _ = build(TrainConfig(), seed=0)
    w = faultbench.watch(model, optimizer, report=False, detectors=[DETECTOR])
    micro = 2 if shape == "accumulation" else 1
    raised = None
    try:
        _steps(shape, model, optimizer, w, micro)
    except RuntimeError as exc:
        raised = exc
    assert w.errors == {} and w.not_applicable == {}, (w.errors, w.not_applicable)
    return w, raised


def _steps(shape: str, model, optimizer, w, micro: int) -> None:
    running = 0.0
    with w:
        batches = _batches(STEPS * micro)
        for start in range(0, len(batches), micro):
            for x, y in batches[start:start + micro]:
                _, loss = model(x, y)
                if shape == "running_loss_tensor":  # the bug: the sum keeps every earlier step's graph
                    running = running + loss
                    running.backward(retain_graph=True)
                elif shape == "running_loss_number":  # the fix: a number for logging, this step's loss backpropagated
                    running += loss.item()
                    loss.backward()
                elif shape == "two_backwards_one_step":  # two losses of one forward, each backpropagated
                    (0.5 * loss).backward(retain_graph=True)
                    (0.5 * loss).backward()
                elif shape == "backward_after_step":  # the bug: the step comes first, with last step's gradients
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    continue
                else:  # "plain" and "accumulation"
                    (loss / micro).backward()
            if shape != "backward_after_step":
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("shape", ["plain", "accumulation", "running_loss_number", "two_backwards_one_step"])
def test_a_backward_of_its_own_step_draws_no_finding(shape):
    w, raised = _loop(shape)
    assert raised is None and [f for f in w.findings if f.detector == DETECTOR] == []


@pytest.mark.parametrize(("shape", "subsystem", "where", "words"), [
    ("running_loss_tensor", "loss", "loss", "also differentiated the forward of step 0"),
    ("backward_after_step", "optimizer", "optimizer", "after the optimizer had stepped"),
], ids=["running_loss_tensor", "backward_after_step"])  # ids without spaces: a failing node id is a command line
def test_a_backward_that_reaches_an_earlier_step_is_named(shape, subsystem, where, words):
    w, raised = _loop(shape)
    assert "modified by an inplace operation" in str(raised)  # PyTorch's error: the finding says why
    [finding] = [f for f in w.findings if f.detector == DETECTOR]
    assert (finding.subsystem, finding.where, finding.step) == (subsystem, where, 1)
    assert words in finding.message
    code = finding.evidence.pop("code", None)
    assert finding.evidence == {"forward_step": 0, "backward_step": 1}
    if where == "loss":  # the code that called the model: the loop's step, whose running sum is the bug
        assert code["qualname"] == f"{__name__}._steps" and code["library"] is None


def test_a_backward_after_the_watch_exited_is_not_judged():
    torch.set_num_threads(1)
    model, optimizer, _ = build(TrainConfig(), seed=0)
    w = faultbench.watch(model, optimizer, report=False, detectors=[DETECTOR])
    (x, y), = _batches(1)
    with w:
        _, kept = model(x, y)
        optimizer.step()  # no gradient yet: AdamW changes no weight, and the backward below runs after the exit
    kept.backward()
    assert w.findings == []
