"""Label alignment: the loss is -log p(x[t+1] | x[:t+1]) averaged over real targets, shift done once.

Built by hand on a tiny case with known ids, so an off-by-one (no shift, double shift), BOS counted as
a target, or pads counted in the mean all give a different number.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from faultbench.model.data import IGNORE_INDEX, collate
from faultbench.model.loss import count_targets, lm_loss

PAD, BOS, EOS = 0, 1, 2
DOCS = [[BOS, 5, 6, 7, EOS], [BOS, 8, EOS]]
V = 10


def hand_loss(logits: torch.Tensor, docs, pad_side: str) -> float:
    """Mean over every (doc, t >= 1) of -log softmax(logits at the position of x[t-1])[x[t]]."""
    T = logits.shape[1]
    total, n = 0.0, 0
    for r, doc in enumerate(docs):
        offset = 0 if pad_side == "right" else T - len(doc)
        for t in range(1, len(doc)):  # doc[0] is BOS: never a target
            log_p = F.log_softmax(logits[r, offset + t - 1].double(), dim=-1)
            total -= float(log_p[doc[t]])
            n += 1
    return total / n


@pytest.mark.parametrize("pad_side", ["left", "right"])
def test_labels_are_inputs_with_bos_and_pads_ignored(pad_side):
    batch = collate(DOCS, PAD, pad_side)
    X = IGNORE_INDEX  # short, so the expected rows line up
    if pad_side == "right":
        assert batch["input_ids"].tolist() == [[1, 5, 6, 7, 2], [1, 8, 2, PAD, PAD]]
        assert batch["labels"].tolist() == [[X, 5, 6, 7, 2], [X, 8, 2, X, X]]
    else:
        assert batch["input_ids"].tolist() == [[1, 5, 6, 7, 2], [PAD, PAD, 1, 8, 2]]
        assert batch["labels"].tolist() == [[X, 5, 6, 7, 2], [X, X, X, 8, 2]]
    assert count_targets(batch["labels"]) == 4 + 2  # tokens after BOS, EOS included


@pytest.mark.parametrize("pad_side", ["left", "right"])
def test_lm_loss_equals_hand_computed_next_token_nll(pad_side):
    batch = collate(DOCS, PAD, pad_side)
    logits = torch.randn(2, batch["input_ids"].shape[1], V, generator=torch.Generator().manual_seed(0))
    got = lm_loss(logits, batch["labels"]).item()
    assert got == pytest.approx(hand_loss(logits, DOCS, pad_side), rel=1e-6)


@pytest.mark.parametrize("pad_side", ["left", "right"])
def test_num_targets_sets_the_denominator(pad_side):
    batch = collate(DOCS, PAD, pad_side)
    logits = torch.randn(2, batch["input_ids"].shape[1], V, generator=torch.Generator().manual_seed(1))
    mean = lm_loss(logits, batch["labels"]).item()
    assert lm_loss(logits, batch["labels"], num_targets=12).item() == pytest.approx(mean * 6 / 12, rel=1e-6)


def test_perfect_next_token_logits_give_zero_loss_and_current_token_logits_do_not():
    batch = collate(DOCS, PAD, "right")
    ids = batch["input_ids"]
    B, T = ids.shape
    # logits at position t peaked on the NEXT input token: the aligned prediction
    next_ids = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    nxt = torch.full((B, T, V), -50.0).scatter_(-1, next_ids[..., None], 50.0)
    assert lm_loss(nxt, batch["labels"]).item() < 1e-6
    # peaked on the CURRENT token (the classic missing shift): every target is wrong
    cur = torch.full((B, T, V), -50.0).scatter_(-1, ids[..., None], 50.0)
    assert lm_loss(cur, batch["labels"]).item() > 50.0


@pytest.mark.parametrize("pad_side", ["left", "right"])
def test_positions_without_a_target_do_not_affect_the_loss(pad_side):
    # the last position (predicts nothing), pad positions, and the position before BOS on the left
    batch = collate(DOCS, PAD, pad_side)
    logits = torch.randn(2, batch["input_ids"].shape[1], V, generator=torch.Generator().manual_seed(2))
    logits.requires_grad_(True)
    lm_loss(logits, batch["labels"]).backward()
    has_target = torch.zeros_like(batch["labels"], dtype=torch.bool)
    has_target[:, :-1] = batch["labels"][:, 1:] != IGNORE_INDEX
    grad_norm_per_pos = logits.grad.abs().sum(-1)
    assert (grad_norm_per_pos[~has_target] == 0).all()
    assert (grad_norm_per_pos[has_target] > 0).all()
    assert int(has_target.sum()) == 6


def test_model_loss_is_mean_nll_of_real_next_tokens(eval_model, corpus, pad_id):
    # end to end on the real model: lm_loss(model(x)) == mean of -log p(x[t+1] | x[:t+1]) by hand
    docs = [list(d) for d in corpus.val[:5]]
    batch = collate(docs, pad_id, "right")
    with torch.no_grad():
        logits = eval_model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    got = lm_loss(logits, batch["labels"]).item()
    assert got == pytest.approx(hand_loss(logits, docs, "right"), rel=1e-5)
    assert math.isfinite(got) and got > 0
