"""HF faults in the `position` subsystem: RoPE (``rotate_half``, ``apply_rotary_pos_emb``) and the position ids
that ``generate`` derives for the prompt and every decoded token."""

import torch
from transformers.generation.utils import ALL_CACHE_NAMES
from transformers.models.llama.modeling_llama import rotate_half

from faultbench.faults.registry import Manifest, fault

_GEN = "transformers.generation.utils.GenerationMixin"
_LLAMA = "transformers.models.llama.modeling_llama"


def _generate_gap(key: str, faulty_min: float = 0.05) -> Manifest:
    """The generate scenario's probe ``key`` (clean: zero up to rounding, < 1e-6) must reach ``faulty_min``; a
    model trained 16 steps is barely position-sensitive, so a wrong decode position moves its logits by ~1e-2."""
    return Manifest(check="extra_at_least", scenario="generate", steps=16,
                    params={"key": key, "faulty_min": faulty_min, "clean_max": 1e-4})


@fault(
    "hf_rope_past_len_drift",
    target="hf",
    seam=f"{_GEN}._update_model_kwargs_for_generation",
    title="Decode positions counted twice: each generated token's position runs one further from the cache",
    subsystem="position",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="After every step generate appends the next position ids: arange(num_new_tokens) + the last "
    "position + 1. Here the arange starts at 1 as well, so the first decoded token sits at position n + 1 "
    "instead of n, the next at n + 3, and so on: the offset drifts one further from the true cache length at "
    "every step. RoPE rotates the new query and key by the wrong angle against the keys cached at prefill, so "
    "cached greedy decoding disagrees with a full forward of the same sequence (a uniform shift would be "
    "invisible to RoPE; a drift between prefill and decode is not). Training is unaffected.",
    fix="next_position_ids = torch.arange(num_new_tokens) + position_ids[..., -1:] + 1 (one +1, counted once).",
    references=(
        "huggingface/transformers#29467: Generate: handle cache_position update in generate (decode positions "
        "must continue exactly where the cache ends)",
        "huggingface/transformers#15751: [M2M100, XGLM] fix create_position_ids_from_inputs_embeds (position ids "
        "of cached decoding that do not match the cache)",
    ),
    manifest=_generate_gap("cached_logit_gap", faulty_min=0.002),
)
def update_model_kwargs_position_drift(self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1):
    """The new positions start one past where they should, and the error adds up step after step."""
    # update past_key_values keeping its naming used in model code
    for possible_cache_name in ALL_CACHE_NAMES:
        if possible_cache_name in outputs:
            if possible_cache_name in ("past_buckets_states", "mems"):
                cache_name = "past_key_values"
            else:
                cache_name = possible_cache_name
            model_kwargs[cache_name] = getattr(outputs, possible_cache_name)
            break

    # update token_type_ids with last value
    if (token_type_ids := model_kwargs.get("token_type_ids")) is not None:
        model_kwargs["token_type_ids"] = torch.cat([token_type_ids, token_type_ids[:, -num_new_tokens:]], dim=-1)

    # update mm_token_type_ids with zeros (only-text)
    if (mm_token_type_ids := model_kwargs.get("mm_token_type_ids")) is not None:
        model_kwargs["mm_token_type_ids"] = torch.cat(
            [mm_token_type_ids, mm_token_type_ids.new_zeros((mm_token_type_ids.shape[0], num_new_tokens))], dim=-1
        )

    # Position ids (2D or 3D sometimes)
    position_ids_key = "position_ids" if not is_encoder_decoder else "decoder_position_ids"
    if (position_ids := model_kwargs.get(position_ids_key)) is not None:
        # We want to expand to the same number of dims which is not always the same
        required_dim = [1] * (position_ids.dim() - 1) + [-1]
        next_position_ids = (
            torch.arange(1, num_new_tokens + 1, dtype=position_ids.dtype, device=position_ids.device).view(
                *required_dim
            )
            + position_ids[..., -1:]
            + 1
        )
        next_position_ids = torch.cat([position_ids, next_position_ids], dim=-1)
        model_kwargs[position_ids_key] = next_position_ids

    # 2D attention mask (always 2D here)
    attention_mask_key = "attention_mask" if not is_encoder_decoder else "decoder_attention_mask"
    if (attention_mask := model_kwargs.get(attention_mask_key)) is not None:
        model_kwargs[attention_mask_key] = torch.cat(
            [attention_mask, attention_mask.new_ones((attention_mask.shape[0], num_new_tokens))], dim=-1
        )

    return model_kwargs


