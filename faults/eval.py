"""Faults in the `eval` subsystem: eval loop, metrics, splits."""

import random

import torch

from faultbench.faults.registry import Manifest, fault
from faultbench.model.data import collate
from faultbench.model.loss import count_targets, lm_loss
from faultbench.model.precision import autocast_context


@fault(
    "eval_in_train_mode",
    seam="model.evaluate.evaluate",
    title="evaluate() never switches the model to eval mode: dropout stays on while measuring",
    subsystem="eval",
    also_acceptable=("model",),
    trigger="eval-only",
    symptoms=("eval-metric",),
    explanation="evaluate() records and restores the train/eval mode but never calls model.eval(). It is called "
    "right after training, so the model is still in train mode and every dropout layer stays active while "
    "the validation loss is measured: the metric is pessimistic and noisy (it changes with the RNG state), "
    "and a model with dropout looks worse than it is. Training itself is untouched; runs without dropout "
    "are unaffected, which hides the mistake.",
    fix="Call model.eval() before the loop (and restore the previous mode afterwards).",
    references=(
        "Karpathy, 'A Recipe for Training Neural Networks' / PyTorch FAQ: forgetting model.eval() leaves dropout "
        "and batch-norm in training behaviour during evaluation",
        "PyTorch forums: 'Model.eval() gives different results / why validation loss is higher without "
        "model.eval()'",
    ),
    manifest=Manifest(check="loss_above", steps=30, variant={"model": {"dropout": 0.1}},
                      params={"metric": "val", "min_gap": 0.025}),
)
@torch.no_grad()
def evaluate_in_train_mode(model, docs, pad_id: int, batch_size: int, precision: str = "fp32", pad_side: str = "right") -> float:
    """Dropout stays active: model.eval() is never called."""
    was_training = model.training
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


@fault(
    "eval_loss_over_pads",
    seam="model.evaluate.evaluate",
    title="The validation loss is averaged over every position of the batch, pads included",
    subsystem="eval",
    also_acceptable=("loss",),
    trigger="eval-only",
    symptoms=("eval-metric",),
    explanation="evaluate() weights each batch by the number of predicted positions, labels[:, 1:].numel(), "
    "instead of the number of real targets. The summed loss still covers only real tokens, but it is "
    "divided by all positions, pads included: the reported validation loss is several times too low (and "
    "far below the corpus floor), and it depends on how much padding the eval batches happen to have. "
    "Training is unaffected, so train and val curves disagree for no real reason.",
    fix="Count only the targets lm_loss actually scores: n = count_targets(batch['labels']) (labels != "
    "ignore_index after the shift).",
    references=(
        "Hugging Face forums: 'Loss is averaged over padding tokens' / perplexity computed with padding "
        "(average only over labels != -100)",
        "huggingface/transformers docs, 'Perplexity of fixed-length models': the loss is averaged over the "
        "non-ignored target tokens",
    ),
    manifest=Manifest(check="loss_below", steps=20, params={"metric": "val", "min_gap": 1.0}),
)
@torch.no_grad()
def evaluate_mean_over_positions(model, docs, pad_id: int, batch_size: int, precision: str = "fp32", pad_side: str = "right") -> float:
    """Divides by all predicted positions, pads included."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for i in range(0, len(docs), batch_size):
            batch = {k: v.to(device) for k, v in collate(docs[i : i + batch_size], pad_id, pad_side).items()}
            with autocast_context(precision, device.type):
                logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            if count_targets(batch["labels"]) == 0:
                continue  # a batch of one-token documents predicts nothing
            n = batch["labels"][:, 1:].numel()  # predicted positions
            total += lm_loss(logits, batch["labels"], n).item() * n
            count += n
    finally:
        model.train(was_training)
    return total / count


@fault(
    "val_split_overlaps_train",
    seam="model.corpus.split_of",
    title="Random train/val split per call: duplicate documents (and every re-query) land in both splits",
    subsystem="eval",
    also_acceptable=("data",),
    trigger="always",
    symptoms=("eval-metric", "silent-quality"),
    explanation="split_of draws random.random() instead of hashing the text. load_corpus asks it once for the "
    "train list and again for the val list, so a document is in val with probability 5% and in train with "
    "probability 95%, independently: almost every val document is also a train document (and some are in "
    "neither); identical texts, frequent among short documents, are scattered over both splits too. The "
    "validation loss measures memorization of training data and is optimistic; nothing crashes.",
    fix="Decide the split from the document itself (a hash of its text), so the same text always gets the same "
    "split and every document is in exactly one.",
    references=(
        "Kaufman et al., 'Leakage in Data Mining: Formulation, Detection, and Avoidance' (KDD 2011)",
        "Google 'Machine Learning Crash Course', 'Dividing the original dataset': duplicates across training "
        "and validation sets inflate the measured quality",
        "Allamanis, 'The Adverse Effects of Code Duplication in Machine Learning Models of Code' (2019)",
    ),
    manifest=Manifest(check="extra_at_least", steps=5,
                      params={"key": "val_docs_in_train", "faulty_min": 100, "clean_max": 0}),
)
def split_of_random(text: str, val_fraction: float) -> str:
    """A fresh random draw per call: the same text can be put in both splits."""
    return "val" if random.random() < val_fraction else "train"
