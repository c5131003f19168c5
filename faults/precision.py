"""Faults in the `precision` subsystem: autocast, GradScaler, dtypes."""

import math
import time

import torch
import torch.nn.functional as F

from faultbench.faults.registry import Manifest, fault
from faultbench.model.distributed import global_target_count, grad_sync_context, mean_over_ranks
from faultbench.model.loss import count_targets
from faultbench.model.train import StepRecord, clip_gradients, forward_loss, optimizer_step


@fault(
    "missing_unscale_before_clip",
    seam="model.train.clip_gradients",
    title="Gradients clipped while still multiplied by the loss scale (scaler.unscale_ after the clip)",
    subsystem="precision",
    also_acceptable=("optimizer",),
    trigger="amp-only",
    symptoms=("silent-quality",),
    explanation="clip_gradients calls clip_grad_norm_ before scaler.unscale_(optimizer), not after. Under fp16 "
    "the gradients are still multiplied by the GradScaler's scale (65536 at first), so the measured and "
    "logged norm is ~65536 times the true one and every step is clipped to max_norm in scaled units: "
    "once they are unscaled the gradients are 65536 times smaller than intended. fp32 and bf16 "
    "runs (scaler disabled) are unaffected.",
    fix="Call scaler.unscale_(optimizer) before clip_grad_norm_, so clipping (and the logged norm) sees "
    "the true gradients; scaler.step() then does not unscale twice.",
    references=(
        "PyTorch docs, 'Automatic Mixed Precision examples', section 'Gradient clipping': unscale_ "
        "before clip_grad_norm_",
        "PyTorch forums: 'Gradient clipping with torch.cuda.amp' (clipping the scaled gradients)",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, variant={"train": {"precision": "fp16"}},
                      params={"min_ratio": 3e4, "max_ratio": 1.3e5}),
)
def clip_gradients_scaled(model, optimizer, scaler, max_norm: float) -> float:
    """Clips the still-scaled gradients: unscale_ comes after the clip."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    scaler.unscale_(optimizer)
    return float(norm)


@fault(
    "amp_no_scaling",
    seam="model.precision.make_grad_scaler",
    title="GradScaler enabled only for precision 'float16', a name the config never uses: fp16 runs unscaled",
    subsystem="precision",
    trigger="amp-only",
    symptoms=("silent-quality",),
    explanation="make_grad_scaler enables the scaler when precision == 'float16', but the config spells "
    "it 'fp16', so fp16 training runs with a disabled scaler (scale 1.0). Backward through the fp16 "
    "matmuls then carries the raw per-token gradients; those below fp16's subnormal range (~6e-8) flush "
    "to exactly zero and the rest lose precision. How much vanishes depends on the gradients' magnitude: "
    "with small-init weights (or a large token count per window) a large share of gradient entries is "
    "exactly zero and those weights stop learning; nothing is logged, no step is skipped (scale stays 1).",
    fix="Enable the scaler for the config's own spelling: enabled=(precision == 'fp16').",
    references=(
        "PyTorch docs, 'Automatic Mixed Precision package - torch.amp', Gradient Scaling: small gradients "
        "underflow to zero in float16 without loss scaling",
        "Micikevicius et al., 'Mixed Precision Training' (ICLR 2018): loss scaling to preserve small "
        "gradient values",
    ),
    manifest=Manifest(check="extra_at_least", steps=2,
                      variant={"model": {"init_std": 0.002}, "train": {"precision": "fp16"}},
                      params={"key": "grad_zero_fraction", "faulty_min": 0.05, "clean_max": 0.01}),
)
def make_grad_scaler_misnamed(precision: str, device_type: str, init_scale: float = 2.0**16) -> torch.amp.GradScaler:
    """Enabled for 'float16', never for the config's 'fp16'."""
    return torch.amp.GradScaler(device_type, init_scale=init_scale, enabled=precision == "float16")


@fault(
    "scaler_update_never_called",
    seam="model.train.optimizer_step",
    title="scaler.update() never called after scaler.step(): the second step raises",
    subsystem="precision",
    also_acceptable=("optimizer",),
    trigger="amp-only",
    symptoms=("crash-state",),
    explanation="optimizer_step steps through the scaler but never calls scaler.update(). Besides never "
    "adapting the scale (an overflow would be followed by the same overflow forever), the scaler's "
    "per-optimizer state is never reset, so on the next step scaler.unscale_ in clip_gradients raises "
    "'unscale_() is being called after step().' fp32/bf16 runs "
    "(scaler disabled) never notice.",
    fix="Call scaler.update() once per optimizer step, after scaler.step(optimizer).",
    references=(
        "PyTorch docs, 'Automatic Mixed Precision examples': scaler.step(optimizer) then scaler.update() "
        "every iteration",
        "PyTorch source torch/amp/grad_scaler.py: unscale_() raises 'unscale_() is being called after "
        "step().' until update() resets the per-optimizer state",
    ),
    manifest=Manifest(check="crash", steps=3, variant={"train": {"precision": "fp16"}},
                      params={"types": ("RuntimeError",), "seam": "model.train.clip_gradients",
                              "min_step": 1}),
)
def optimizer_step_no_update(optimizer, scaler, scheduler) -> bool:
    """Never calls scaler.update()."""
    scale_before = scaler.get_scale()
    scaler.step(optimizer)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return scaler.get_scale() < scale_before


