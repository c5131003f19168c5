"""Faults in the `collate` subsystem: padding, attention_mask, labels."""

import torch

from faultbench.faults.registry import Manifest, fault
from faultbench.model.config import DataConfig
from faultbench.model.data import IGNORE_INDEX
from faultbench.model.rope import position_ids_from_mask


@fault(
    "attention_mask_inverted",
    seam="model.data.collate",
    title="attention_mask marks the pads with 1 and the real tokens with 0",
    subsystem="collate",
    also_acceptable=("mask",),
    trigger="always",
    symptoms=("stall", "silent-quality"),
    explanation="collate builds the mask in the 'mask = what to hide' convention (1 on pads, 0 on real tokens) "
    "while the model reads 1 as 'attend'. Every real token may then attend only to itself (and to pads), and "
    "positions derived from the mask collapse to 0, so the transformer degenerates to a per-token "
    "(bigram) model: the loss drops quickly to the bigram level and stalls there. How far above the clean run "
    "depends on how much the data needs context: little with word-sized BPE tokens on this Markov corpus, "
    "~0.3 nats after 80 steps with a character-level tokenizer. Nothing crashes.",
    fix="1 on real tokens, 0 on pads (attention_mask[row, start:start + n] = 1 on a zero tensor).",
    references=(
        "PyTorch docs, nn.MultiheadAttention: key_padding_mask True means the key is IGNORED, the opposite of "
        "the Hugging Face attention_mask (1 = attend)",
        "Karpathy, 'A Recipe for Training Neural Networks': visualize the data just before the net (y_hat, "
        "the mask) to catch pipeline bugs",
    ),
    # a character-level tokenizer: with word-sized BPE tokens a bigram model is nearly optimal on this corpus
    manifest=Manifest(check="loss_above", steps=80, variant={"data": {"vocab_size": 32}},
                      params={"metric": "val", "min_gap": 0.2}),
)
def collate_mask_marks_pads(docs, pad_id: int, pad_side: str = "right", ignore_index: int = IGNORE_INDEX) -> dict:
    """1 on pads, 0 on real tokens."""
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
    B, T = len(docs), max(len(d) for d in docs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.ones((B, T), dtype=torch.long)  # 1 = masked out (padding)
    labels = torch.full((B, T), ignore_index, dtype=torch.long)
    for row, ids in enumerate(docs):
        n = len(ids)
        start = 0 if pad_side == "right" else T - n
        tokens = torch.as_tensor(ids, dtype=torch.long)
        input_ids[row, start : start + n] = tokens
        attention_mask[row, start : start + n] = 0
        labels[row, start + 1 : start + n] = tokens[1:]  # BOS is never a target
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "labels": labels,
    }


@fault(
    "labels_not_ignored_on_pads",
    seam="model.data.collate",
    title="Labels copied from input_ids including the pads: pad tokens become training targets",
    subsystem="collate",
    also_acceptable=("loss",),
    trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="collate copies the input ids into labels from BOS on, pads included, instead of setting "
    "ignore_index on pads. With right padding most positions of a batch are pads (the batch is as long as "
    "its longest document), and 'after EOS or a pad comes a pad' is trivial to learn: the token-mean train "
    "and val losses fall far below the clean run (and below the corpus floor) while the gradient signal of "
    "the real tokens is diluted by the pad count.",
    fix="Set labels to ignore_index on every pad position (only the real tokens after BOS are targets).",
    references=(
        "Hugging Face forums: 'Should I set pad tokens in labels to -100?' (DataCollatorForLanguageModeling "
        "masks pad labels with -100; a hand-written collator that copies input_ids does not)",
        "huggingface/transformers docs, GPT2LMHeadModel labels: 'All labels set to -100 are ignored (masked)'",
    ),
    manifest=Manifest(check="loss_below", steps=30, params={"min_gap": 1.0}),
)
def collate_labels_keep_pads(docs, pad_id: int, pad_side: str = "right", ignore_index: int = IGNORE_INDEX) -> dict:
    """Labels on pads are the pad id, not ignore_index."""
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
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
        labels[row, start + 1 :] = input_ids[row, start + 1 :]  # BOS is never a target
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "labels": labels,
    }


