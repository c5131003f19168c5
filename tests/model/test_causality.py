"""Causality: the logits at position t depend only on tokens 0..t of their own row.

A wrong mask (off by one, inverted, or padding combined wrongly with causality) lets later tokens or
other rows leak in; a leak makes training loss look better than the data allows.
"""

from __future__ import annotations

import pytest
import torch

from faultbench.model.data import collate

# Logits at positions <= t after changing tokens > t: measured max abs diff exactly 0.0 (with and
# without padding); the changed position itself moves by 2.2-4.9, so a leak cannot hide under ATOL.
ATOL = 1e-6
LENGTH = 32


def perturb_after(ids: list[int], t: int, seed: int = 0) -> list[int]:
    """``ids`` with every token after position t replaced by a different random ordinary token."""
    g = torch.Generator().manual_seed(seed)
    out = list(ids)
    for i in range(t + 1, len(out)):
        out[i] = 4 + (out[i] - 4 + int(torch.randint(1, 150, (1,), generator=g))) % 150  # never special, never equal
    return out


@pytest.mark.parametrize("t", [0, 5, 17, LENGTH - 2], ids=lambda t: f"t{t}")
@torch.no_grad()
def test_future_tokens_do_not_change_past_logits(eval_model, long_docs, t):
    doc = list(long_docs[0][:LENGTH])
    changed = perturb_after(doc, t)
    a = eval_model(torch.tensor([doc]))
    b = eval_model(torch.tensor([changed]))
    assert (a[:, : t + 1] - b[:, : t + 1]).abs().max().item() < ATOL
    # and the perturbation is real: the first changed input moves the logits right at it
    assert (a[:, t + 1] - b[:, t + 1]).abs().max().item() > 1e-3


@pytest.mark.parametrize("pad_side", ["left", "right"])
@pytest.mark.parametrize("t", [0, 9, 20], ids=lambda t: f"t{t}")
@torch.no_grad()
def test_causality_with_padding(eval_model, long_docs, corpus, pad_id, pad_side, t):
    doc = list(long_docs[1][:24])
    short = corpus.val[0]  # a shorter companion row forces padding in the batch
    assert len(short) < len(doc)
    base = collate([doc, short], pad_id, pad_side)
    moved = collate([perturb_after(doc, t), short], pad_id, pad_side)
    a = eval_model(base["input_ids"], base["attention_mask"], base["position_ids"])
    b = eval_model(moved["input_ids"], moved["attention_mask"], moved["position_ids"])
    real = base["attention_mask"][0].bool()
    a0, b0 = a[0, real], b[0, real]  # the long row's real positions, in order
    assert (a0[: t + 1] - b0[: t + 1]).abs().max().item() < ATOL
    assert (a0[t + 1] - b0[t + 1]).abs().max().item() > 1e-3
    # the other row is untouched by the change
    assert (a[1] - b[1]).abs().max().item() < ATOL


@pytest.mark.parametrize("pad_side", ["left", "right"])
@torch.no_grad()
def test_rows_do_not_see_each_other(eval_model, corpus, pad_id, pad_side):
    row0 = corpus.val[1]
    others = [corpus.val[2], corpus.val[5]]
    assert len({len(d) for d in others}) == 2
    a = collate([row0, others[0]], pad_id, pad_side)
    b = collate([row0, others[1]], pad_id, pad_side)
    la = eval_model(a["input_ids"], a["attention_mask"], a["position_ids"])[0, a["attention_mask"][0].bool()]
    lb = eval_model(b["input_ids"], b["attention_mask"], b["position_ids"])[0, b["attention_mask"][0].bool()]
    assert (la - lb).abs().max().item() < 1e-5  # measured 9.5e-7: padding width differs, rounding only