@fault(
    "hf_cache_positions_ignore_past",
    target="hf",
    seam=f"{_GEN}._update_model_kwargs_for_generation",
    title="Decode positions not offset by the past: every generated token gets position 0",
    subsystem="position",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The position ids of the new tokens are built as arange(num_new_tokens) for every row, as if "
    "nothing were cached, instead of continuing from the last position: every decoded token is rotated as the first token "
    "of a sequence while its keys sit in the cache after the prompt's. Cached greedy decoding disagrees with a "
    "full forward of the same sequence (which numbers the tokens 0..T-1). Training is unaffected.",
    fix="Offset the new positions by the past: torch.arange(num_new_tokens) + position_ids[..., -1:] + 1.",
    references=(
        "huggingface/transformers#15751: [M2M100, XGLM] fix create_position_ids_from_inputs_embeds (position ids "
        "created without past_key_values_length broke generation with use_cache=True; fixes #15736)",
        "huggingface/transformers#29467: Generate: handle cache_position update in generate",
    ),
    manifest=_generate_gap("cached_logit_gap", faulty_min=0.002),
)
def update_model_kwargs_positions_restart(self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1):
    """The new positions ignore how many tokens are already cached."""
    # update past_key_values keeping its naming used in model code
    for possible_cache_name in ALL_CACHE_NAMES:
        if possible_cache_name in outputs:
            if possible_cache_name in ("past_buckets_states", "mems"):
                cache_name = "past_key_values"
            else:
                cache_name = possible_cache_name
            model_kwargs[cache_name] = getattr(outputs, possible_cache_name)
            break

    # update token_type_ids with last value
    if (token_type_ids := model_kwargs.get("token_type_ids")) is not None:
        model_kwargs["token_type_ids"] = torch.cat([token_type_ids, token_type_ids[:, -num_new_tokens:]], dim=-1)

    # update mm_token_type_ids with zeros (only-text)
    if (mm_token_type_ids := model_kwargs.get("mm_token_type_ids")) is not None:
        model_kwargs["mm_token_type_ids"] = torch.cat(
            [mm_token_type_ids, mm_token_type_ids.new_zeros((mm_token_type_ids.shape[0], num_new_tokens))], dim=-1
        )

    # Position ids (2D or 3D sometimes)
    position_ids_key = "position_ids" if not is_encoder_decoder else "decoder_position_ids"
    if (position_ids := model_kwargs.get(position_ids_key)) is not None:
        # We want to expand to the same number of dims which is not always the same
        required_dim = [1] * (position_ids.dim() - 1) + [-1]
        next_position_ids = (
            torch.arange(num_new_tokens, dtype=position_ids.dtype, device=position_ids.device)
            .view(*required_dim)
            .expand(*position_ids.shape[:-1], -1)
        )
        next_position_ids = torch.cat([position_ids, next_position_ids], dim=-1)
        model_kwargs[position_ids_key] = next_position_ids

    # 2D attention mask (always 2D here)
    attention_mask_key = "attention_mask" if not is_encoder_decoder else "decoder_attention_mask"
    if (attention_mask := model_kwargs.get(attention_mask_key)) is not None:
        model_kwargs[attention_mask_key] = torch.cat(
            [attention_mask, attention_mask.new_ones((attention_mask.shape[0], num_new_tokens))], dim=-1
        )

    return model_kwargs


