"""Blind set 10: plugin faults written without reading the detectors (reference and HF targets).

Each is a bug engineers have shipped; ids are neutral on purpose.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from faultbench.faults.registry import Manifest, fault
from faultbench.model.config import TrainConfig
from faultbench.model.data import IGNORE_INDEX


@fault(
    "b10_01",
    seam="model.evaluate.evaluate",
    title="Validation loss averaged over every real input token instead of over the predicted ones",
    subsystem="eval",
    also_acceptable=("loss",),
    trigger="eval-only",
    symptoms=("eval-metric",),
    explanation="evaluate weights each batch's summed loss correctly but divides the total by the number of real "
    "tokens in attention_mask, which counts each document's first token although nothing predicts it: the "
    "reported nats per token (and perplexity) are too low by a factor (n-1)/n that depends on document length.",
    fix="Divide by the number of predicted targets (count_targets), the same count the loss was summed over.",
    references=("EleutherAI lm-evaluation-harness discussions of token- vs target-count normalisation in "
                "perplexity; HF docs 'Perplexity of fixed-length models' (only the predicted tokens count)",),
    manifest=Manifest(check="metric_differs", steps=20, params={"min_gap": 0.05}),
)
def evaluate(model, docs, pad_id: int, batch_size: int, precision: str = "fp32", pad_side: str = "right") -> float:
    """The denominator counts input tokens (BOS included), not predicted targets."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nats, seen = 0.0, 0
    try:
        for first in range(0, len(docs), batch_size):
            chunk = collate(docs[first : first + batch_size], pad_id, pad_side)  # noqa: F821 (model.evaluate's)
            batch = {name: t.to(device) for name, t in chunk.items()}
            with autocast_context(precision, device.type):  # noqa: F821
                logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            targets = count_targets(batch["labels"])  # noqa: F821
            nats += float(lm_loss(logits, batch["labels"], targets)) * targets  # noqa: F821
            seen += int(batch["attention_mask"].sum())
    finally:
        model.train(was_training)
    return nats / seen


@fault(
    "b10_02",
    seam="model.gpt.GPT.init_weights",
    title="LayerNorm gains drawn from the small normal init meant for matrices",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="init_weights re-initializes every module with a 'weight' attribute (LayerNorm included) from "
    "N(0, init_std): the norm gains start near 0 instead of 1, so every pre-norm block and the final norm "
    "scale their outputs down ~50x and learning starts from an almost dead network.",
    fix="Initialize only Linear and Embedding weights from the normal; leave LayerNorm weight=1, bias=0.",
    references=("huggingface/transformers issues on _init_weights re-initialising LayerNorm/RMSNorm weights "
                "(e.g. 'norm weights initialised to normal instead of ones' after post_init changes)",),
    manifest=Manifest(check="loss_above", steps=40, params={"min_gap": 0.1}),
)
def init_weights(self) -> None:
    """Every module's weight tensor drawn from N(0, init_std), norms too."""
    std = self.config.init_std
    for module in self.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            torch.nn.init.normal_(weight, mean=0.0, std=std)
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.nn.Parameter):
            torch.nn.init.zeros_(bias)
    depth_scale = std / math.sqrt(2 * self.config.n_layer)
    for block in self.blocks:
        torch.nn.init.normal_(block.attn.proj.weight, mean=0.0, std=depth_scale)
        torch.nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=depth_scale)


@fault(
    "b10_03",
    seam="model.loss.lm_loss",
    title="Negative log-likelihood taken on raw logits (no log-softmax before nll_loss)",
    subsystem="loss",
    trigger="always",
    symptoms=("divergence", "silent-quality"),
    explanation="lm_loss calls F.nll_loss on the logits, which expects log-probabilities: the 'loss' is minus "
    "the target logit, unbounded below. Training pushes target logits up without any normalisation, the "
    "reported loss goes negative and the model's distribution is never trained.",
    fix="F.cross_entropy on logits (or log_softmax before nll_loss).",
    references=("PyTorch forums: 'NLLLoss gives negative loss' / 'loss is negative' (answer: NLLLoss expects "
                "log-probabilities, apply log_softmax or use CrossEntropyLoss)",),
    manifest=Manifest(check="loss_below", steps=30, params={"min_gap": 1.0}),
)
def lm_loss(logits, labels, num_targets=None, ignore_index: int = IGNORE_INDEX):
    """nll_loss over unnormalised scores."""
    V = logits.size(-1)
    scores = logits[:, :-1].float().reshape(-1, V)
    targets = labels[:, 1:].reshape(-1)
    summed = F.nll_loss(scores, targets, ignore_index=ignore_index, reduction="sum")
    if num_targets is None:
        num_targets = count_targets(labels, ignore_index)  # noqa: F821 (model.loss's)
    return summed / max(num_targets, 1)


@fault(
    "b10_04",
    seam="model.optim.lr_at",
    title="The schedule's floor read as a ratio of the peak: cosine decays to almost zero",
    subsystem="optimizer",
    trigger="after-step",
    symptoms=("silent-quality",),
    explanation="lr_at treats cfg.min_lr (an absolute learning rate, 3e-4) as the fraction of the peak to keep "
    "(as transformers' cosine_with_min_lr 'min_lr_rate' does): the floor becomes lr * min_lr ~ 1e-6, so the "
    "end of training runs at a learning rate 300x lower than configured.",
    fix="Decay from lr to min_lr as an absolute value (or convert the config field explicitly).",
    references=("huggingface/transformers: get_cosine_with_min_lr_schedule_with_warmup takes min_lr or "
                "min_lr_rate; confusion between the two reported in issues on the scheduler kwargs",),
    manifest=Manifest(check="lr_ratio", steps=30, params={"min_ratio": 0.0, "max_ratio": 0.5, "step": 29}),
)
def lr_at(step: int, cfg: TrainConfig) -> float:
    """min_lr used as a multiplier of lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    frac = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.min_lr * cfg.lr
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
