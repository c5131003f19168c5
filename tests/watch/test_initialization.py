"""bb_golden_init (blocks.numerics.init-scale, positions.state.derived-tables): the model starts as the known-good
runs started.

Hand-broken initializations of the nanoGPT-style model, each a classic: GPT-2's scaled residual projections left
at the plain std, one layer drawn with std 0.2 instead of 0.02, a LayerNorm whose weight starts at 0, and a rotary
frequency table (a buffer the model derives from its config) computed with another base. The correct model on
other seeds than the golden's stays silent, and a resumed watch is not judged.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import faultbench
from tests.watch import nanogpt
from tests.watch.loops import watched_steps

torch.set_num_threads(1)


def _model(seed: int, bug: str | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer, _ = nanogpt.build(seed=seed)
    base = 1000.0 if bug == "rotary_base" else 10000.0  # a derived table: the model carries it, unused here
    model.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, 16, 2).float() / 16), persistent=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if bug == "residual_unscaled" and name.endswith("c_proj.weight"):
                p.normal_(0.0, 0.02)
            if bug == "one_layer_std" and name == "transformer.h.1.mlp.c_fc.weight":
                p.normal_(0.0, 0.2)
            if bug == "norm_zero" and name == "transformer.h.0.ln_1.weight":
                p.zero_()
    return model, optimizer


def _watch(model, optimizer, golden=None, step: int = 0, previous=None):
    batches = [nanogpt.get_batch("train", 4, 16) for _ in range(2)]
    return watched_steps(model, optimizer, batches, golden=golden, detectors=["bb_golden_init"], step=step,
                         previous=previous)


@functools.cache
def _golden() -> dict:
    return faultbench.record_golden([_watch(*_model(s)) for s in (100, 101)])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_correct_model_is_silent(seed):
    assert len(_golden()["init"]) == len(dict(_model(0)[0].named_parameters())) + 1  # every tensor, the buffer
    assert _watch(*_model(seed), golden=_golden()).findings == []


@pytest.mark.parametrize(("bug", "module"), [
    ("residual_unscaled", "transformer.h.0.attn.c_proj"),  # the first c_proj in the model's order
    ("one_layer_std", "transformer.h.1.mlp.c_fc"),
    ("norm_zero", "transformer.h.0.ln_1"),
    ("rotary_base", ""),  # the model's own buffer: its module is the model
])
def test_an_initialization_unlike_the_golden_is_a_model_finding_at_its_module(bug, module):
    w = _watch(*_model(0, bug), golden=_golden())
    assert [(f.detector, f.subsystem, f.step) for f in w.findings] == [("bb_golden_init", "model", 0)], w.report()
    finding = w.findings[0]
    assert finding.where == (module or "inv_freq")
    if bug == "residual_unscaled":  # every layer's two projections, 0.02 where 0.02 / sqrt(2 n_layer) belongs
        layers = nanogpt.GPTConfig().n_layer
        assert finding.evidence["count"] == 2 * layers
        lo, hi = _golden()["init"]["transformer.h.0.attn.c_proj.weight"]["std"]
        assert hi < 0.02 / math.sqrt(2 * layers) * 1.1 and f"{lo:.4g}-{hi:.4g}" in finding.message


def test_a_resumed_run_is_not_judged_by_its_initialization():
    model, optimizer = _model(0, "one_layer_std")
    first = _watch(model, optimizer, golden=_golden())
    resumed = _watch(model, optimizer, golden=_golden(), step=2, previous=first)
    assert "bb_golden_init" in resumed.not_applicable and resumed.findings == []
