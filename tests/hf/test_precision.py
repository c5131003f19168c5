"""bf16 autocast on the HF target: what it must leave in float32.

Trainer with ``bf16=True`` runs every forward under CPU bf16 autocast (accelerate wraps the model's forward), so
whatever autocast lowers is computed in bf16. RoPE's angles must not be: bf16 keeps 8 significant bits, so at
long context the positions themselves round (transformers#29285).
"""

from __future__ import annotations

import torch

LONG = 4096  # positions 0..LONG-1: bf16 spaces integers 16 apart at 2048..4096


def test_rope_tables_are_float32_under_bf16_autocast(fresh_model):
    model, _, _ = fresh_model
    rotary = model.model.rotary_emb
    x = torch.zeros(1, 1, model.config.hidden_size)  # only its dtype and device matter: the residual stream's
    positions = torch.arange(LONG).unsqueeze(0)  # (1, LONG)
    plain = rotary(x, positions)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = rotary(x, positions)
    angles = positions[0, :, None].double() * rotary.inv_freq.double()  # (LONG, head_dim / 2)
    exact = torch.cat((angles, angles), -1)
    for table, under, fn in zip(plain, autocast, (torch.cos, torch.sin), strict=True):
        assert table.dtype == under.dtype == torch.float32
        assert torch.equal(table, under), f"autocast moves the table by {(table - under).abs().max():.3g}"
        # fp32 angles at 4096 are within half a spacing (2.4e-4 rad) of the exact ones
        assert (table[0].double() - fn(exact)).abs().max() < 5e-4
