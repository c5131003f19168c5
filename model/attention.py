"""Causal self-attention: the mask, the attention math, and the module that ties them to RoPE and the cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .rope import apply_rope


def build_attention_mask(attention_mask: torch.Tensor, query_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive mask combining causality and padding, safe in fp16 and bf16; None when causal suffices.

    attention_mask: (B, T_k) with 1 for real tokens, 0 for pads; the queries are its last
    ``query_len`` columns (earlier columns are the KV cache). Returns (B, 1, T_q, T_k) in ``dtype``:
    0 where a query may attend, ``finfo(dtype).min`` elsewhere. The constant is the dtype's own most
    negative finite value, so the mask never holds -inf; and every query may attend to itself, so no
    row is fully masked (a padded query would otherwise softmax over nothing and produce NaN).

    Returns None when there is no cache and every row is right-padded (or unpadded): a real token
    then never has a pad before it, so plain causal attention gives real tokens the same outputs.
    """
    batch, key_len = attention_mask.shape
    if query_len == key_len and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        return None
    device = attention_mask.device
    query_pos = torch.arange(key_len - query_len, key_len, device=device)[:, None]  # (T_q, 1)
    key_pos = torch.arange(key_len, device=device)[None, :]  # (1, T_k)
    allowed = (key_pos <= query_pos) & attention_mask.bool()[:, None, :]  # (B, T_q, T_k)
    allowed |= key_pos == query_pos
    mask = torch.zeros(batch, 1, query_len, key_len, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs) + mask) v with PyTorch SDPA.

    q: (B, nh, T_q, hs); k, v: (B, nh, T_k, hs); attn_mask: (B, 1, T_q, T_k) additive, or None for
    plain causal attention (T_q == T_k). Returns (B, nh, T_q, hs).
    """
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=attn_mask is None
    )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, rope, attn_mask, cache=None, layer_idx: int = 0):
        """x: (B, T, C) -> (B, T, C). rope: (cos, sin) of each token's position, each (B, 1, T, hs/2);
        with ``cache`` the keys/values of earlier tokens are reused."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # (B, T, C) each
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = apply_rope(q, *rope)
        k = apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v)  # (B, nh, T_past + T, hs)
        y = attend(q, k, v, attn_mask, self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.proj(y))
