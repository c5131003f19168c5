"""The attention mask and the attention math stay finite in reduced precision."""

import pytest
import torch

from faultbench.model.attention import attend, build_attention_mask
from faultbench.model.data import collate


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_left_padded_mask_is_finite_and_no_row_is_empty(dtype):
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    additive = build_attention_mask(mask, 5, dtype)
    assert additive.dtype == dtype and torch.isfinite(additive).all()
    allowed = additive == 0
    assert allowed.any(-1).all(), "a query with no key to attend to softmaxes to NaN"
    # real tokens never see pads or the future
    assert not allowed[0, 0, 2:, :2].any() and not allowed[1, 0].triu(1).any()


def test_fp16_forward_with_left_padding_is_finite(eval_model, corpus, pad_id):
    batch = collate(corpus.val[:8], pad_id, "left")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        logits = eval_model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    assert torch.isfinite(logits).all()


def test_attention_is_safe_in_fp16_with_large_scores():
    # scores around 100: exp() overflows fp16 unless the softmax subtracts the row max
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    q = q * 10 / q.norm(dim=-1, keepdim=True) * 4
    k = k * 10 / k.norm(dim=-1, keepdim=True)
    expected = attend(q, k, v, None, 0.0)
    with torch.autocast("cpu", dtype=torch.float16):
        got = attend(q.half(), k.half(), v.half(), None, 0.0)
    assert torch.isfinite(got).all()
    assert (got.float() - expected).abs().max() < 2e-2
