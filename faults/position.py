"""Faults in the `position` subsystem: position ids, RoPE tables and rotation, cache offsets."""

import torch

from faultbench.faults.registry import Manifest, fault
from faultbench.model.attention import apply_rope, attend


@fault(
    "rope_past_len_drift",
    seam="model.rope.position_ids_from_mask",
    title="Decode positions offset by the cache length (slot index, left pads included)",
    subsystem="position",
    also_acceptable=("model",),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="Positions of new tokens are counted from the mask of the new tokens only and offset by "
    "past_len, the number of cached columns. That equals the real-token count only for rows without "
    "padding: in a left-padded batch each decoded token of a padded row is placed as many positions too "
    "far as the row has pads, while its prompt was placed by the mask. Prefill and decode disagree, so "
    "the cached logits of padded rows differ from an uncached forward over the same tokens (greedy tokens "
    "flip once the model relies on positions); training and evaluation (no cache) are untouched.",
    fix="Count positions over the whole mask (cached columns included) and then keep the new columns: "
    "(mask.cumsum(-1) - 1)[:, past_len:].",
    references=(
        "HF transformers GPT-2/Llama prepare_inputs_for_generation: position_ids = attention_mask.long()"
        ".cumsum(-1) - 1 for left-padded batched generation, then sliced to the new tokens",
        "HF transformers docs, 'Generation with LLMs' (llm_tutorial), common pitfall 'Wrong padding side'",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "cached_logit_gap", "faulty_min": 2e-3, "clean_max": 1e-4}),
)
def position_ids_from_mask_cache_offset(attention_mask: torch.Tensor, past_len: int = 0) -> torch.Tensor:
    """New-token positions are past_len + their index among the new columns (pads counted)."""
    positions = attention_mask[:, past_len:].long().cumsum(-1) - 1 + past_len  # (B, T_total - past_len)
    return positions.clamp_(min=0)


@fault(
    "rope_table_one_short",
    seam="model.rope.rope_tables",
    title="RoPE table built with max_positions - 1 rows: a full-length sequence indexes past its end",
    subsystem="position",
    trigger="rare-batch",
    symptoms=("crash-index",),
    explanation="The tables cover positions 0..max_positions-2. Every batch whose longest document is "
    "shorter than max_positions is fine; the first batch holding a document of exactly seq_len tokens "
    "(the truncated long documents, about 1% of the corpus) looks up position max_positions-1 and "
    "fails with an index error in rope_at, some steps into training.",
    fix="Build the tables over torch.arange(max_positions): one row per position the model accepts.",
    references=(
        "HF transformers: 'IndexError: index out of range in self' when a sequence is longer than the "
        "position table (max_position_embeddings), a frequent forum/issue report",
        "karpathy/nanoGPT model.py: GPT.forward asserts t <= block_size ('Cannot forward sequence of length "
        "...') before indexing the position table",
    ),
    manifest=Manifest(check="crash", steps=30, params={"types": ("IndexError",), "seam": "model.rope.rope_at",
                                                        "min_step": 5}),
)
def rope_tables_one_short(head_dim: int, max_positions: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One row too few: positions 0..max_positions-2."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_positions - 1, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


@fault(
    "rope_q_only",
    seam="model.attention.CausalSelfAttention.forward",
    title="RoPE applied to the queries only: keys carry no position",
    subsystem="position",
    also_acceptable=("model",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="Only q is rotated. A score then depends on the query's absolute position and the key's "
    "content, never on where the key is: the model cannot attend to 'the previous token' by position, "
    "only by content. Nothing crashes. On a corpus that needs word order the loss suffers; the tiny "
    "preset's corpus barely uses positions, so there the loss is unchanged, but the logits now change "
    "when every position is shifted by the same amount, which a relative encoding forbids.",
    fix="Rotate both q and k with the same cos/sin (before the cache update), so scores depend on m - n.",
    references=(
        "Su et al., 'RoFormer: Enhanced Transformer with Rotary Position Embedding' (2021): the relative "
        "property holds only when both queries and keys are rotated",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "rope_shift_gap", "faulty_min": 1e-2, "clean_max": 1e-4}),
)
def attention_forward_q_only(self, x, rope, attn_mask, cache=None, layer_idx: int = 0):
    """Rotates q but not k."""
    B, T, C = x.shape
    q, k, v = self.qkv(x).split(C, dim=2)  # (B, T, C) each
    q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
    k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    q = apply_rope(q, *rope)
    if cache is not None:
        k, v = cache.update(layer_idx, k, v)  # (B, nh, T_past + T, hs)
    y = attend(q, k, v, attn_mask, self.dropout if self.training else 0.0)  # (B, nh, T, hs)
    y = y.transpose(1, 2).reshape(B, T, C)
    return self.resid_dropout(self.proj(y))


@fault(
    "rope_rotation_sign",
    seam="model.rope.apply_rope",
    title="RoPE's second half combined with the wrong sign: not a rotation, positions stop being relative",
    subsystem="position",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="apply_rope computes x2 * cos - x1 * sin for the second half instead of x2 * cos + x1 * sin. "
    "Each channel pair is multiplied by the symmetric matrix [[cos, -sin], [-sin, cos]], which is not a "
    "rotation: it rescales the pair (singular near 45 degrees) and the product of a query's and a key's "
    "matrices depends on m + n, not only on m - n. Scores now depend on absolute positions, so shifting "
    "all positions by a constant changes the logits, and high-frequency channels lose information.",
    fix="Rotate each pair: (x1 * cos - x2 * sin, x2 * cos + x1 * sin), i.e. x * cos + rotate_half(x) * sin "
    "with rotate_half(x) = cat(-x2, x1).",
    references=(
        "Su et al., 'RoFormer: Enhanced Transformer with Rotary Position Embedding' (2021): the rotation "
        "matrix R_m and the relative property R_m^T R_n = R_(n-m)",
        "HF transformers modeling_llama.rotate_half / apply_rotary_pos_emb: q * cos + rotate_half(q) * sin",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "rope_shift_gap", "faulty_min": 5e-3, "clean_max": 1e-4}),
)
def apply_rope_sign_slip(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Second half uses - x1 * sin: the map is not a rotation."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos - x1 * sin), dim=-1)
    return rotated.to(x.dtype)
