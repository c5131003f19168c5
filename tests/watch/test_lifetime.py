"""What a watch keeps after its loop: no frame of the loop, no graph, no model once the user lets go of them.

A kept exception holds its traceback, and a traceback's frames hold the loop's locals (the last loss and its graph)
and, through the loop's globals, the watch itself: the probes of a model that takes no attention mask keep the
reasons they are not applicable, and such a loop once got a false bb_graphs_released finding and left its model
alive. Three loop shapes: the step in a nested function, the loop inline, the step as a method of a trainer object.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import faultbench
from tests.watch import nanogpt

STEPS = 8


class Trainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def step(self, x, y):
        logits, loss = self.model(x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def _train(shape: str, model, optimizer) -> faultbench.watch:
    torch.manual_seed(0)
    w = faultbench.watch(model, optimizer, report=False)
    trainer = Trainer(model, optimizer)

    def step(x, y):
        logits, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with w:
        for _ in range(STEPS):
            x, y = nanogpt.get_batch("train", 8, 32)
            if shape == "function":
                step(x, y)
            elif shape == "method":
                trainer.step(x, y)
            else:
                logits, loss = model(x, y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return w


@pytest.mark.parametrize("shape", ["function", "inline", "method"])
def test_a_watch_keeps_no_frame_graph_or_model_of_the_loop(shape):
    model, optimizer, _ = nanogpt.build(seed=0)
    w = _train(shape, model, optimizer)
    assert "bb_graphs_released" not in {f.detector for f in w.findings}, w.report()
    assert w.not_applicable  # the probes that need a mask or a cache said why (the kept reasons)
    model_ref = weakref.ref(model)
    del model, optimizer, w
    gc.collect()
    assert model_ref() is None


def test_a_long_run_keeps_a_bounded_history_and_still_counts_every_step(monkeypatch):
    from faultbench.detectors.blackbox.api import StepHistory

    monkeypatch.setattr(StepHistory, "LIMIT", 3)
    model, optimizer, _ = nanogpt.build(seed=0)
    w = _train("inline", model, optimizer)
    history = w.ctx.history
    assert (len(history), history.recorded, history.dropped) == (3, STEPS, STEPS - 3)
    assert [r.step for r in history] == [r.step for r in history[-3:]] == list(range(STEPS - 2, STEPS + 1))
    assert w.findings == [], w.report()
    with pytest.raises(ValueError, match="kept the last 3 of its 8 step records"):
        faultbench.record_golden([w])
