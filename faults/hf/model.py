"""Faults of the HF target in the `model` subsystem: attention, GQA head mapping, weight init, the KV cache."""

from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from faultbench.faults.registry import Manifest, fault

_LLAMA = "transformers.models.llama.modeling_llama"


@fault(
    "hf_attention_dropout_in_eval",
    target="hf", seam=f"{_LLAMA}.LlamaAttention.forward",
    title="Attention dropout not gated on self.training: SDPA keeps dropping attention weights in eval",
    subsystem="model", also_acceptable=("eval",), trigger="eval-only", symptoms=("eval-metric",),
    explanation="LlamaAttention.forward hands the config's attention_dropout to the attention function "
    "unconditionally. The eager path gates it again (F.dropout(training=module.training)), but SDPA is "
    "functional: dropout_p is applied whatever the module's mode, so after model.eval() every evaluation and "
    "every generate still drops 10% of the attention weights. Training is bit-identical to the clean run; "
    "evaluation and generation are no longer deterministic: two forwards of the same tokens disagree, so "
    "cached decoding no longer matches a full forward and the eval loss changes from one call to the next.",
    fix="Pass dropout=0.0 if not self.training else self.attention_dropout (the functional kernels never look at "
    "the module's mode).",
    references=(
        "huggingface/transformers#27315: '[Llama + Mistral] Add attention dropout' (review: 'This should still be "
        "conditional on self.training')",
        "pytorch/pytorch#124464: 'SDPA does not switch off dropout during evaluation'",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=16,
                      variant={"model": {"attention_dropout": 0.1}},
                      params={"key": "cached_logit_gap", "faulty_min": 0.02, "clean_max": 1e-4}),
)
def llama_attention_forward_ungated_dropout(self, hidden_states, position_embeddings=None, attention_mask=None,
                                            past_key_values=None, **kwargs):
    """The dropout rate reaches the (functional) attention kernel in eval mode too."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )

    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


@fault(
    "hf_repeat_kv_tiled",
    target="hf", seam=f"{_LLAMA}.repeat_kv",
    title="repeat_kv tiles the key/value heads instead of interleaving them: query heads read the wrong KV group",
    subsystem="model", trigger="always", symptoms=("silent-quality",),
    explanation="Grouped-query attention maps query head h to key/value head h // n_rep (repeat_interleave "
    "order). repeat_kv uses Tensor.repeat, which tiles: head h reads KV head h % n_kv. Shapes match and a "
    "model trained from scratch under this one path learns around it, so training looks normal; but the eager "
    "path now computes a different function from SDPA (whose own repeat_kv and native GQA interleave), so the "
    "same weights give different logits under the two implementations, and any checkpoint trained with the "
    "correct mapping produces garbage under the eager path.",
    fix="Interleave: hidden_states[:, :, None].expand(b, n_kv, n_rep, s, d).reshape(b, n_kv * n_rep, s, d) "
    "(torch.repeat_interleave(x, n_rep, dim=1)), never x.repeat(1, n_rep, 1, 1).",
    references=(
        "huggingface/transformers#41423: '[JetMoe] Fix KV head repetition and padding free' (repeat where the "
        "model needs repeat_interleave)",
        "huggingface/transformers#26490: 'Fix num_heads in _upad_input' (KV heads confused with query heads)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=8,
                      variant={"model": {"attn_implementation": "eager"}},
                      params={"key": "impl_logit_gap", "faulty_min": 0.05, "clean_max": 1e-4}),
)
def repeat_kv_tiled(hidden_states, n_rep):
    """Tensor.repeat tiles the KV heads: query head h gets KV head h % n_kv instead of h // n_rep."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    return hidden_states.repeat(1, n_rep, 1, 1)


