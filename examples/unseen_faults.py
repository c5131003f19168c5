"""Plugin faults written after the detectors' design was fixed, to score how the suite generalizes.

`faultbench bench --plugin examples/unseen_faults.py --only-plugin-faults` scores the suite on these
alone. None of them was used to develop or tune a detector: they test whether the detectors catch bug
classes rather than the builtin list. Each is a bug engineers have shipped.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from faultbench.faults.registry import Manifest, fault
from faultbench.model.config import TrainConfig
from faultbench.model.data import IGNORE_INDEX


@fault(
    "unseen_decay_on_everything",
    seam="model.optim.configure_optimizer",
    title="Weight decay applied to every parameter: norms, biases and the tied embedding shrink toward zero",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="configure_optimizer passes model.parameters() to AdamW with weight_decay, so LayerNorm gains, "
    "biases and the token embedding are decayed like matrices.",
    fix="Decay only the 2-D weight matrices; put norms, biases and embeddings in a group with weight_decay=0.",
    references=("nanoGPT configure_optimizers: 'all weight tensors in matmuls + embeddings decay, all biases and "
                "layernorms don't' (and the minGPT discussion of which parameters to decay)",),
    manifest=Manifest(check="loss_above", steps=100, params={"min_gap": 0.01}),
)
def configure_optimizer_decay_all(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Every parameter decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": params, "weight_decay": cfg.weight_decay}], lr=cfg.lr, betas=cfg.betas,
                             eps=cfg.eps)


@fault(
    "unseen_collate_drops_last_token",
    seam="model.data.collate",
    title="collate drops each document's last token (its EOS), as if the shift happened here",
    subsystem="collate",
    also_acceptable=("data",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="collate takes ids[:-1] 'because the last token has no target', but the shift happens in the "
    "loss: EOS is never an input nor a target, so the model never learns to end a document.",
    fix="Keep every token; the loss alone shifts.",
    references=("HF forum: 'labels shifted twice / last token dropped' in custom causal-LM collators",),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.01}),
)
def collate_drops_last(docs, pad_id: int, pad_side: str = "right", ignore_index: int = IGNORE_INDEX) -> dict:
    """Every document loses its last token."""
    docs = [d[:-1] for d in docs]
    B, T = len(docs), max(len(d) for d in docs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), ignore_index, dtype=torch.long)
    for row, ids in enumerate(docs):
        n = len(ids)
        start = 0 if pad_side == "right" else T - n
        tokens = torch.as_tensor(ids, dtype=torch.long)
        input_ids[row, start : start + n] = tokens
        attention_mask[row, start : start + n] = 1
        labels[row, start + 1 : start + n] = tokens[1:]
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask), "labels": labels}  # noqa: F821 (model.data's)


@fault(
    "unseen_decode_positions_restart",
    seam="model.rope.position_ids_from_mask",
    title="Positions counted from the new tokens' mask only: every cached decode step restarts at position 0",
    subsystem="position",
    also_acceptable=("model",),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="position_ids_from_mask counts real tokens in the columns after past_len only, so in cached "
    "decode (one new column) each new token gets position 0 while the prompt was placed at 0..n-1: prefill and "
    "decode disagree and cached generation drifts from the uncached forward.",
    fix="Count over the whole mask, then drop the first past_len columns.",
    references=("HF transformers issue: wrong position_ids during generation with past_key_values",),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "cached_logit_gap", "faulty_min": 1e-3, "clean_max": 1e-4}),
)
def positions_restart(attention_mask: torch.Tensor, past_len: int = 0) -> torch.Tensor:
    """Counted from the new columns only."""
    positions = attention_mask[:, past_len:].long().cumsum(-1) - 1
    return positions.clamp_(min=0)


@fault(
    "unseen_warmup_starts_at_zero",
    seam="model.optim.lr_at",
    title="Warmup off by one: the first step runs at learning rate 0",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="lr_at returns lr * step / warmup_steps, so step 0 takes no step at all and every warmup step lags.",
    fix="lr * (step + 1) / warmup_steps.",
    references=("PyTorch forum: LambdaLR warmup starting at zero learning rate (off-by-one in warmup)",),
    manifest=Manifest(check="lr_ratio", steps=4, params={"min_ratio": 0.0, "max_ratio": 0.01}),
)
def lr_at_zero_start(step: int, cfg: TrainConfig) -> float:
    """Warmup from zero."""
    if step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


@fault(
    "unseen_clip_per_parameter",
    seam="model.train.clip_gradients",
    title="Gradients clipped parameter by parameter instead of by the global norm",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="clip_gradients calls clip_grad_norm_ on each parameter separately and returns the last one's norm: "
    "every tensor is clipped to max_norm on its own (the update direction changes) and the logged norm is "
    "that of one bias.",
    fix="One call over all parameters: the global norm.",
    references=("PyTorch docs, clip_grad_norm_: 'The norm is computed over all gradients together, as if they "
                "were concatenated into a single vector'",),
    manifest=Manifest(check="grad_norm_ratio", steps=2, params={"min_ratio": 0.0, "max_ratio": 0.5}),
)
def clip_per_parameter(model, optimizer, scaler, max_norm: float) -> float:
    """Per-tensor clipping."""
    from torch.nn.utils import clip_grad_norm_

    scaler.unscale_(optimizer)
    norm = 0.0
    for p in model.parameters():
        if p.grad is not None:
            norm = float(clip_grad_norm_([p], max_norm if max_norm > 0 else math.inf))
    return norm


@fault(
    "unseen_embedding_scaled",
    seam="model.gpt.GPT.forward",
    title="Token embeddings multiplied by sqrt(n_embd), a convention of another architecture, with a tied 0.02 init",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="forward scales the token embeddings by sqrt(n_embd) (as the original Transformer and Gemma do) "
    "although this model's init and pre-norm residual stream assume unscaled embeddings: the residual stream "
    "starts 8x larger than the blocks' outputs and the tied head sees differently scaled inputs.",
    fix="Drop the scaling (or change the init and the head consistently with it).",
    references=("Vaswani et al. 2017, section 3.4 (embeddings multiplied by sqrt(d_model)); ported conventions "
                "as a source of silent bugs",),
    manifest=Manifest(check="metric_differs", steps=60, params={"min_gap": 0.01}),
)
def forward_embedding_scaled(self, input_ids, attention_mask=None, position_ids=None, cache=None):
    """Embeddings scaled by sqrt(n_embd)."""
    B, T = input_ids.shape
    past_len = 0 if cache is None else cache.length
    if past_len + T > self.config.max_positions:
        raise ValueError(f"sequence of {past_len + T} tokens exceeds the position table")
    if attention_mask is None:
        attention_mask = torch.ones(B, past_len + T, dtype=torch.long, device=input_ids.device)
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask, past_len)  # noqa: F821 (model.gpt's)
    x = self.drop(self.wte(input_ids) * math.sqrt(self.config.n_embd))
    attn_mask = build_attention_mask(attention_mask, T, _compute_dtype(x))  # noqa: F821
    rope = rope_at(self.rope_cos, self.rope_sin, position_ids)  # noqa: F821
    for i, block in enumerate(self.blocks):
        x = block(x, rope, attn_mask, cache, i)
    return self.lm_head(self.ln_f(x))


@fault(
    "unseen_label_smoothing_left_on",
    seam="model.loss.lm_loss",
    title="Label smoothing 0.1 left on in the loss used for training and evaluation",
    subsystem="loss",
    trigger="always",
    symptoms=("eval-metric",),
    explanation="lm_loss passes label_smoothing=0.1 to cross_entropy (copied from a classification recipe): the "
    "reported loss is no longer the model's cross-entropy and can never reach the corpus floor.",
    fix="No label smoothing in the language-modelling loss (or report the unsmoothed loss).",
    references=("PyTorch docs, CrossEntropyLoss label_smoothing; nanoGPT/HF causal LM losses use none",),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.05}),
)
def lm_loss_smoothed(logits, labels, num_targets=None, ignore_index: int = IGNORE_INDEX):
    """Smoothed targets."""
    shifted_logits = logits[:, :-1].float()
    shifted_labels = labels[:, 1:]
    total = F.cross_entropy(shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
                            ignore_index=ignore_index, reduction="sum", label_smoothing=0.1)
    if num_targets is None:
        num_targets = count_targets(labels, ignore_index)  # noqa: F821 (model.loss's)
    return total / max(num_targets, 1)
