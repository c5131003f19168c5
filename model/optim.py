"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import TrainConfig


def configure_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with two groups: weight decay on 2-D weight matrices; none on biases, norms and embeddings.

    The tied embedding/head matrix is an embedding: decaying it would shrink token vectors.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():  # each shared (tied) parameter appears once
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imports TorchScript; only when used

        # each rank keeps the AdamW state of its shard of the parameters and broadcasts its update
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=cfg.lr, betas=cfg.betas,
                                       eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup to ``lr``, cosine to ``min_lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following ``lr_at``; call ``step()`` once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
