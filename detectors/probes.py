"""Helpers shared by detectors: crafted inputs from the run's own corpus, and the run's components.

Everything here goes through the run context (``ctx.run``, ``ctx.seam``); nothing imports the
reference. Probes run inside ``ctx.probe()`` so they leave no trace on the run.
"""

from __future__ import annotations

import torch


def sample_docs(ctx, count: int = 4, max_len: int | None = None, distinct_lengths: bool = True) -> list[list[int]]:
    """``count`` training documents of different lengths (shortest to longest within ``max_len``),
    picked deterministically from the run's corpus."""
    limit = max_len or ctx.config.data.seq_len
    by_length: dict[int, list[int]] = {}
    for doc in ctx.run.corpus.train[:2000]:
        if 4 <= len(doc) <= limit:
            by_length.setdefault(len(doc), list(doc))
    lengths = sorted(by_length)
    if not distinct_lengths:
        return [by_length[lengths[len(lengths) // 2]]] * count
    picks = [lengths[round(i * (len(lengths) - 1) / max(count - 1, 1))] for i in range(count)]
    return [by_length[n] for n in picks]


def collate(ctx, docs, pad_side: str | None = None) -> dict:
    """The run's collate on ``docs`` with the tokenizer's pad id, moved to the run's device."""
    side = pad_side or ctx.config.data.pad_side
    batch = ctx.seam("model.data.collate")(docs, ctx.run.tokenizer.pad_id, side)
    device = ctx.config.train.device
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def logits(ctx, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
    """The model's logits (float32) for a batch; call inside ``ctx.probe()``."""
    return ctx.run.model(input_ids, attention_mask, position_ids).float()


def modules_named(ctx, class_name: str):
    """(name, module) of every submodule of the run's model whose class is ``class_name``."""
    return [(n, m) for n, m in ctx.run.model.named_modules() if type(m).__name__ == class_name]


def ignore_value(labels: torch.Tensor, attention_mask: torch.Tensor) -> int | None:
    """The label value collate uses for 'no target', read off the first real token (BOS) of row 0."""
    first = int(attention_mask[0].nonzero()[0]) if attention_mask[0].any() else 0
    return int(labels[0, first])
