"""Faults in the `loss` subsystem: shift, ignore_index, reduction, accumulation normalization."""

import torch
import torch.nn.functional as F

from faultbench.faults.registry import Manifest, fault
from faultbench.model.data import IGNORE_INDEX
from faultbench.model.loss import count_targets, lm_loss
from faultbench.model.precision import autocast_context


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


@fault(
    "label_permute",
    seam="model.train.forward_loss",
    title="Rows reordered by length for the forward pass but the labels keep the original order",
    subsystem="loss",
    also_acceptable=("collate", "data"),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="forward_loss sorts the micro-batch rows longest-first before calling the model but "
    "scores the logits against batch['labels'] in the original row order, so almost every row is "
    "trained on another document's tokens. The model can only learn what is common to all rows "
    "(token frequencies, what follows BOS), so train and val loss stall near the unigram level, far "
    "above the clean run, with no error anywhere.",
    fix="Apply the same permutation to every tensor of the batch, labels included (or do not reorder "
    "inside the loss function at all).",
    references=(
        "Karpathy, 'A Recipe for Training Neural Networks': 'visualize just before the net' and check "
        "that inputs and labels still line up after every transformation",
        "PyTorch forums: 'Model not learning, shuffled inputs and targets separately' (data and labels "
        "permuted with different indices)",
    ),
    manifest=Manifest(check="loss_above", steps=40, params={"min_gap": 0.4, "metric": "val"}),
)
def forward_loss_sorted_inputs(model, batch: dict, num_targets: float, precision: str) -> torch.Tensor:
    """The inputs are reordered by length, the labels are not: rows are scored against other rows' tokens."""
    # longest rows first, so the attention kernels see the padding at the end of the batch
    order = batch["attention_mask"].sum(1).argsort(descending=True)
    input_ids, attention_mask = batch["input_ids"][order], batch["attention_mask"][order]
    with autocast_context(precision, batch["input_ids"].device.type):
        logits = model(input_ids, attention_mask, batch["position_ids"][order])
    return lm_loss(logits, batch["labels"], num_targets)


