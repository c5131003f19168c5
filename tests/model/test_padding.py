"""Padding must be invisible: a document's per-token loss is the same alone, left-padded or right-padded.

Pads are masked out of attention and out of the loss, and positions count real tokens only, so the
pad side, the pad width and even the pad token's id cannot change what the model computes for real
tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from faultbench.model.data import IGNORE_INDEX, collate
from faultbench.model.evaluate import evaluate

# per-token CE of a real token, padded vs alone: measured max abs diff 9.5e-7 (fp32)
CE_ATOL = 1e-5


def per_token_ce(model, batch: dict, **forward_kwargs) -> list[torch.Tensor]:
    """Per row, the cross-entropy of each real target token, computed directly from logits and labels."""
    logits = model(batch["input_ids"], batch["attention_mask"], **forward_kwargs)
    labels = batch["labels"]
    rows = []
    for r in range(labels.shape[0]):
        targets = labels[r, 1:]
        keep = targets != IGNORE_INDEX
        log_probs = F.log_softmax(logits[r, :-1].float(), dim=-1)  # position t predicts labels[t + 1]
        rows.append(-log_probs[keep].gather(-1, targets[keep, None]).squeeze(-1))
    return rows


@pytest.fixture(scope="module")
def mixed_docs(corpus, long_docs):
    """Documents of very different lengths (shortest possible, typical, and a full seq_len one)."""
    by_len = {}
    for d in corpus.val:
        by_len.setdefault(len(d), d)
    docs = [by_len[n] for n in (3, 4, 7, 12, 23) if n in by_len] + [long_docs[0]]
    assert len({len(d) for d in docs}) >= 5
    return docs


@pytest.fixture(scope="module")
def alone_ce(trained_model, mixed_docs, pad_id):
    with torch.no_grad():
        return [per_token_ce(trained_model, collate([d], pad_id))[0] for d in mixed_docs]


@pytest.mark.parametrize("pad_side", ["left", "right"])
@torch.no_grad()
def test_padded_per_token_loss_equals_unpadded(eval_model, mixed_docs, alone_ce, pad_id, pad_side):
    batch = collate(mixed_docs, pad_id, pad_side)
    assert (batch["attention_mask"] == 0).any(), "the batch must actually contain padding"
    padded = per_token_ce(eval_model, batch, position_ids=batch["position_ids"])
    for doc, alone, got in zip(mixed_docs, alone_ce, padded, strict=True):
        assert got.shape == alone.shape == (len(doc) - 1,)  # every token after BOS is a target
        assert (got - alone).abs().max().item() < CE_ATOL, f"doc of length {len(doc)}"


@pytest.mark.parametrize("pad_side", ["left", "right"])
@torch.no_grad()
def test_default_positions_equal_collate_positions(eval_model, mixed_docs, pad_id, pad_side):
    # forward() derives positions from the mask when none are given: the same rule as collate
    batch = collate(mixed_docs, pad_id, pad_side)
    explicit = eval_model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    derived = eval_model(batch["input_ids"], batch["attention_mask"])
    assert torch.equal(explicit, derived)


@pytest.mark.parametrize("pad_side", ["left", "right"])
def test_collate_positions_count_real_tokens(mixed_docs, pad_id, pad_side):
    batch = collate(mixed_docs, pad_id, pad_side)
    for r, doc in enumerate(mixed_docs):
        real = batch["attention_mask"][r].bool()
        assert batch["input_ids"][r, real].tolist() == list(doc)
        assert batch["position_ids"][r, real].tolist() == list(range(len(doc)))


@pytest.mark.parametrize("pad_side", ["left", "right"])
@torch.no_grad()
def test_pad_token_id_is_irrelevant(eval_model, mixed_docs, pad_id, pad_side):
    # pads are masked, so filling them with an ordinary token must not change any real token's logits
    # (measured: exactly 0.0 difference)
    batch = collate(mixed_docs, pad_id, pad_side)
    real = batch["attention_mask"].bool()
    other = batch["input_ids"].masked_fill(~real, 7)
    a = eval_model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    b = eval_model(other, batch["attention_mask"], batch["position_ids"])
    assert (a[real] - b[real]).abs().max().item() < CE_ATOL


@pytest.mark.parametrize(
    ("pad_side", "batch_size"), [("right", 1), ("left", 7), ("right", 64)], ids=["right-bs1", "left-bs7", "right-bs64"]
)
def test_evaluate_independent_of_padding_and_batch_size(eval_model, corpus, pad_id, pad_side, batch_size):
    docs = corpus.val[:100]
    # measured: at most 1.9e-7 apart (summation order only)
    reference = evaluate(eval_model, docs, pad_id, batch_size=100, pad_side="left")
    got = evaluate(eval_model, docs, pad_id, batch_size=batch_size, pad_side=pad_side)
    assert got == pytest.approx(reference, abs=1e-5)
