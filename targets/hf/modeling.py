"""The HF target's model: a tiny ``LlamaForCausalLM`` built from a ``LlamaConfig``, never downloaded.

RMSNorm, RoPE, grouped-query attention (4 query heads share 2 key/value heads, so ``repeat_kv`` runs),
SwiGLU MLP, untied output head. ~96k parameters with the tiny corpus's 173-token vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4  # head_dim = 16
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64  # >= seq_len
    attention_dropout: float = 0.0
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        if self.attn_implementation not in ATTENTION:
            raise ValueError(f"attn_implementation must be one of {ATTENTION}, got {self.attn_implementation!r}")


def llama_config(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The ``LlamaConfig`` of ``spec`` with the tokenizer's vocabulary size and special ids."""
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        attention_dropout=spec.attention_dropout, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
        attn_implementation=spec.attn_implementation,
    )


def build_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """A freshly initialized model, identical for the same ``seed`` (and on every rank)."""
    config = llama_config(spec, tokenizer)
    with torch.random.fork_rng(devices=[]):  # seeded init without moving the caller's RNG
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)
