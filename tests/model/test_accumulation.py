"""Gradient accumulation: accum micro-batches of one global batch == one batch of all of it.

Each micro-batch's loss is divided by the token count of the whole window, so the summed gradient is
the gradient of the window's token mean. Micro-batches here have different lengths and different
target counts, so averaging per-micro-batch means (a classic bug) gives a different gradient.
"""

from __future__ import annotations

import pytest
import torch

from faultbench.model.loss import count_targets
from faultbench.model.run import build_run
from faultbench.model.train import forward_loss, next_micro_batches, train_step

# Accumulated vs single-batch gradients, per parameter tensor: measured max |diff| / max |grad|
# = 3.4e-7 (accum 2) and 2.9e-7 (accum 4) in fp32; different padding widths change rounding only.
GRAD_REL_TOL = 2e-6
# Parameters after one full train_step: measured max abs diff 4.3e-8 (one Adam step moves them ~1.5e-4).
PARAM_ATOL = 1e-6


def build(tiny_cfg, accum: int):
    return build_run(tiny_cfg.replace(train={"accum": accum}, seed=0))


def accumulated_grads(run) -> tuple[dict, float, list[dict]]:
    batches = next_micro_batches(run)
    n = sum(count_targets(b["labels"]) for b in batches)
    loss = 0.0
    for b in batches:
        micro = forward_loss(run.model, b, n, run.config.train.precision)
        micro.backward()
        loss += micro.item()
    return {k: p.grad.clone() for k, p in run.model.named_parameters()}, loss, batches


def real_docs(batches) -> list[list[int]]:
    """The documents of a list of micro-batches, pads stripped, in order."""
    docs = []
    for b in batches:
        for row, mask in zip(b["input_ids"], b["attention_mask"], strict=True):
            docs.append(row[mask.bool()].tolist())
    return docs


@pytest.fixture(scope="module")
def single(tiny_cfg):
    return accumulated_grads(build(tiny_cfg, 1))


@pytest.mark.parametrize("accum", [2, 4])
def test_accumulated_gradients_equal_full_batch(tiny_cfg, single, accum):
    full_grads, full_loss, full_batches = single
    grads, loss, batches = accumulated_grads(build(tiny_cfg, accum))
    assert len(batches) == accum and len(full_batches) == 1
    # same global batch, split in order
    assert real_docs(batches) == real_docs(full_batches)
    # the split is uneven: the comparison would expose per-micro-batch averaging
    assert len({count_targets(b["labels"]) for b in batches}) > 1
    assert len({b["input_ids"].shape[1] for b in batches}) > 1
    assert loss == pytest.approx(full_loss, rel=1e-6)
    for name, g in full_grads.items():
        rel = ((grads[name] - g).abs().max() / g.abs().max()).item()
        assert rel < GRAD_REL_TOL, f"{name}: relative grad diff {rel:.2e}"


def test_train_step_with_accumulation_matches_one_batch(tiny_cfg):
    runs = {accum: build(tiny_cfg, accum) for accum in (1, 4)}
    records = {accum: train_step(run, next_micro_batches(run)) for accum, run in runs.items()}
    assert records[4].loss == pytest.approx(records[1].loss, rel=1e-6)
    assert records[4].grad_norm == pytest.approx(records[1].grad_norm, rel=1e-6)
    assert records[4].tokens == records[1].tokens
    params1 = dict(runs[1].model.named_parameters())
    for name, p in runs[4].model.named_parameters():
        assert torch.allclose(p, params1[name], rtol=0, atol=PARAM_ATOL), name
    fresh = build(tiny_cfg, 1).model
    moved = max((p - q).abs().max().item() for p, q in zip(fresh.parameters(), runs[4].model.parameters(), strict=True))
    assert moved > 100 * PARAM_ATOL  # the step really changed the parameters
