"""Mixed precision: fp16 (with GradScaler) and bf16 follow the fp32 run from the same seed.

The recorded grad_norm is measured after ``unscale_``: if unscale were skipped, clipping would see
the gradient multiplied by the loss scale (2**16 here), clip it to 1.0, and the optimizer would
then divide it by the scale again, so fp16 would barely move and its recorded norm would be ~65536x
too large. Comparing to fp32 catches both.
"""

from __future__ import annotations

import pytest
import torch

from faultbench.model.loss import count_targets
from faultbench.model.precision import autocast_context
from faultbench.model.run import build_run
from faultbench.model.train import clip_gradients, forward_loss, next_micro_batches, train

K = 15
# Max deviation from fp32 over the first 15 steps, measured on seeds 0 and 1:
#   fp16: loss rel 7.3e-6, grad_norm rel 2.7e-4;  bf16: loss rel 6.1e-5, grad_norm rel 1.5e-3.
# Tolerances keep ~10x headroom (CPU kernels may round differently on another machine).
TOLERANCE = {
    "fp16": {"loss": 1e-4, "grad_norm": 3e-3},
    "bf16": {"loss": 1e-3, "grad_norm": 1.5e-2},
}


@pytest.fixture(scope="module")
def fp32_history(tiny_cfg):
    run = build_run(tiny_cfg.replace(train={"precision": "fp32"}, seed=0))
    train(run, until=K)
    return run.history


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_low_precision_tracks_fp32(tiny_cfg, fp32_history, precision):
    run = build_run(tiny_cfg.replace(train={"precision": precision}, seed=0))
    train(run, until=K)
    tol = TOLERANCE[precision]
    assert not any(r.skipped for r in run.history), "a skipped step would desynchronize the comparison"
    for ref, got in zip(fp32_history, run.history, strict=True):
        assert got.lr == ref.lr
        assert got.loss == pytest.approx(ref.loss, rel=tol["loss"]), f"step {got.step}"
        assert got.grad_norm == pytest.approx(ref.grad_norm, rel=tol["grad_norm"]), f"step {got.step}"
    # the run actually learned, so "tracks" is not two flat lines (fp32: 5.53 -> 4.46 in 15 steps)
    assert run.history[-1].loss < run.history[0].loss - 0.5


def test_fp16_uses_a_large_loss_scale(tiny_cfg):
    run = build_run(tiny_cfg.replace(train={"precision": "fp16"}, seed=0))
    train(run, until=3)
    for r in run.history:
        # with scale >= 2**10 a missing unscale would inflate grad_norm >= 1024x, far beyond tolerance
        assert r.scale >= 2**10 and not r.skipped
        assert 0.1 < r.grad_norm < 100.0  # the fp32 run's norms are ~1.3-3.2 in this window


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)], ids=["fp16", "bf16"]
)
def test_autocast_really_computes_in_low_precision(tiny_cfg, precision, dtype):
    # guards the comparison above against a silently-fp32 "low precision" path
    run = build_run(tiny_cfg.replace(train={"precision": precision}, seed=0))
    batch = next_micro_batches(run)[0]
    with autocast_context(precision, "cpu"):
        logits = run.model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    assert logits.dtype == dtype


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_clipping_sees_unscaled_gradient(tiny_cfg, precision):
    # After clip_gradients the .grad tensors must be the true gradients clipped to grad_clip, the same
    # as in fp32; the returned norm must be the true pre-clip norm.
    grads, norms = {}, {}
    for prec in ("fp32", precision):
        run = build_run(tiny_cfg.replace(train={"precision": prec}, seed=0))
        batches = next_micro_batches(run)
        n = sum(count_targets(b["labels"]) for b in batches)
        for b in batches:
            run.scaler.scale(forward_loss(run.model, b, n, prec)).backward()
        norms[prec] = clip_gradients(run.model, run.optimizer, run.scaler, run.config.train.grad_clip)
        grads[prec] = torch.cat([p.grad.flatten() for p in run.model.parameters()])
    assert norms["fp32"] > run.config.train.grad_clip  # the first step is clipped: clipping is exercised
    assert norms[precision] == pytest.approx(norms["fp32"], rel=TOLERANCE[precision]["grad_norm"])
    # measured: clipped norm 0.999997 (pre-clip 3.18); cosine to the fp32 gradient 0.999996 (bf16),
    # 1.000005 (fp16, rounding). A gradient left scaled (or clipped before unscaling) fails the norm.
    assert grads[precision].norm().item() == pytest.approx(run.config.train.grad_clip, rel=1e-3)
    cos = torch.nn.functional.cosine_similarity(grads[precision], grads["fp32"], dim=0).item()
    assert cos > 0.999
