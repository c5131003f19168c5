"""Decoder-only GPT: pre-norm blocks, RoPE, tied embedding/head, scaled init, KV cache, generate()."""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import CausalSelfAttention, build_attention_mask
from .config import ModelConfig
from .rope import position_ids_from_mask, rope_at, rope_tables


class KVCache:
    """Keys and values of the tokens seen so far, per layer, preallocated to ``max_len`` tokens.

    Storage is allocated on the first update of each layer with that update's dtype and device, so
    a cache filled under autocast holds the autocast dtype.
    """

    def __init__(self, n_layer: int, max_len: int):
        self.max_len = max_len
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self.lengths = [0] * n_layer

    @property
    def length(self) -> int:
        """Tokens cached so far (every layer holds the same number between forward calls)."""
        return self.lengths[0]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, nh, T, hs) at the layer's current length; return all cached (B, nh, len, hs)."""
        start = self.lengths[layer]
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; cannot append {k.shape[2]} after {start}")
        if self.keys[layer] is None:
            B, nh, _, hs = k.shape
            self.keys[layer] = k.new_zeros(B, nh, self.max_len, hs)
            self.values[layer] = v.new_zeros(B, nh, self.max_len, hs)
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        self.lengths[layer] = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


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
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, attn_mask, cache=None, layer_idx: int = 0):
        x = x + self.attn(self.ln_1(x), rope, attn_mask, cache, layer_idx)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix embeds tokens and scores them
        cos, sin = rope_tables(cfg.head_dim, cfg.max_positions, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)  # float32, never autocast
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """N(0, init_std) weights and zero biases; residual output projections scaled by 1/sqrt(2 n_layer)
        so the residual stream's variance does not grow with depth (GPT-2)."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # the tied matrix counts once

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache: KVCache | None = None):
        """Next-token logits.

        input_ids: (B, T); attention_mask: (B, T_past + T), 1 real / 0 pad, covering cached tokens too
        (None: no padding); position_ids: (B, T), default derived from the mask; cache: filled in place.
        Returns logits (B, T, vocab_size) in the compute dtype.
        """
        B, T = input_ids.shape
        past_len = 0 if cache is None else cache.length
        if past_len + T > self.config.max_positions:
            raise ValueError(
                f"sequence of {past_len + T} tokens exceeds the position table (max_positions="
                f"{self.config.max_positions})"
            )
        if attention_mask is None:
            attention_mask = torch.ones(B, past_len + T, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask, past_len)
        x = self.drop(self.wte(input_ids))  # (B, T, C)
        attn_mask = build_attention_mask(attention_mask, T, _compute_dtype(x))  # None: plain causal
        rope = rope_at(self.rope_cos, self.rope_sin, position_ids)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, attn_mask, cache, i)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_new_tokens: int = 20, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Decode a batch of (left-padded) prompts with the KV cache.

        input_ids, attention_mask: (B, T0), prompts right-aligned (left padding) so every row's next
        token goes in the same column. temperature 0 is greedy. Returns (B, T0 + max_new_tokens).
        Call ``model.eval()`` first: generation does not change the module's mode.
        """
        B, T0 = input_ids.shape
        if T0 + max_new_tokens > self.config.max_positions:
            raise ValueError(
                f"prompt {T0} + max_new_tokens {max_new_tokens} exceeds max_positions={self.config.max_positions}"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        cache = KVCache(self.config.n_layer, T0 + max_new_tokens)
        logits = self(input_ids, attention_mask, cache=cache)
        new_tokens = []
        for i in range(max_new_tokens):
            last = logits[:, -1].float()  # (B, vocab)
            if temperature > 0:
                probs = torch.softmax(last / temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
            else:
                token = last.argmax(dim=-1, keepdim=True)  # (B, 1)
            new_tokens.append(token)
            if i + 1 < max_new_tokens:
                attention_mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
                logits = self(token, attention_mask, cache=cache)
        return torch.cat([input_ids, *new_tokens], dim=1)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention scores will have: the autocast dtype when autocast is on, else x's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype
