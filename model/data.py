"""Data: the tokenized train/val splits of the synthetic corpus, truncation, and batch collation.

Conventions every other file relies on:
- an example is one document, ``[bos, ..., eos]``, at most ``seq_len`` tokens;
- ``collate`` returns ``labels`` *aligned with* ``input_ids`` (``labels[t] == input_ids[t]`` on real
  tokens, ``ignore_index`` on pads and on BOS, which is never a prediction target);
- the next-token shift happens in exactly one place: ``model.loss.lm_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .config import DataConfig
from .corpus import MarkovSource, split_of
from .rope import position_ids_from_mask
from .tokenizer import Tokenizer, load_or_train_tokenizer

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Corpus:
    """Tokenized splits (no document text in both) and the loss floor of the validation split."""

    tokenizer: Tokenizer
    train: tuple[tuple[int, ...], ...]
    val: tuple[tuple[int, ...], ...]
    loss_floor: float  # Bayes-optimal nats per predicted token on the untruncated val documents
    truncated_fraction: float  # share of all documents cut to seq_len


def truncate(ids: list[int], max_len: int, eos_id: int) -> list[int]:
    """Cut ``ids`` to ``max_len`` tokens, keeping the final EOS so the example still ends a document."""
    if len(ids) <= max_len:
        return ids
    return ids[: max_len - 1] + [eos_id]


@lru_cache(maxsize=4)
def load_corpus(cfg: DataConfig) -> Corpus:
    """Sample the corpus, split it by document text, train (or load) the tokenizer, tokenize.

    Cached per config within a process; the tokenizer is also cached on disk.
    """
    source = MarkovSource.from_config(cfg)
    texts = source.sample(cfg.num_docs, seed=cfg.corpus_seed + 1)
    train_texts = [t for t in texts if split_of(t, cfg.val_fraction) == "train"]
    val_texts = [t for t in texts if split_of(t, cfg.val_fraction) == "val"]
    tok = load_or_train_tokenizer(train_texts, cfg.vocab_size)

    train_ids, val_ids = tok.encode_batch(train_texts), tok.encode_batch(val_texts)
    too_long = sum(len(ids) > cfg.seq_len for ids in train_ids + val_ids)
    if too_long and not cfg.truncate:
        raise ValueError(f"{too_long} documents exceed seq_len={cfg.seq_len} tokens and truncation is off")
    # The floor is exact only for documents the model sees whole.
    whole = [(t, ids) for t, ids in zip(val_texts, val_ids, strict=True) if len(ids) <= cfg.seq_len]
    nats = sum(-source.log_prob(t) for t, _ in whole)
    predicted = sum(len(ids) - 1 for _, ids in whole)  # every token after BOS, EOS included
    return Corpus(
        tokenizer=tok,
        train=tuple(tuple(truncate(ids, cfg.seq_len, tok.eos_id)) for ids in train_ids),
        val=tuple(tuple(truncate(ids, cfg.seq_len, tok.eos_id)) for ids in val_ids),
        loss_floor=nats / predicted,
        truncated_fraction=too_long / len(texts),
    )


def collate(docs, pad_id: int, pad_side: str = "right", ignore_index: int = IGNORE_INDEX) -> dict:
    """Pad a list of token-id documents into a batch.

    Returns a dict of (B, T) int64 tensors, T = longest document:
    ``input_ids`` (pads = ``pad_id``), ``attention_mask`` (1 real, 0 pad), ``position_ids`` (0, 1, ...
    from each row's first real token, so left padding does not move positions) and ``labels``
    (the input ids with ``ignore_index`` on pads and on BOS).
    """
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
        labels[row, start + 1 : start + n] = tokens[1:]  # BOS is never a target
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "labels": labels,
    }