@fault(
    "hf_gen_position_ids_left_pad",
    target="hf",
    seam=f"{_GEN}._update_model_kwargs_for_generation",
    title="Decode positions taken from the padded length, not the attention mask: left-padded rows jump ahead",
    subsystem="position",
    trigger="rare-batch",
    symptoms=("silent-quality",),
    explanation="generate numbers the prompt from the attention mask (cumsum - 1, so a left-padded prompt "
    "starts at 0 like an unpadded one) but here numbers each new token by the padded sequence length (arange(past_length, past_length + "
    "num_new_tokens), as GPT-2 did before #7552). For a "
    "row without padding the two agree; for a left-padded row the decoded tokens sit pad-count positions "
    "further than the prompt they follow, so RoPE rotates them against the cached prompt keys by the wrong "
    "angle. Only batched generation of prompts of different lengths shows it: cached decoding of the padded "
    "rows disagrees with a full forward, the longest prompt's row does not.",
    fix="Continue from each row's own last position: torch.arange(num_new_tokens) + position_ids[..., -1:] + 1.",
    references=(
        "huggingface/transformers#7552: Add batch inferencing support for GPT2LMHeadModel (position ids of "
        "left-padded generation derived from the attention mask; fixes #3021)",
        "huggingface/transformers#21853: [GPT2] Propose fix for #21080 (position ids of padded batched "
        "generation)",
    ),
    manifest=_generate_gap("cached_logit_gap", faulty_min=0.002),
)
def update_model_kwargs_positions_from_length(self, outputs, model_kwargs, is_encoder_decoder=False,
                                              num_new_tokens=1):
    """The new positions are the padded sequence length: ahead by the pad count on left-padded rows."""
    # update past_key_values keeping its naming used in model code
    for possible_cache_name in ALL_CACHE_NAMES:
        if possible_cache_name in outputs:
            if possible_cache_name in ("past_buckets_states", "mems"):
                cache_name = "past_key_values"
            else:
                cache_name = possible_cache_name
            model_kwargs[cache_name] = getattr(outputs, possible_cache_name)
            break

    # update token_type_ids with last value
    if (token_type_ids := model_kwargs.get("token_type_ids")) is not None:
        model_kwargs["token_type_ids"] = torch.cat([token_type_ids, token_type_ids[:, -num_new_tokens:]], dim=-1)

    # update mm_token_type_ids with zeros (only-text)
    if (mm_token_type_ids := model_kwargs.get("mm_token_type_ids")) is not None:
        model_kwargs["mm_token_type_ids"] = torch.cat(
            [mm_token_type_ids, mm_token_type_ids.new_zeros((mm_token_type_ids.shape[0], num_new_tokens))], dim=-1
        )

    # Position ids (2D or 3D sometimes)
    position_ids_key = "position_ids" if not is_encoder_decoder else "decoder_position_ids"
    if (position_ids := model_kwargs.get(position_ids_key)) is not None:
        # We want to expand to the same number of dims which is not always the same
        required_dim = [1] * (position_ids.dim() - 1) + [-1]
        past_length = position_ids.shape[-1]
        next_position_ids = (
            torch.arange(past_length, past_length + num_new_tokens, dtype=position_ids.dtype, device=position_ids.device)
            .view(*required_dim)
            .expand(*position_ids.shape[:-1], -1)
        )
        next_position_ids = torch.cat([position_ids, next_position_ids], dim=-1)
        model_kwargs[position_ids_key] = next_position_ids

    # 2D attention mask (always 2D here)
    attention_mask_key = "attention_mask" if not is_encoder_decoder else "decoder_attention_mask"
    if (attention_mask := model_kwargs.get(attention_mask_key)) is not None:
        model_kwargs[attention_mask_key] = torch.cat(
            [attention_mask, attention_mask.new_ones((attention_mask.shape[0], num_new_tokens))], dim=-1
        )

    return model_kwargs


@fault(
    "hf_rotate_half_interleaved",
    target="hf",
    seam=f"{_LLAMA}.rotate_half",
    title="rotate_half pairs interleaved dims (GPT-J layout) while cos/sin are laid out in halves (GPT-NeoX)",
    subsystem="position",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="Llama's RoPE splits head_dim in two halves and rotates dim i with dim i + d/2; its cos/sin "
    "tables are cat(freqs, freqs) to match. This rotate_half pairs neighbours (2i, 2i+1) instead, the GPT-J "
    "convention, so each pair is turned by two different frequencies: no longer a rotation. q.k then depends on "
    "absolute positions, not only on their difference: the same sequence numbered from another offset gives "
    "other logits, and what the model learns at one position does not transfer to another.",
    fix="Keep the layout of the cos/sin tables: x1, x2 = the two halves; return cat((-x2, x1), dim=-1).",
    references=(
        "huggingface/transformers#25199: [LLaMA] Rotary positional embedding differs with official implementation "
        "(HF rotates halves, GPT-NeoX style; Meta's code rotates interleaved pairs, GPT-J style)",
        "Dao-AILab/flash-attention#288: llama rotary pos embedding (interleaved or not must match how the "
        "weights were laid out)",
    ),
    manifest=_generate_gap("rope_shift_gap", faulty_min=0.002),
)
def rotate_half_interleaved(x):
    """Rotates neighbouring pairs, against tables laid out in halves."""
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


@fault(
    "hf_rope_q_only",
    target="hf",
    seam=f"{_LLAMA}.apply_rotary_pos_emb",
    title="RoPE applied to the queries only: attention scores depend on absolute positions",
    subsystem="position",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="apply_rotary_pos_emb rotates q but returns k unrotated. q_m.k_n then carries the query's "
    "absolute angle instead of the relative angle m - n: the model still trains (it can learn absolute "
    "position from the query rotation), but its logits change when the same tokens are numbered from another "
    "offset, which a relative encoding never does, and keys cached at one position mean something else to a "
    "query at another.",
    fix="Rotate both: k_embed = (k * cos) + (rotate_half(k) * sin).",
    references=(
        "Su et al., 'RoFormer: Enhanced Transformer with Rotary Position Embedding' (arXiv:2104.09864), eq. 14-16: "
        "both q and k are rotated, so q_m.k_n depends on m - n only",
        "huggingface/transformers modeling_llama.apply_rotary_pos_emb: 'Applies Rotary Position Embedding to the "
        "query and key tensors'",
    ),
    manifest=_generate_gap("rope_shift_gap", faulty_min=0.002),
)
def apply_rotary_pos_emb_q_only(q, k, cos, sin, unsqueeze_dim=1):
    """Only the queries are rotated."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = k
    return q_embed, k_embed
