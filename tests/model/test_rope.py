"""RoPE: a rotation whose attention scores depend only on relative position.

The synthetic corpus barely needs positions (the next word depends on the previous one), so a broken
rotation can still train well; these direct checks catch it instead.
"""

from __future__ import annotations

import pytest
import torch

from faultbench.model.rope import apply_rope, position_ids_from_mask, rope_at, rope_tables

HS, MAXPOS = 16, 64


@pytest.fixture(scope="module")
def tables():
    return rope_tables(HS, MAXPOS, 10000.0)


def rotate(x: torch.Tensor, pos: int, tables) -> torch.Tensor:
    """x: (hs,) rotated to position ``pos``."""
    cos, sin = rope_at(*tables, torch.tensor([[pos]]))
    return apply_rope(x.view(1, 1, 1, HS), cos, sin).view(HS)


def test_tables_shape_and_dtype(tables):
    cos, sin = tables
    assert cos.shape == sin.shape == (MAXPOS, HS // 2)
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.allclose(cos**2 + sin**2, torch.ones_like(cos), atol=1e-6)


def test_position_zero_is_identity(tables):
    x = torch.randn(HS, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(rotate(x, 0, tables), x, atol=1e-7)


@pytest.mark.parametrize("pos", [1, 7, 63])
def test_rotation_preserves_norm(tables, pos):
    x = torch.randn(HS, generator=torch.Generator().manual_seed(pos))
    rotated = rotate(x, pos, tables)
    assert not torch.allclose(rotated, x)
    assert rotated.norm().item() == pytest.approx(x.norm().item(), rel=1e-5)


@pytest.mark.parametrize(("m", "n"), [(3, 0), (10, 4), (20, 20), (0, 9)])
@pytest.mark.parametrize("shift", [1, 13, 40])
def test_scores_depend_only_on_relative_position(tables, m, n, shift):
    g = torch.Generator().manual_seed(m * 100 + n)
    q, k = torch.randn(HS, generator=g), torch.randn(HS, generator=g)
    base = rotate(q, m, tables) @ rotate(k, n, tables)
    moved = rotate(q, m + shift, tables) @ rotate(k, n + shift, tables)
    assert moved.item() == pytest.approx(base.item(), abs=1e-4)


def test_rope_at_shapes():
    cos, sin = rope_at(*rope_tables(HS, MAXPOS, 10000.0), torch.zeros(3, 5, dtype=torch.long))
    assert cos.shape == sin.shape == (3, 1, 5, HS // 2)  # broadcasts over heads


def test_position_ids_from_mask_with_cache_offset():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist()[0][2:] == [0, 1, 2, 3]
    # decode step: only the columns after the cached ones, numbered by real tokens before them
    assert position_ids_from_mask(mask, past_len=5).tolist() == [[3], [5]]


@torch.no_grad()
def test_model_is_invariant_to_a_common_position_offset(eval_model, long_docs):
    # RoPE encodes only relative positions, so shifting every position of a row by a constant
    # leaves the logits unchanged (up to rounding of the angle tables): measured max diff 1.4e-6
    ids = torch.tensor([long_docs[2][:24]])
    pos = torch.arange(24)[None]
    a = eval_model(ids, position_ids=pos)
    b = eval_model(ids, position_ids=pos + 30)
    assert (a - b).abs().max().item() < 1e-4
