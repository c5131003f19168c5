"""A plain single-file GPT, written flat the way nanoGPT would: the speed baseline for benchmarks/perf.py.

Same shape and math as model.gpt.GPT (pre-norm, RoPE half-split on q and k in float32, tied
embedding/head, GELU MLP 4x, LayerNorm with bias) and the same parameter names, so it loads the
reference state_dict. No seams and no safety features: attention is always
``scaled_dot_product_attention(..., is_causal=True)`` and padding is ignored. That is exact under
right padding: a real token never attends to a later pad, and the loss ignores pad labels.
Positions are 0..T-1, which are the reference's positions for every real token of a right-padded row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from faultbench.model.config import ModelConfig


def rope_tables(head_dim: int, max_positions: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()  # (max_positions, hs/2) each


def apply_rope(x, cos, sin):
    # x: (B, nh, T, hs); cos, sin: (T, hs/2). Rotate channel pairs (i, i + hs/2) in float32.
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.ln_1(x), cos, sin)
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        cos, sin = rope_tables(cfg.head_dim, cfg.max_positions, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)  # not in the state_dict, as in the reference
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # positions 0..T-1, sliced once for all layers
        x = self.drop(self.wte(input_ids))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def lm_loss(logits, labels, ignore_index: int = -100):
    """Token-mean next-token cross-entropy; labels are aligned with the inputs (position t predicts t+1)."""
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=ignore_index
    )
