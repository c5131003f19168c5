"""Faults in the `mask` subsystem: causal and padding masks."""

import torch
import torch.nn.functional as F

from faultbench.faults.registry import Manifest, also_replaces, fault


@fault(
    "fp16_mask_constant",
    seam="model.attention.build_attention_mask",
    title="Additive mask built with float32's min and cast to fp16: -inf, NaN on fully masked rows",
    subsystem="mask",
    also_acceptable=("precision", "model"),  # model: it also replaces model.attention.attend
    trigger="amp-only",
    symptoms=("nan",),
    explanation="The mask is filled with torch.finfo(torch.float32).min and cast to the compute dtype. In "
    "fp16 that constant overflows to -inf. A left-padded row's pad queries have no key they may attend "
    "to, so their softmax is over -inf only: NaN, which the next layer's attention spreads to every "
    "token (0 * NaN = NaN). fp32 and bf16 runs, and right-padded batches, are fine.",
    fix="Use the compute dtype's own finfo(dtype).min and never leave a row fully masked (let each query "
    "see itself), or use a boolean mask.",
    references=(
        "huggingface/transformers PR 'Fix -1e4 as attn mask' (#17306): finfo(fp16).min plus a score below -16 "
        "overflows to -inf, and a [pad, token] row fully masked by causal + padding softmaxes to NaN",
        "HF modeling_attn_mask_utils: _unmask_unattended exists because fully masked rows NaN in SDPA math",
    ),
    manifest=Manifest(check="nan", steps=5, params={"by_step": 1},
                      variant={"data": {"pad_side": "left"}, "train": {"precision": "fp16"}}),
)
def build_attention_mask_fp32_min(attention_mask: torch.Tensor, query_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Masked entries hold float32's min, cast to ``dtype``; no row is guaranteed an allowed key."""
    batch, key_len = attention_mask.shape
    if query_len == key_len and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        return None
    device = attention_mask.device
    query_pos = torch.arange(key_len - query_len, key_len, device=device)[:, None]  # (T_q, 1)
    key_pos = torch.arange(key_len, device=device)[None, :]  # (1, T_k)
    allowed = (key_pos <= query_pos) & attention_mask.bool()[:, None, :]  # (B, T_q, T_k)
    mask = torch.zeros(batch, 1, query_len, key_len, device=device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min).to(dtype)


@also_replaces("fp16_mask_constant", "model.attention.attend")
def attend_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """Eager attention (scores + mask, softmax, weighted sum): PyTorch's CPU flash kernel would zero a
    fully masked row instead of producing NaN, the math path (and CUDA's) does not."""
    scale = q.size(-1) ** -0.5
    scores = q @ k.transpose(-2, -1) * scale  # (B, nh, T_q, T_k)
    if attn_mask is None:
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    else:
        scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    probs = F.dropout(probs, dropout_p)
    return probs @ v


@fault(
    "no_causal_mask",
    seam="model.attention.attend",
    title="SDPA called with is_causal=False: without a padding mask, attention is bidirectional",
    subsystem="mask",
    also_acceptable=("model",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="attend passes is_causal=False on the assumption that attn_mask always carries the causal "
    "part. But build_attention_mask returns None for unpadded and right-padded batches (the fast path), so "
    "those batches get no mask at all: every token attends to the tokens after it, including the one it "
    "must predict. Training and validation loss fall far below the corpus's loss floor; generation, which "
    "never has the future, produces garbage.",
    fix="Pass is_causal=attn_mask is None (causal attention whenever no explicit combined mask is given).",
    references=(
        "PyTorch docs, torch.nn.functional.scaled_dot_product_attention: is_causal=True applies a "
        "lower-triangular mask and may not be combined with attn_mask, so a caller passing its own mask sets "
        "is_causal=False and must put causality into that mask",
        "Karpathy, 'A Recipe for Training Neural Networks': a loss that looks too good is a bug until proven "
        "otherwise (check for information leaks)",
    ),
    manifest=Manifest(check="loss_below", steps=100, params={"min_gap": 0.7, "metric": "val"}),
)
def attend_not_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """is_causal=False even when no mask is given: the right-padded fast path attends to the future."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=False
    )


@fault(
    "causal_mask_transposed",
    seam="model.attention.build_attention_mask",
    title="Causal mask built transposed: each token sees the tokens after it instead of before it",
    subsystem="mask",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The broadcast axes of query and key positions are swapped, so allowed[q, k] is k >= q "
    "instead of k <= q: with the explicit mask (left padding, or any KV cache) every token attends to "
    "itself and the future. Training and validation loss drop far below the loss floor, while cached "
    "decode (one query against the cache) fails with a shape error.",
    fix="query positions index rows (arange(...)[:, None]) and key positions columns ([None, :]), so that "
    "allowed = key_pos <= query_pos.",
    references=(
        "The Annotated Transformer (Harvard NLP), subsequent_mask: triu(diagonal=1) == 0 builds the "
        "lower-triangular mask; the triu/tril orientation is a classic source of future leaks",
        "Karpathy, 'A Recipe for Training Neural Networks': a loss that looks too good signals a leak",
    ),
    manifest=Manifest(check="loss_below", steps=80, params={"min_gap": 0.8, "metric": "val"},
                      variant={"data": {"pad_side": "left"}}),
)
def build_attention_mask_transposed(attention_mask: torch.Tensor, query_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Query and key position axes swapped: allowed means key >= query."""
    batch, key_len = attention_mask.shape
    if query_len == key_len and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        return None
    device = attention_mask.device
    query_pos = torch.arange(key_len - query_len, key_len, device=device)[None, :]  # (T_q, 1)
    key_pos = torch.arange(key_len, device=device)[:, None]  # (1, T_k)
    allowed = (key_pos <= query_pos) & attention_mask.bool()[:, None, :]  # (B, T_q, T_k)
    allowed |= key_pos == query_pos
    mask = torch.zeros(batch, 1, query_len, key_len, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


@fault(
    "padding_mask_broadcast_over_query",
    seam="model.attention.build_attention_mask",
    title="Padding mask broadcast over the query axis: real tokens attend to left pads",
    subsystem="mask",
    also_acceptable=("collate",),
    trigger="always",
    symptoms=("silent-quality", "crash-shape"),
    explanation="The (B, T) padding mask is expanded as (B, T, 1) instead of (B, 1, T), so it masks pad "
    "*queries* (whose outputs are never used) instead of pad *keys*. With left padding every real token "
    "attends to the pads before it, silently: its output depends on how much padding its batch needed. "
    "In cached decode (one query against T_k keys) the (B, T_k, 1) mask no longer broadcasts to the "
    "(B, 1, 1, T_k) additive mask and build_attention_mask fails with a shape error.",
    fix="Broadcast the padding mask along the key axis: attention_mask[:, None, :] for a (B, T_q, T_k) mask.",
    references=(
        "HF transformers AttentionMaskConverter._expand_mask: a [bsz, src_len] mask becomes "
        "[bsz, 1, tgt_len, src_len] (mask[:, None, None, :]), i.e. it masks keys",
        "HF transformers generate() warning 'A decoder-only architecture is being used, but right-padding "
        "was detected!': left-padded batches depend on a correct padding mask",
    ),
    manifest=Manifest(check="crash", scenario="generate", steps=30, variant={"data": {"pad_side": "left"}},
                      params={"types": ("RuntimeError",), "seam": "model.attention.build_attention_mask"}),
)
def build_attention_mask_query_axis(attention_mask: torch.Tensor, query_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The padding mask is broadcast along the query axis, so pad keys stay visible."""
    batch, key_len = attention_mask.shape
    if query_len == key_len and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        return None
    device = attention_mask.device
    query_pos = torch.arange(key_len - query_len, key_len, device=device)[:, None]  # (T_q, 1)
    key_pos = torch.arange(key_len, device=device)[None, :]  # (1, T_k)
    allowed = (key_pos <= query_pos) & attention_mask.bool()[:, :, None]  # (B, T_q, T_k)
    allowed |= key_pos == query_pos
    mask = torch.zeros(batch, 1, query_len, key_len, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


@fault(
    "padding_mask_dropped",
    seam="model.attention.build_attention_mask",
    title="Attention mask is causal only: the padding mask is never applied",
    subsystem="mask",
    also_acceptable=("collate",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The combined mask keeps the causal part but drops the padding part, so with left padding "
    "every real token attends to the pad tokens before it. Nothing crashes and the loss barely moves (the "
    "model learns to live with the pads), but a document's logits depend on how much padding its batch "
    "needed: a prompt scored alone and in a left-padded batch gives different logits, and batched "
    "generation differs from generating each prompt alone.",
    fix="AND the causal mask with the key padding mask: allowed = causal & attention_mask[:, None, :].",
    references=(
        "HF transformers generate() warning 'The attention mask and the pad token id were not set': "
        "outputs of padded batches are unreliable without the attention mask",
        "HF transformers AttentionMaskConverter: the 4D causal mask is combined with the 2D padding mask",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30, variant={"data": {"pad_side": "left"}},
                      params={"key": "pad_logit_gap", "faulty_min": 0.05, "clean_max": 1e-4}),
)
def build_attention_mask_causal_only(attention_mask: torch.Tensor, query_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Only the causal part: pad keys are never masked."""
    batch, key_len = attention_mask.shape
    if query_len == key_len and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        return None
    device = attention_mask.device
    query_pos = torch.arange(key_len - query_len, key_len, device=device)[:, None]  # (T_q, 1)
    key_pos = torch.arange(key_len, device=device)[None, :]  # (1, T_k)
    allowed = (key_pos <= query_pos)[None]  # (1, T_q, T_k)
    allowed |= key_pos == query_pos
    mask = torch.zeros(batch, 1, query_len, key_len, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


@fault(
    "mask_keep_convention_in_attention",
    seam="model.attention.attend",
    title="Hand-written attention reads the additive mask as a 1-keep/0-drop mask: NaN, then a crash",
    subsystem="mask",
    also_acceptable=("model",),
    trigger="rare-batch",
    symptoms=("nan", "crash-dtype"),
    explanation="One root cause, two symptoms. attend was rewritten by hand as "
    "scores.masked_fill(attn_mask == 0, -inf), the convention of a 2-D attention_mask (1 keep, 0 drop), "
    "but the model passes the ADDITIVE mask (0 where a query may attend). Every allowed entry is dropped "
    "and every forbidden one kept: a query whose keys are all allowed (the last token of an unpadded row "
    "in a left-padded batch) softmaxes over -inf only, so the loss is NaN on padded batches and the "
    "weights turn NaN. On the rare batch that needs no mask at all (every row the same length) the model "
    "passes None, and `None == 0` is a Python bool: masked_fill raises a TypeError mid-run.",
    fix="Add the additive mask to the scores (scores + attn_mask) and handle None as plain causal "
    "attention, or keep calling F.scaled_dot_product_attention, which takes the additive mask as is.",
    references=(
        "HF transformers docs, 'attention_mask': 1 for tokens to attend, 0 for padding, while the 4-D "
        "extended mask the layers add is 0 / large-negative; mixing the two conventions inverts the mask",
        "PyTorch docs, F.scaled_dot_product_attention: a boolean attn_mask means True = take part, a float "
        "mask is added to the scores; nn.MultiheadAttention's key_padding_mask means True = ignore",
    ),
    manifest=Manifest(check="nan_then_crash", steps=40, seeds=(2,), params={"types": ("TypeError",), "min_step": 5},
                      variant={"data": {"pad_side": "left"}, "train": {"batch_size": 12, "accum": 4}}),
)
def attend_keep_mask(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """Treats the additive mask as keep(1)/drop(0): allowed entries are dropped, None crashes."""
    scores = q @ k.transpose(-2, -1) / q.size(-1) ** 0.5  # (B, nh, T_q, T_k)
    scores = scores.masked_fill(attn_mask == 0, float("-inf"))
    probs = F.dropout(torch.softmax(scores, dim=-1), dropout_p)
    return probs @ v