@fault(
    "mask_dtype_unpadded",
    seam="model.data.collate",
    title="collate emits a key_padding_mask (bool, True on pads) and None when nothing is padded",
    subsystem="collate",
    also_acceptable=("mask", "data"),
    trigger="rare-batch",
    symptoms=("crash-state", "stall"),
    explanation="One root cause, two symptoms: collate switched to PyTorch's key_padding_mask convention "
    "(a bool mask, True where attention must NOT look, and None when there is nothing to mask, as "
    "nn.MultiheadAttention takes it) while the model reads attention_mask as 1/True = attend. On the usual, "
    "padded batches every real token may attend only to itself, so the model degenerates to a bigram "
    "model and the loss stalls above the clean run (clearly once the data needs context, e.g. with a "
    "character-level tokenizer). On the rare micro-batch whose documents all have "
    "the same length (no padding) the mask is None, and the run crashes in next_micro_batches with "
    "AttributeError ('NoneType' object has no attribute 'to'), a type error steps into an apparently "
    "working run. The manifest shows both: a worse loss before the crash, then the crash.",
    fix="Return the model's convention every time: an int64 (B, T) mask with 1 on real tokens and 0 on pads, "
    "all ones when nothing is padded.",
    references=(
        "PyTorch docs, nn.MultiheadAttention / nn.TransformerEncoder: key_padding_mask (True = ignore) is "
        "Optional, and None means no padding, the opposite convention of Hugging Face's attention_mask",
        "huggingface/transformers PR '[AttentionMaskConverter] Fix-mask-inf' (#27114) and the SDPA path that "
        "drops an all-ones mask: code that special-cases the unpadded batch breaks on it",
        "unslothai/unsloth issue 'NaN during llama3 finetuning' (#427): fails only when the batch has padding, "
        "fine when the sequences have the same length",
    ),
    # a character-level tokenizer (the model needs context) and micro-batches of 3 (an unpadded one is rare)
    manifest=Manifest(check="crash_after_gap", steps=100,
                      variant={"data": {"vocab_size": 32}, "train": {"batch_size": 12, "accum": 4}},
                      params={"types": ("AttributeError",), "seam": "model.train.next_micro_batches", "min_step": 50,
                              "min_gap": 0.2}),
)
def collate_key_padding_mask(docs, pad_id: int, pad_side: str = "right", ignore_index: int = IGNORE_INDEX) -> dict:
    """The mask is bool True on pads (key_padding_mask convention) and None for an unpadded batch."""
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
    B, T = len(docs), max(len(d) for d in docs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.ones((B, T), dtype=torch.bool)  # key padding mask: True where attention must not look
    labels = torch.full((B, T), ignore_index, dtype=torch.long)
    for row, ids in enumerate(docs):
        n = len(ids)
        start = 0 if pad_side == "right" else T - n
        tokens = torch.as_tensor(ids, dtype=torch.long)
        input_ids[row, start : start + n] = tokens
        attention_mask[row, start : start + n] = False
        labels[row, start + 1 : start + n] = tokens[1:]  # BOS is never a target
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask if attention_mask.any() else None,  # nothing padded: no mask needed
        "position_ids": position_ids_from_mask(~attention_mask),
        "labels": labels,
    }


@fault(
    "labels_misaligned_by_pad_count",
    seam="model.data.collate",
    title="Labels written at the right-padding offset: under left padding they are misaligned by the pad count",
    subsystem="collate",
    also_acceptable=("loss",),
    trigger="always",
    symptoms=("silent-quality", "stall"),
    explanation="collate places each row's tokens at the left-padding offset (T - n) but writes its labels "
    "from column 1 as for right padding. With left padding every padded row's targets are shifted left by "
    "its pad count: pad inputs are asked to predict document tokens and real tokens are scored against "
    "tokens that lie pads-many positions ahead. The loss stays far above the clean run (it cannot fit the "
    "mismatched pairs); right-padded runs are untouched, which hides the mistake until pad_side changes.",
    fix="Write labels at the same offset as the inputs: labels[row, start + 1 : start + n] = tokens[1:].",
    references=(
        "Hugging Face docs, 'Generation with LLMs' / padding_side: decoder-only models must be left-padded, "
        "and every per-row index (labels, positions) must follow the padding offset",
        "Karpathy, 'A Recipe for Training Neural Networks': visualize the exact (input, label) pairs the "
        "network sees",
    ),
    manifest=Manifest(check="loss_above", steps=30, variant={"data": {"pad_side": "left"}},
                      params={"metric": "val", "min_gap": 0.35}),
)
def collate_labels_right_offset(docs, pad_id: int, pad_side: str = "right", ignore_index: int = IGNORE_INDEX) -> dict:
    """Labels ignore the left-padding offset."""
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
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
        labels[row, 1:n] = tokens[1:]  # BOS is never a target
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "labels": labels,
    }


@fault(
    "collate_pads_to_max_length",
    seam="model.data.collate",
    title="Every batch padded to the full sequence length instead of its longest document",
    subsystem="collate",
    also_acceptable=("data",),
    trigger="always",
    symptoms=("slowdown",),
    explanation="collate pads every batch to DataConfig.seq_len (64) for 'one static shape', instead of the "
    "longest document in the batch. Documents average ~11 tokens, so most batches are several times "
    "shorter than 64: the model now runs attention and MLPs over ~2-4x more positions, all pads. With right "
    "padding the pads never influence a real token, so every loss is unchanged and only throughput "
    "(tokens/s) and memory show the waste.",
    fix="T = the longest document of the batch (dynamic padding); if static shapes are wanted, bucket by "
    "length or pad to a small multiple, never unconditionally to the maximum.",
    references=(
        "Hugging Face docs, 'Padding and truncation': padding='max_length' vs padding=True/'longest' (dynamic "
        "padding) and DataCollatorWithPadding",
        "Hugging Face course, chapter 3 'Processing the data': dynamic padding pads to the longest in the batch "
        "to avoid wasted compute",
    ),
    manifest=Manifest(check="same_loss_more_compute", steps=10, params={"min_ratio": 1.5}),
)
def collate_pad_to_seq_len(docs, pad_id: int, pad_side: str = "right", ignore_index: int = IGNORE_INDEX) -> dict:
    """Pads to the configured maximum length, not to the batch's longest document."""
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
    B, T = len(docs), DataConfig.seq_len  # one static shape for every batch
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), ignore_index, dtype=torch.long)
    for row, ids in enumerate(docs):
        n = len(ids)
        start = 0 if pad_side == "right" else T - n
        tokens = torch.as_tensor(ids, dtype=torch.long)
        input_ids[row, start : start + n] = tokens
        attention_mask[row, start : start + n] = 1
        labels[row, start + 1 : start + n] = tokens[1:]  # BOS is never a target
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "labels": labels,
    }
