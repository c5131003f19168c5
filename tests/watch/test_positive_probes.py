"""Positive tests of the probe detectors through ``faultbench.watch`` (their probes' functions are tested in
tests/watch/test_probes.py; benchmarks/detector_mutation.py found the detectors surviving as no-ops).

A tiny rotary-position causal LM of our own (``forward(input_ids, attention_mask=None, position_ids=None) ->
logits``), hand-broken one way per case, trained two steps under a watch of the one detector under test with the
loop's positions declared relative: the broken model gets that detector's finding (subsystem, module) before the
first optimizer step; the correct model gets none from it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import faultbench

VOCAB, DIM, HEADS, LAYERS, T = 32, 32, 2, 2, 16


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, H, T, D) at positions (B, T)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions[:, None, :, None].float() * freqs  # (B, 1, T, half)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Attention(nn.Module):
    def __init__(self, bugs: frozenset):
        super().__init__()
        self.qkv, self.proj, self.bugs = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM), bugs

    def forward(self, x, attention_mask, positions):
        B, L, _ = x.shape
        q, k, v = (t.view(B, L, HEADS, DIM // HEADS).transpose(1, 2) for t in self.qkv(x).split(DIM, -1))
        q = rotate(q, positions)
        if "keys_not_rotated" not in self.bugs:  # else: scores depend on the query's absolute position
            k = rotate(k, positions)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS)
        allowed = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
        if attention_mask is not None and "mask_ignored" not in self.bugs:
            allowed = allowed & attention_mask[:, None, None, :].bool()
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        weights = scores.softmax(-2 if "softmax_over_queries" in self.bugs else -1)
        if "keys_pooled_over_batch" in self.bugs:  # the values averaged over the batch: every row sees every other
            v = v + v.mean(0, keepdim=True)
        if "dropout_in_eval" in self.bugs:  # training=True hard-coded instead of self.training
            weights = F.dropout(weights, 0.1, training=True)
        return self.proj((weights @ v).transpose(1, 2).reshape(B, L, DIM))


class Block(nn.Module):
    def __init__(self, bugs: frozenset):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(DIM), Attention(bugs), nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, attention_mask, positions):
        x = x + self.attn(self.ln1(x), attention_mask, positions)
        return x + self.mlp(self.ln2(x))


class RotaryLM(nn.Module):
    """Bugs: keys_not_rotated, mask_ignored, softmax_over_queries, dropout_in_eval, keys_pooled_over_batch
    (attention); position_ids_ignored (recomputed from 0), returns_probabilities (softmax of the logits, the loop's
    cross-entropy on them), last_block_skipped (the layer loop stops one short)."""

    def __init__(self, bugs=()):
        super().__init__()
        self.bugs = frozenset(bugs)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(self.bugs) for _ in range(LAYERS)])
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        if position_ids is None or "position_ids_ignored" in self.bugs:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        x = self.embed(input_ids)
        for block in self.blocks[:-1] if "last_block_skipped" in self.bugs else self.blocks:
            x = block(x, attention_mask, position_ids)
        logits = self.head(self.norm(x))
        return logits.softmax(-1) if "returns_probabilities" in self.bugs else logits


def train(detector: str, bugs=(), seed: int = 0, steps: int = 2):
    """Two steps of a plain loop on random token rows under a watch of ``detector`` alone; the Watch."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = RotaryLM(bugs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = faultbench.watch(model, optimizer, report=False, detectors=[detector], declare={"positions": "relative"})
    with w:
        for _ in range(steps):
            x = torch.randint(2, VOCAB, (4, T))
            logits = model(x)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert w.errors == {} and w.not_applicable == {}, (w.errors, w.not_applicable)
    return w


# detector -> (bug, subsystem, where) of its finding
CASES = {
    "bb_eval_determinism": ("dropout_in_eval", "model", "blocks.0.attn"),
    "bb_output_contract": ("returns_probabilities", "model", ""),
    "bb_padding_invariance": ("mask_ignored", "mask", "blocks.0.attn"),
    "bb_position_shift": ("keys_not_rotated", "position", "blocks.0.attn"),
    "bb_positions_used": ("position_ids_ignored", "position", ""),
    "bb_attention_distribution": ("softmax_over_queries", "model", "blocks.0.attn"),
    "bb_row_isolation": ("keys_pooled_over_batch", "model", "blocks.0.attn"),
    "bb_layers_once": ("last_block_skipped", "model", ""),
}


@pytest.mark.parametrize("detector", sorted(CASES))
def test_the_correct_model_gives_the_probe_no_finding(detector):
    assert train(detector).findings == []


@pytest.mark.parametrize("detector", sorted(CASES))
def test_the_broken_model_is_found_by_the_probe_before_the_first_step(detector):
    bug, subsystem, where = CASES[detector]
    w = train(detector, (bug,))
    assert [(f.detector, f.subsystem, f.where, f.step) for f in w.findings] == [(detector, subsystem, where, 0)]
