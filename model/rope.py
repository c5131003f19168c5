"""Positions and rotary position embeddings (RoPE).

A token's position is the number of real tokens before it in its row, so a left-padded row and the
same row unpadded give every real token the same position. Positions come from the attention mask,
in prefill and in cached decode alike: one rule, so the two can never drift apart.
"""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor, past_len: int = 0) -> torch.Tensor:
    """Positions of the tokens after the first ``past_len`` columns.

    attention_mask: (B, T_total) with 1 for real tokens and 0 for pads.
    Returns (B, T_total - past_len) int64. Left pads get 0 and right pads repeat the last real
    position; pad outputs are never used.
    """
    positions = attention_mask.long().cumsum(-1) - 1  # (B, T_total)
    return positions.clamp_(min=0)[:, past_len:]


def rope_tables(head_dim: int, max_positions: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_positions, head_dim // 2), always float32."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rope_at(cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The table rows of each token's position, shaped to broadcast over heads.

    cos, sin: (max_positions, hs/2) float32; position_ids: (B, T). Returns cos, sin each (B, 1, T, hs/2).
    Looked up once per forward and shared by every layer.
    """
    return cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + hs/2) of ``x`` by the angle of each token's position.

    x: (B, nh, T, hs); cos, sin: (B, 1, T, hs/2) float32 from ``rope_at``. The rotation runs in
    float32 (outside autocast) and the result is cast back to ``x.dtype``.
    """
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)
