"""Correct loops that follow conventions other than ours stay silent; what they declare is what the detectors use.

Three correct loops once drew false findings (issue 22's audit): a model whose positions are sinusoids computed from
``position_ids`` (absolute, yet taken as relative because no ``nn.Embedding`` looked them up), a loop that ignores
padded targets with the label -1 (-100 was hard-coded), and a 1000-step warmup watched for 25 steps (read as a
warmup that never ends). Each runs here under every black-box detector, silent; and each contract still bites
where the loop really breaks it: declared relative positions that are absolute, padded targets trained, a warmup
still rising at the run's declared last step.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import faultbench
from faultbench.detectors.blackbox.conventions import Conventions

torch.set_num_threads(1)

VOCAB, DIM, PAD, IGNORE = 48, 32, 0, -1
ROWS, LENGTH, STEPS = 8, 24, 25


def sinusoids(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """(B, T) position ids -> (B, T, dim) the transformer paper's absolute position encoding."""
    freqs = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    angles = positions.float()[..., None] * freqs  # (B, T, dim/2)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class SinusoidalLM(nn.Module):
    """A correct causal LM with absolute positions computed (not looked up) from ``position_ids``; padded keys are
    masked and every query may attend to itself, so no row is all-masked. Loss: next-token cross-entropy with
    ``ignore_index`` -1."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None):
        B, T = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        if position_ids is None:
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        x = self.emb(input_ids) + sinusoids(position_ids, DIM)
        q, k, v = self.qkv(x).view(B, T, 3, 2, DIM // 2).permute(2, 0, 3, 1, 4)  # (3, B, nh, T, hs)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        allowed = causal & (mask[:, None, None, :].bool() | torch.eye(T, dtype=torch.bool, device=x.device))
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, nh, T, hs)
        x = x + self.proj(h.transpose(1, 2).reshape(B, T, DIM))
        x = x + self.mlp(self.norm(x))
        logits = self.head(x)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=IGNORE)
        return types.SimpleNamespace(logits=logits, loss=loss)


class Tok:
    pad_token_id = PAD


def batch(rng: torch.Generator, pad_labels: int = IGNORE) -> dict:
    """Right-padded rows of 10..LENGTH random real tokens; the labels hold ``pad_labels`` at the padding."""
    lengths = torch.randint(10, LENGTH + 1, (ROWS,), generator=rng)
    ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=rng)
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, pad_labels)}


class IgnoresPositions(SinusoidalLM):
    """The same model whose forward takes position ids and drops them (counting from 0 in every row)."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None):
        return super().forward(input_ids, attention_mask, torch.arange(input_ids.shape[1]).expand_as(input_ids),
                               labels)


def run(seed: int, warmup: int = 1000, pad_labels: int = IGNORE, declare: dict | None = None, model_cls=SinusoidalLM):
    """STEPS steps of AdamW under a linear warmup of ``warmup`` steps, an evaluation without grad every 10 steps;
    every black-box detector watching. The Watch."""
    torch.manual_seed(seed)
    rng = torch.Generator().manual_seed(seed)
    model = model_cls()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    with faultbench.watch(model, optimizer, scheduler=scheduler, tokenizer=Tok(), report=False,
                          declare=declare) as w:
        for step in range(STEPS):
            model(**batch(rng, pad_labels)).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 10 == 9:
                model.eval()
                with torch.no_grad():
                    model(**{k: v for k, v in batch(rng).items() if k != "labels"})
                model.train()
    assert w.errors == {}
    return w


def _messages(w) -> list[str]:
    return [f"{f.detector} [{f.subsystem}] {f.where}: {f.message}" for f in w.findings]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_correct_loop_with_sinusoidal_positions_ignore_value_minus_one_and_a_long_warmup_is_silent(seed):
    w = run(seed)
    assert w.findings == [], _messages(w)
    # the detectors these conventions once fooled ran on it, and said why they had nothing to judge
    assert "bb_pad_ids" not in w.not_applicable and "bb_loss_padding" not in w.not_applicable
    assert "declare" in w.not_applicable["bb_position_shift"]


def test_positions_declared_relative_in_a_model_whose_positions_are_absolute_is_a_position_finding():
    w = run(0, declare={"positions": "relative"})
    assert [(f.detector, f.subsystem) for f in w.findings] == [("bb_position_shift", "position")], _messages(w)


def test_a_model_that_drops_the_position_ids_it_is_given_is_a_position_finding():
    w = run(0, model_cls=IgnoresPositions)
    assert [(f.detector, f.subsystem) for f in w.findings] == [("bb_positions_used", "position")], _messages(w)


def test_padded_targets_trained_under_another_ignore_value_are_found_by_the_gradient():
    """The labels hold the pad id at the padding while the loss ignores -1: the model is trained on padding."""
    w = run(0, pad_labels=PAD)
    assert ("bb_loss_padding", "collate") in {(f.detector, f.subsystem) for f in w.findings}, _messages(w)


def test_a_warmup_still_rising_at_the_declared_last_step_is_an_optimizer_finding():
    w = run(0, declare={"total_steps": STEPS})
    assert [(f.detector, f.subsystem, f.where) for f in w.findings] == [("bb_lr_shape", "optimizer", "scheduler")]
    # the same schedule in a run declared 1000 steps long, watched for 25: the warmup may well end later
    assert run(0, declare={"total_steps": 1000}).findings == []


def test_conventions_come_from_the_tokenizer_protocol_and_the_declaration_only():
    class HFLike:
        pad_token_id, eos_token_id, bos_token_id = 3, 2, 1
        pad_id = 99  # a name no protocol gives: never read

    conv = Conventions.of(HFLike(), {"eos_id": 7, "positions": "absolute", "total_steps": 10})
    assert (conv.pad_id, conv.bos_id, conv.eos_id, conv.positions, conv.total_steps) == (3, 1, 7, "absolute", 10)
    assert conv.special == {"bos": 1, "eos": 7} and conv.doubles_as_special(7) and not conv.doubles_as_special(3)
    assert Conventions.of(None) == Conventions()


@pytest.mark.parametrize(("declare", "error"), [
    ({"total_step": 5}, "did you mean 'total_steps'"),
    ({"positions": "rotary"}, "positions must be one of relative, absolute"),
    ({"pad_id": -100}, "pad_id must be a non-negative integer"),
    ({"total_steps": True}, "total_steps must be a non-negative integer"),
])
def test_a_bad_declaration_is_a_one_line_value_error(declare, error):
    with pytest.raises(ValueError, match=error):
        faultbench.watch(SinusoidalLM(), torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), declare=declare)
