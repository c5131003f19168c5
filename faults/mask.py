"""Faults in the `mask` subsystem: causal and padding masks."""

import torch

from faults.registry import Manifest, also_replaces, fault


@fault(
    "fp16_mask_constant",
    seam="model.attention.build_attention_mask",
    title="Additive mask built with float32's min and cast to fp16: -inf, NaN on fully masked rows",
    subsystem="mask",
    also_acceptable=("precision",),
    trigger="amp-only",
    symptoms=("nan",),
    explanation="The mask is filled with torch.finfo(torch.float32).min and cast to the compute dtype. In "
    "fp16 that constant overflows to -inf. A left-padded row's pad queries have no key they may attend "
    "to, so their softmax is over -inf only: NaN, which the next layer's attention spreads to every "
    "token (0 * NaN = NaN). fp32 and bf16 runs, and right-padded batches, are fine.",
    fix="Use the compute dtype's own finfo(dtype).min and never leave a row fully masked (let each query "
    "see itself), or use a boolean mask.",
    references=(
        "huggingface/transformers#17937 and related: fp16 NaN from attention mask min value "
        "(finfo(float32).min cast to half)",
        "HF modeling_attn_mask_utils: _unmask_unattended exists because fully masked rows NaN in SDPA math",
    ),
    manifest=Manifest(check="nan", steps=5, params={"by_step": 1},
                      variant={"data": {"pad_side": "left"}, "train": {"precision": "fp16"}}),
)
def build_attention_mask_fp32_min(attention_mask: torch.Tensor, query_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Masked entries hold float32's min, cast to ``dtype``; no row is guaranteed an allowed key."""
    batch, key_len = attention_mask.shape
    if query_len == key_len and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        return None
    device = attention_mask.device
    query_pos = torch.arange(key_len - query_len, key_len, device=device)[:, None]  # (T_q, 1)
    key_pos = torch.arange(key_len, device=device)[None, :]  # (1, T_k)
    allowed = (key_pos <= query_pos) & attention_mask.bool()[:, None, :]  # (B, T_q, T_k)
    mask = torch.zeros(batch, 1, query_len, key_len, device=device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min).to(dtype)


@also_replaces("fp16_mask_constant", "model.attention.attend")
def attend_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """Eager attention (scores + mask, softmax, weighted sum): PyTorch's CPU flash kernel would zero a
    fully masked row instead of producing NaN, the math path (and CUDA's) does not."""
    scale = q.size(-1) ** -0.5
    scores = q @ k.transpose(-2, -1) * scale  # (B, nh, T_q, T_k)
    if attn_mask is None:
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    else:
        scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nn.functional.dropout(probs, dropout_p)
    return probs @ v
