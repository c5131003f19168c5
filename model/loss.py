"""The language-modelling loss: the one place where the next-token shift happens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX


def count_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Number of tokens ``lm_loss`` will predict in ``labels`` (B, T): non-ignored labels after the shift."""
    return int((labels[:, 1:] != ignore_index).sum())


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_targets: int | None = None,
            ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed next-token cross-entropy divided by ``num_targets``.

    logits: (B, T, V), labels: (B, T) aligned with the inputs. Position t predicts labels[t + 1].
    ``num_targets`` defaults to this batch's own count (a token mean); under gradient accumulation
    pass the count of the whole accumulation window so the micro-batch losses add up to its mean.
    """
    shifted_logits = logits[:, :-1].float()  # (B, T-1, V): fp32 for a stable log-softmax
    shifted_labels = labels[:, 1:]  # (B, T-1)
    total = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
        ignore_index=ignore_index, reduction="sum",
    )
    if num_targets is None:
        num_targets = count_targets(labels, ignore_index)
    return total / max(num_targets, 1)
