"""Loops the watch tests share."""

from __future__ import annotations

import faultbench


def watched_steps(model, optimizer, batches, **watch_kwargs) -> faultbench.watch:
    """The plainest loop (forward, backward, step, zero_grad) over ``batches`` ((x, y) pairs; the model returns
    (logits, loss)) under ``faultbench.watch(model, optimizer, report=False, **watch_kwargs)``: the watch, which
    must have recorded no detector error."""
    w = faultbench.watch(model, optimizer, report=False, **watch_kwargs)
    with w:
        for x, y in batches:
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert w.errors == {}, w.errors
    return w