@fault(
    "loss_sum_reduction",
    seam="model.loss.lm_loss",
    title="Cross-entropy summed over tokens and never divided by the target count",
    subsystem="loss",
    also_acceptable=("optimizer",),
    trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="lm_loss computes the summed cross-entropy but returns it without dividing by num_targets. "
    "The logged loss and every gradient are as many times too large as the batch has targets (hundreds), "
    "and the scale changes from batch to batch with the number of real tokens; clipping fires on every "
    "step, so the update is just the gradient's direction, and evaluate() reports a val loss hundreds of "
    "times the true per-token value.",
    fix="Return total / max(num_targets, 1), num_targets defaulting to count_targets(labels).",
    references=(
        "PyTorch docs, torch.nn.CrossEntropyLoss: reduction='sum' vs 'mean' (the sum scales with the "
        "number of elements)",
        "Google, 'Deep Learning Tuning Playbook': the effective learning rate depends on how the loss is "
        "normalized by batch size",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, params={"min_ratio": 100.0, "max_ratio": 5000.0}),
)
def lm_loss_summed(logits: torch.Tensor, labels: torch.Tensor, num_targets: int | None = None,
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Returns the summed loss; the division by the number of targets is lost."""
    shifted_logits = logits[:, :-1].float()  # (B, T-1, V): fp32 for a stable log-softmax
    shifted_labels = labels[:, 1:]  # (B, T-1)
    total = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
        ignore_index=ignore_index, reduction="sum",
    )
    if num_targets is None:
        num_targets = count_targets(labels, ignore_index)
    return total


@fault(
    "labels_shifted_twice",
    seam="model.train.forward_loss",
    title="Labels shifted once more before lm_loss shifts them: position t is trained on token t+2",
    subsystem="loss",
    also_acceptable=("collate",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="collate already returns labels aligned with the inputs and lm_loss does the next-token "
    "shift; forward_loss shifts the labels left by one more position before calling it, so every "
    "position is trained to predict the token after next. The training loss stays well above a correct "
    "run's and the val loss (which evaluate computes with the correct shift) is far worse; greedy "
    "generation skips every other token.",
    fix="Shift exactly once: pass batch['labels'] unchanged to lm_loss, which drops the first label.",
    references=(
        "HF transformers docs (GPT2LMHeadModel): 'labels are shifted inside the model, i.e. you can set "
        "labels = input_ids'; shifting them beforehand as well trains on token t+2 (a recurring forum "
        "question)",
    ),
    manifest=Manifest(check="loss_above", steps=40, params={"min_gap": 0.5, "metric": "val"}),
)
def forward_loss_shift_labels(model, batch: dict, num_targets: float, precision: str) -> torch.Tensor:
    """Shifts the labels before lm_loss, which shifts them again: predicts t+2."""
    with autocast_context(precision, batch["input_ids"].device.type):
        logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    # next-token targets: position t is scored against token t+1
    labels = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], dim=1)
    return lm_loss(logits, labels, num_targets)


@fault(
    "ignore_index_mismatch",
    seam="model.loss.lm_loss",
    title="Loss ignores index -1 (nanoGPT's convention) while collate marks pads and BOS with -100",
    subsystem="loss",
    also_acceptable=("collate",),
    trigger="always",
    symptoms=("crash-index",),
    explanation="The cross-entropy call hard-codes ignore_index=-1, as in nanoGPT, but collate fills "
    "the label slots of pads and BOS with -100 (the HF convention) and count_targets counts with -100. "
    "-100 is then an ordinary class index and the loss raises 'Target -100 is out of bounds' on the "
    "first batch (on CUDA a device-side assert).",
    fix="Use one ignore value end to end: pass ignore_index (IGNORE_INDEX, -100) through to "
    "F.cross_entropy.",
    references=(
        "karpathy/nanoGPT model.py: F.cross_entropy(..., ignore_index=-1)",
        "HF transformers docs: labels set to -100 are ignored (masked), the loss is only computed for "
        "labels in [0, ..., vocab_size]",
        "PyTorch forums: 'IndexError: Target -100 is out of bounds'",
    ),
    manifest=Manifest(check="crash", steps=2, params={"types": ("IndexError",),
                                                      "seam": "model.loss.lm_loss"}),
)
def lm_loss_ignore_minus_one(logits: torch.Tensor, labels: torch.Tensor, num_targets: int | None = None,
                             ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy ignores -1, not the -100 that collate writes."""
    shifted_logits = logits[:, :-1].float()  # (B, T-1, V): fp32 for a stable log-softmax
    shifted_labels = labels[:, 1:]  # (B, T-1)
    total = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
        ignore_index=-1, reduction="sum",
    )
    if num_targets is None:
        num_targets = count_targets(labels, ignore_index)
    return total / max(num_targets, 1)


@fault(
    "accumulation_mean_per_micro_batch",
    seam="model.train.forward_loss",
    title="Under gradient accumulation each micro-batch is averaged over its own tokens, then summed",
    subsystem="loss",
    also_acceptable=("optimizer",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="forward_loss calls lm_loss without num_targets, so each micro-batch loss is its own token "
    "mean instead of its share of the window's mean; train_step then adds accum of them. With accum > 1 "
    "the gradient (and the logged loss) is about accum times too large and weights short micro-batches' "
    "tokens more than long ones'; clipping fires far more often. accum = 1 is unaffected.",
    fix="Pass the window's target count: lm_loss(logits, labels, num_targets) so that the micro-batch "
    "losses sum to the token mean of the whole window.",
    references=(
        "HF transformers blog 'Fixing Gradient Accumulation' (Oct 2024) and huggingface/transformers "
        "issue 'Gradient accumulation yields different loss' (per-micro-batch mean instead of window mean)",
        "PyTorch forums: 'How to implement gradient accumulation' (divide the loss by accumulation_steps)",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, variant={"train": {"accum": 4}},
                      params={"min_ratio": 3.0, "max_ratio": 5.0}),
)
def forward_loss_micro_mean(model, batch: dict, num_targets: float, precision: str) -> torch.Tensor:
    """Checks num_targets but normalizes each micro-batch by its own token count."""
    if num_targets <= 0:
        raise ValueError(f"a window with {num_targets} targets has no loss")
    with autocast_context(precision, batch["input_ids"].device.type):
        logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    return lm_loss(logits, batch["labels"])