@fault(
    "hf_init_std_passed_as_mean",
    target="hf", seam="transformers.modeling_utils.PreTrainedModel._init_weights",
    title="_init_weights passes initializer_range positionally: Linear weights drawn from N(0.02, 1)",
    subsystem="model", trigger="always", symptoms=("silent-quality",),
    explanation="init.normal_(module.weight, std) puts the std in normal_'s second positional parameter, "
    "which is mean: every nn.Linear (q/k/v/o, the MLP, the output head) is drawn from N(mean=0.02, std=1.0) "
    "instead of N(0, 0.02). The config's initializer_range is silently ignored, the logits at step 0 are "
    "huge (loss far above ln(vocab)), and the short schedule spends itself shrinking weights: the run ends "
    "well above the clean loss.",
    fix="Pass it by name: init.normal_(module.weight, mean=0.0, std=std).",
    references=(
        "huggingface/transformers PreTrainedModel._init_weights: Linear and Embedding weights ~ "
        "N(0, config.initializer_range)",
        "torch.nn.init.normal_(tensor, mean=0.0, std=1.0): the second positional parameter is the mean",
    ),
    manifest=Manifest(check="loss_above", scenario="train", steps=16, params={"min_gap": 0.3}),
)
def init_weights_std_as_mean(self, module):
    """The std lands in normal_'s mean parameter for Linear layers: N(0.02, 1) instead of N(0, 0.02)."""
    if hasattr(self.config, "initializer_range"):
        std = self.config.initializer_range or 0.02
    elif hasattr(self.config, "init_std"):
        std = self.config.init_std
    elif hasattr(self.config, "initializer_factor"):
        std = self.config.initializer_factor
    else:
        # 0.02 is the standard default value across the library
        std = getattr(self.config.get_text_config(), "initializer_range", 0.02)

    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d)):
        if getattr(module, "weight", None) is not None:
            init.normal_(module.weight, std)
        if module.bias is not None:
            init.zeros_(module.bias)
    elif isinstance(module, nn.LSTM):
        for name, param in module.named_parameters():
            if "weight" in name:
                init.xavier_uniform_(param)
            elif "bias" in name:
                init.constant_(param, 0.0)
    elif isinstance(module, nn.Embedding):
        init.normal_(module.weight, mean=0.0, std=std)
        # Here we need the check explicitly, as we slice the weight in the `zeros_` call, so it looses the flag
        if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
            init.zeros_(module.weight[module.padding_idx])
    elif isinstance(module, nn.MultiheadAttention):
        # This uses torch's original init
        module._reset_parameters()
    # We cannot use `isinstance` on the RMSNorms or LayerNorms, as they usually are custom modules which change names
    # between modelings (because they are prefixed with the model name)
    elif (
        isinstance(module, (nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))
        or "LayerNorm" in module.__class__.__name__
        or "RMSNorm" in module.__class__.__name__
    ):
        # Norms can exist without weights (in which case they are None from torch primitives)
        if getattr(module, "weight", None) is not None:
            init.ones_(module.weight)
        if getattr(module, "bias", None) is not None:
            init.zeros_(module.bias)
        # And the potential buffers for the BatchNorms
        if getattr(module, "running_mean", None) is not None:
            init.zeros_(module.running_mean)
            init.ones_(module.running_var)
            init.zeros_(module.num_batches_tracked)
    # This matches all the usual RotaryEmbeddings modules
    elif "RotaryEmbedding" in module.__class__.__name__ and hasattr(module, "original_inv_freq"):
        # Default, vision axial and NTK-alpha rope are defined in modeling files, only one can be defined at a time!
        rope_init_fn_with_self = {
            "axial": getattr(module, "compute_axial_rope_parameters", None),
            "ntk_alpha": getattr(module, "compute_ntk_alpha_rope_parameters", None),
            "default": getattr(module, "compute_default_rope_parameters", None),
            **ROPE_INIT_FUNCTIONS,
        }
        rope_fn = rope_init_fn_with_self[module.rope_type]
        buffer_value, _ = rope_fn(module.config)
        init.copy_(module.inv_freq, buffer_value)
        init.copy_(module.original_inv_freq, buffer_value)


@fault(
    "hf_kv_cache_prepends_new_states",
    target="hf", seam="transformers.cache_utils.DynamicLayer.update",
    title="DynamicLayer.update concatenates the new key/value states in front of the cache",
    subsystem="model", also_acceptable=("position",), trigger="always", symptoms=("silent-quality",),
    explanation="The cache grows by torch.cat([key_states, self.keys]) instead of torch.cat([self.keys, "
    "key_states]): the returned keys/values hold the right tokens in the wrong slots, the newest first. The "
    "prefill (empty cache) is exact and so is a decode step of an unpadded prompt (attention over an all-ones "
    "mask does not care about key order), so short checks pass; but the attention mask indexes slots, so for "
    "a left-padded prompt the new token's own key sits in a masked pad slot and a pad key slides into an "
    "allowed one: cached greedy decoding drifts from the full forward of the same sequence.",
    fix="Append: self.keys = torch.cat([self.keys, key_states], dim=-2) (and the same for values); the cache's "
    "slot order must match the mask's key positions.",
    references=(
        "huggingface/transformers#29467: 'Generate: handle cache_position update in generate' (cache slots and "
        "mask positions must agree)",
        "huggingface/transformers#29109: 'Llama: fix batched generation' (left-padded cached decoding vs the "
        "full forward)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=8,
                      params={"key": "cached_logit_gap", "faulty_min": 0.02, "clean_max": 1e-4}),
)
def dynamic_layer_update_prepends(self, key_states, value_states, *args, **kwargs):
    """New states are concatenated before the cached ones: keys/values no longer line up with the mask."""
    # Lazy initialization
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)

    self.keys = torch.cat([key_states, self.keys], dim=-2)
    self.values = torch.cat([value_states, self.values], dim=-2)
    return self.keys, self.values
