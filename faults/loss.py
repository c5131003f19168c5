"""Faults in the `loss` subsystem: shift, ignore_index, reduction, accumulation normalization."""

import torch
import torch.nn.functional as F

from faults.registry import Manifest, fault
from model.data import IGNORE_INDEX
from model.loss import count_targets


@fault(
    "label_shift_off_by_one",
    seam="model.loss.lm_loss",
    title="Labels not shifted: each position is trained to predict its own input token",
    subsystem="loss",
    also_acceptable=("collate",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="lm_loss compares logits[:, t] with labels[:, t] instead of labels[:, t + 1]. The model "
    "learns to copy its input, which is trivial: the loss falls far below the corpus floor while "
    "generation is garbage.",
    fix="Drop the last logit and the first label: logits[:, :-1] against labels[:, 1:].",
    references=(
        "HF transformers docs: 'the labels are shifted inside the model' (GPT2LMHeadModel); users who "
        "shift again or not at all report suspiciously low loss",
        "Karpathy, 'A Recipe for Training Neural Networks': verify loss at init, overfit, visualize predictions",
    ),
    manifest=Manifest(check="loss_below", steps=40, params={"min_gap": 1.0}),
)
def lm_loss_unshifted(logits: torch.Tensor, labels: torch.Tensor, num_targets: int | None = None,
                      ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Labels are compared with the logits at the same position: no next-token shift."""
    flat_logits = logits.float()  # (B, T, V): fp32 for a stable log-softmax
    total = F.cross_entropy(
        flat_logits.reshape(-1, flat_logits.size(-1)), labels.reshape(-1),
        ignore_index=ignore_index, reduction="sum",
    )
    if num_targets is None:
        num_targets = count_targets(labels, ignore_index)
    return total / max(num_targets, 1)