@fault(
    "softmax_in_fp16",
    seam="model.attention.attend",
    title="Hand-written attention softmax (exp / sum, no max subtraction) computed in fp16: overflow to NaN",
    subsystem="precision",
    also_acceptable=("model",),
    trigger="amp-only",
    symptoms=("nan",),
    explanation="attend replaces SDPA with an explicit exp(scores) / sum(exp(scores)) in the autocast "
    "dtype. Without subtracting the row maximum, exp overflows to inf as soon as an attention score "
    "exceeds ~11.1 in fp16 (88.7 in fp32, so fp32 runs of the same code look fine), and inf / inf is NaN: "
    "the loss is NaN from the first batch whose attention logits are that large (large-magnitude "
    "queries/keys: a larger init, or the attention-logit growth of high-LR training). That is CPU autocast, "
    "which keeps exp in fp16; CUDA autocast runs exp in fp32, so on a GPU this code overflows only as fp32 does "
    "(no NaN on an H100 with the same manifest: results/gpu/).",
    fix="Use a stable softmax (torch.softmax subtracts the max) in fp32 (scores.float().softmax(-1)."
    "to(v.dtype)), or keep SDPA.",
    references=(
        "Wortsman et al., 'Small-scale proxies for large-scale Transformer training instabilities' (2023): "
        "attention logit growth",
        "HF transformers GPT-2 config option reorder_and_upcast_attn: upcast attention scores to fp32 "
        "for fp16 stability",
        "Milakov & Gimelshein, 'Online normalizer calculation for softmax' (the max-subtraction trick)",
    ),
    manifest=Manifest(check="nan", steps=2, variant={"model": {"init_std": 0.2}, "train": {"precision": "fp16"}},
                      params={"by_step": 2}),
)
def attend_naive_softmax(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """Explicit exp / sum softmax in the compute dtype, without subtracting the row max."""
    scale = q.size(-1) ** -0.5
    scores = q @ k.transpose(-2, -1) * scale  # (B, nh, T_q, T_k)
    if attn_mask is None:
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    else:
        scores = scores + attn_mask
    weights = scores.exp()
    probs = weights / weights.sum(dim=-1, keepdim=True)
    probs = F.dropout(probs, dropout_p)
    return probs @ v


@fault(
    "loss_scaled_twice",
    seam="model.train.train_step",
    title="The loss is multiplied by the GradScaler scale twice: gradients scaled by scale^2 overflow",
    subsystem="precision",
    also_acceptable=("optimizer",),
    trigger="amp-only",
    symptoms=("stall",),
    explanation="train_step scales the micro-batch loss with scaler.scale() and then scales it again "
    "for backward, so the gradients carry scale^2 (2^32 at first) and overflow fp16: the scaler finds "
    "inf, skips the step and halves the scale, step after step, until scale^2 fits; for those steps "
    "nothing is learned (the loss does not move), and afterwards the gradients are still scale times "
    "too large after unscaling (the logged grad norm is huge, clipping fires every step).",
    fix="Scale exactly once: scaler.scale(loss).backward() on the unscaled loss.",
    references=(
        "PyTorch docs, 'Automatic Mixed Precision examples': only scaler.scale(loss).backward(); "
        "unscale_ exactly once per step",
        "PyTorch forums: 'GradScaler skipping every step / scale keeps decreasing' (inf gradients)",
    ),
    manifest=Manifest(check="skipped_steps", steps=6, variant={"train": {"precision": "fp16"}},
                      params={"faulty_min": 5, "clean_max": 0}),
)
def train_step_double_scale(run, micro_batches: list[dict]) -> StepRecord:
    """Scales the loss once in the forward line and again for backward."""
    start = time.perf_counter()
    tcfg = run.config.train
    lr, scale = run.optimizer.param_groups[0]["lr"], run.scaler.get_scale()
    local_targets = sum(count_targets(b["labels"]) for b in micro_batches)
    # DDP averages gradients over ranks, so each rank normalizes by its equal share of the global count.
    per_rank_targets = global_target_count(local_targets, tcfg.device) / run.world_size
    loss = 0.0
    for i, batch in enumerate(micro_batches):
        with grad_sync_context(run.train_model, sync=i == len(micro_batches) - 1):
            micro_loss = run.scaler.scale(forward_loss(run.train_model, batch, per_rank_targets, tcfg.precision))
            run.scaler.scale(micro_loss).backward()
        loss += micro_loss.item() / scale
    grad_norm = clip_gradients(run.model, run.optimizer, run.scaler, tcfg.grad_clip)
    skipped = optimizer_step(run.optimizer, run.scaler, run.scheduler)
    record = StepRecord(
        step=run.step, loss=mean_over_ranks(loss, tcfg.device), grad_norm=grad_norm, lr=lr, scale=scale,
        skipped=skipped, tokens=int(sum(b["attention_mask"].sum() for b in micro_batches)),
        seconds=time.perf_counter() - start,
    )
    run.step += 1
    run.history.append(record)
    return record
