"""Faults in the `model` subsystem: attention math, blocks, init, tying, forward, KV cache."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from faultbench.faults.registry import Manifest, fault
from faultbench.model.attention import build_attention_mask
from faultbench.model.gpt import KVCache, _compute_dtype
from faultbench.model.rope import position_ids_from_mask, rope_at


@fault(
    "softmax_wrong_axis",
    seam="model.attention.attend",
    title="Attention softmax taken over the query axis instead of the key axis",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The hand-written attention normalizes scores with softmax(dim=-2): each key's column "
    "sums to one over the queries instead of each query's row over the keys. Rows no longer form a "
    "weighted average, and a column's normalizer sums over later queries, so a token's output depends "
    "on tokens after it: training loss is distorted (a future leak the model exploits), and cached "
    "decode, which has no later queries, disagrees with the full forward.",
    fix="softmax over the last (key) axis: torch.softmax(scores, dim=-1).",
    references=(
        "Vaswani et al., 'Attention Is All You Need' (2017), Eq. 1: softmax(QK^T / sqrt(d_k)) V, row-wise "
        "over the keys",
        "PyTorch: 'Implicit dimension choice for softmax has been deprecated' warning (softmax axis must be "
        "chosen explicitly)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "cached_logit_gap", "faulty_min": 0.1, "clean_max": 1e-4}),
)
def attend_softmax_queries(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """Softmax over dim=-2 (queries)."""
    scores = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5  # (B, nh, T_q, T_k)
    if attn_mask is None:
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    else:
        scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-2)
    probs = F.dropout(probs, dropout_p)
    return probs @ v


@fault(
    "head_not_tied",
    seam="model.gpt.GPT.init_weights",
    title="init_weights re-creates the weights as new Parameters, silently untying the LM head",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="init_weights assigns a fresh nn.Parameter to every Linear and Embedding instead of "
    "initializing in place. wte.weight and lm_head.weight were one Parameter; now they are two: the "
    "model has vocab_size x n_embd more parameters than configured, the head is weight-decayed as an "
    "ordinary matrix and the embedding no longer learns from the output side. Nothing looks broken (on "
    "the tiny preset the untied model even fits a little faster); the parameter count and the "
    "checkpoint (two distinct tensors) give it away.",
    fix="Initialize in place (nn.init.normal_(module.weight, ...)) or re-tie after init "
    "(self.lm_head.weight = self.wte.weight).",
    references=(
        "Press & Wolf, 'Using the Output Embedding to Improve Language Models' (2017): weight tying",
        "HF transformers PreTrainedModel.tie_weights(): ties must be re-established after weights are "
        "replaced (e.g. resize_token_embeddings)",
    ),
    manifest=Manifest(check="metric_differs", steps=5, params={"metric": "num_params", "min_gap": 1}),
)
def init_weights_new_parameters(self) -> None:
    """Replaces each weight with a new Parameter, breaking the embedding/head tie."""
    std = self.config.init_std
    for module in self.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight = nn.Parameter(torch.empty_like(module.weight).normal_(mean=0.0, std=std))
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    for block in self.blocks:
        for proj in (block.attn.proj, block.mlp.proj):
            nn.init.normal_(proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))


@fault(
    "probs_then_log_softmax",
    seam="model.gpt.GPT.forward",
    title="forward returns softmax probabilities; the loss log-softmaxes them again",
    subsystem="model",
    also_acceptable=("loss",),
    trigger="always",
    symptoms=("stall",),
    explanation="GPT.forward ends with a softmax, but cross_entropy expects raw logits and applies "
    "log_softmax itself. Probabilities in [0, 1] make every log-softmax nearly uniform: the loss starts "
    "at ln(vocab) and barely moves, and gradients are tiny.",
    fix="Return the raw logits from forward; apply softmax only where probabilities are needed (sampling).",
    references=(
        "PyTorch docs, nn.CrossEntropyLoss: 'The input is expected to contain the unnormalized logits for "
        "each class'",
        "Karpathy, 'A Recipe for Training Neural Networks': verify loss @ init, and a loss that does not fall",
    ),
    manifest=Manifest(check="stall", steps=20, params={"max_drop": 0.3, "min_clean_drop": 1.0}),
)
def gpt_forward_probs(self, input_ids, attention_mask=None, position_ids=None, cache: KVCache | None = None):
    """Returns softmax probabilities instead of logits."""
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
    return torch.softmax(self.lm_head(self.ln_f(x)), dim=-1)  # (B, T, vocab)


@fault(
    "residual_norm_order",
    seam="model.gpt.Block.forward",
    title="Residual stream taken after the LayerNorm: the block adds to ln(x), not to x",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The block rebinds x to its normalized value before the residual add, so every block "
    "re-normalizes the residual stream (x = ln(x) + attn(ln(x))). The skip path no longer carries the "
    "stream unchanged, gradients through it are rescaled at every block, and the model trains worse "
    "than the pre-norm reference.",
    fix="Keep the residual un-normalized: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)).",
    references=(
        "Xiong et al., 'On Layer Normalization in the Transformer Architecture' (2020): pre-LN vs post-LN",
        "Radford et al., GPT-2 paper (2019): layer normalization moved to the input of each sub-block",
    ),
    manifest=Manifest(check="loss_above", steps=40, params={"min_gap": 0.2, "metric": "val"}),
)
def block_forward_normed_residual(self, x, rope, attn_mask, cache=None, layer_idx: int = 0):
    """The residual is the normalized stream."""
    x = self.ln_1(x)
    x = x + self.attn(x, rope, attn_mask, cache, layer_idx)
    return x + self.mlp(self.ln_2(x))


@fault(
    "init_std_too_large",
    seam="model.gpt.GPT.init_weights",
    title="init std passed positionally to nn.init.normal_: weights drawn with mean 0.02, std 1",
    subsystem="model",
    also_acceptable=("optimizer",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="nn.init.normal_(tensor, mean=0.0, std=1.0): passing std as the second positional "
    "argument sets the mean to 0.02 and leaves std at 1. The tied embedding/head and the qkv/fc weights "
    "are 50x too large, so the initial logits are huge and the loss at step 0 is far above ln(vocab); "
    "training spends its budget recovering and stays far above a clean run.",
    fix="Pass std by keyword: nn.init.normal_(module.weight, mean=0.0, std=std).",
    references=(
        "PyTorch docs, torch.nn.init.normal_(tensor, mean=0.0, std=1.0): mean is the second parameter",
        "Karpathy, 'A Recipe for Training Neural Networks': verify loss @ init (-ln(1/vocab))",
    ),
    manifest=Manifest(check="loss_above", steps=8, params={"min_gap": 3.0}),
)
def init_weights_positional_std(self) -> None:
    """std passed where mean is expected."""
    std = self.config.init_std
    for module in self.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    for block in self.blocks:
        for proj in (block.attn.proj, block.mlp.proj):
            nn.init.normal_(proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))


@fault(
    "kv_cache_wrong_index",
    seam="model.gpt.KVCache.update",
    title="KV cache writes new keys/values one slot after where they belong",
    subsystem="model",
    also_acceptable=("position",),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="update writes the T new entries at [start + 1, end + 1) but returns [0, end): slot 0 stays "
    "zero and each token's key/value sits one slot later than its mask column, the newest one falling "
    "outside the returned view. Training never uses the cache; cached generation attends to a zero "
    "key and to shifted keys under the wrong mask columns, so its logits differ from an uncached "
    "forward over the same tokens (and its greedy tokens, once the model leans on attention).",
    fix="Write at [start, end) and advance the length to end.",
    references=(
        "HF transformers cache_utils, StaticCache update: new key/value states are written at cache_position "
        "(index_copy_ along the sequence axis); a wrong cache_position silently corrupts generation",
        "HF transformers model tests (tests/models/gpt2, create_and_check_gpt2_model_past): outputs with past key "
        "values must equal the uncached outputs for the same slice",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "cached_logit_gap", "faulty_min": 2e-2, "clean_max": 1e-4}),
)
def kv_update_shifted(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes at start + 1."""
    start = self.lengths[layer]
    end = start + k.shape[2]
    if end > self.max_len:
        raise ValueError(f"KV cache holds {self.max_len} tokens; cannot append {k.shape[2]} after {start}")
    if self.keys[layer] is None:
        B, nh, _, hs = k.shape
        self.keys[layer] = k.new_zeros(B, nh, self.max_len, hs)
        self.values[layer] = v.new_zeros(B, nh, self.max_len, hs)
    self.keys[layer][:, :, start + 1 : end + 1] = k
    self.values[layer][:, :, start + 1 : end + 1] = v
    self.lengths[layer] = end
    return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
