"""Precision detectors: scaler, clip-with-scaler and fp16 attention probes on hand-broken code (fp16 recipe)."""

import math

import pytest
import torch

from faultbench.detectors.precision import Fp16AttentionStress, ScalerMonitor
from faultbench.model.attention import attend
from faultbench.model.run import build_run
from faultbench.targets.ref.recipes import RECIPES
from tests.detectors.helpers import start_findings as findings


@pytest.fixture(scope="module")
def run():
    return build_run(RECIPES["fp16"].config(0))


def test_silent_on_the_reference(run):
    assert findings(ScalerMonitor, run) == []
    assert findings(Fp16AttentionStress, run) == []


def test_naive_softmax_is_flagged_but_stable_softmax_is_not(run):
    def naive(q, k, v, attn_mask, dropout_p):
        scores = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf")) if attn_mask is None else scores + attn_mask
        weights = torch.exp2(scores * 1.4426950408889634)  # exp via exp2, no max subtracted
        return (weights / weights.sum(-1, keepdim=True)) @ v

    def stable(q, k, v, attn_mask, dropout_p):
        scores = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf")) if attn_mask is None else scores + attn_mask
        return scores.float().softmax(-1).to(v.dtype) @ v

    found = findings(Fp16AttentionStress, run, **{"model.attention.attend": naive})
    assert [(f.subsystem, f.seam, f.confidence) for f in found] == [("precision", "model.attention.attend", 0.9)]
    assert findings(Fp16AttentionStress, run, **{"model.attention.attend": stable}) == []
    # a bug that breaks fp32 as well is not a precision problem: left to the model detectors
    assert findings(Fp16AttentionStress, run, **{"model.attention.attend": lambda q, k, v, m, p: attend(
        q, k, v, m, p).flip(-2)}) == []


def test_scaler_contracts(run):
    def unscale_after_clip(model, optimizer, scaler, max_norm):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
        scaler.unscale_(optimizer)
        return float(norm)

    def update_before_step(optimizer, scaler, scheduler):
        scale_before = scaler.get_scale()
        scaler.update()
        scaler.step(optimizer)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return scaler.get_scale() < scale_before

    for seam, broken in (("model.train.clip_gradients", unscale_after_clip),
                         ("model.train.optimizer_step", update_before_step)):
        found = findings(ScalerMonitor, run, **{seam: broken})
        assert [(f.subsystem, f.seam, f.confidence) for f in found] == [("precision", seam, 0.9)], seam


def test_disabled_scaler_is_traced_to_make_grad_scaler(run):
    saved = run.scaler
    cuda_only = lambda precision, device_type, init_scale=2.0**16: torch.amp.GradScaler(  # noqa: E731
        device_type, init_scale=init_scale, enabled=precision == "fp16" and device_type == "cuda")
    try:
        run.scaler = cuda_only("fp16", "cpu")
        found = findings(ScalerMonitor, run, **{"model.precision.make_grad_scaler": cuda_only})
    finally:
        run.scaler = saved
    assert [(f.seam, f.confidence) for f in found] == [("model.precision.make_grad_scaler", 0.9)]
