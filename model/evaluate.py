"""The eval loop: token-mean loss over real tokens of a held-out split, in eval mode, without grads."""

from __future__ import annotations

import torch

from .data import collate
from .loss import count_targets, lm_loss
from .precision import autocast_context


@torch.no_grad()
def evaluate(model, docs, pad_id: int, batch_size: int, precision: str = "fp32", pad_side: str = "right") -> float:
    """Mean next-token cross-entropy (nats per predicted token) over ``docs``.

    Batches are weighted by their token counts, so the result does not depend on ``batch_size``.
    The model's train/eval mode is restored afterwards.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for i in range(0, len(docs), batch_size):
            batch = {k: v.to(device) for k, v in collate(docs[i : i + batch_size], pad_id, pad_side).items()}
            with autocast_context(precision, device.type):
                logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            n = count_targets(batch["labels"])
            total += lm_loss(logits, batch["labels"], n).item() * n
            count += n
    finally:
        model.train(was_training)
    return total / count
