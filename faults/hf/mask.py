"""HF faults in the `mask` subsystem: transformers' ``masking_utils`` (causal, padding and additive masks)."""

from collections.abc import Callable

import torch
from transformers.masking_utils import causal_mask_function, fast_all, is_torchdynamo_exporting, is_tracing, sdpa_mask

from faultbench.faults.registry import Manifest, fault

_MASKS = "transformers.masking_utils"
_LEFT_PAD_GENERATE = dict(scenario="generate", steps=16, check="extra_at_least")


@fault(
    "hf_fp16_mask_constant",
    target="hf",
    seam=f"{_MASKS}.eager_mask",
    title="Additive mask built with float32's min in the autocast dtype: -inf under bf16, NaN on left-padded rows",
    subsystem="mask",
    also_acceptable=("precision",),
    trigger="amp-only",
    symptoms=("nan",),
    explanation="eager_mask turns the boolean mask into an additive one, but builds it in the dtype attention "
    "runs in under autocast (to save memory) while keeping float32's min as the masking constant. In bf16 that "
    "constant is not representable: -3.4028e38 rounds to -inf. A left-padded row's pad queries have no key "
    "they may attend to, so their softmax is over -inf only: NaN, which the next layer spreads to every token "
    "of the row (a NaN key times any query is NaN). fp32 runs, and right-padded batches (no fully masked "
    "row), are unaffected; the default sdpa path builds no additive mask.",
    fix="Build the additive mask in the dtype it is added in and fill it with that dtype's own "
    "torch.finfo(dtype).min (never -inf, never another dtype's min).",
    references=(
        "huggingface/transformers#17306: Fix -1e4 as attn mask (a masking constant that is not the compute "
        "dtype's own min overflows in half precision)",
        "huggingface/transformers#27114: [AttentionMaskConverter] Fix-mask-inf (masks that reach -inf in "
        "reduced precision give NaN rows for left-padded batches)",
    ),
    manifest=Manifest(check="nan", steps=4, params={"by_step": 1},
                      variant={"recipe": "eager", "precision": "bf16", "padding_side": "left"}),
)
def eager_mask_fp32_min_in_autocast_dtype(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
) -> torch.Tensor:
    """The additive mask is built in the autocast dtype but filled with float32's min: -inf in bf16."""
    # The masks for eager attention are simply boolean mask from sdpa, casted to 0 and -inf
    _ = kwargs.pop("allow_is_causal_skip", None)
    mask = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=allow_is_bidirectional_skip,
        use_vmap=use_vmap,
        device=device,
        **kwargs,
    )
    # only bidirectional masks can be skipped, otherwise we convert bool -> float
    if mask is not None:
        # build the mask in the dtype the attention scores have under autocast: half the memory
        if torch.is_autocast_enabled(mask.device.type):
            dtype = torch.get_autocast_dtype(mask.device.type)
        min_dtype = torch.finfo(torch.float32).min
        # we need 0s where the tokens should be taken into account, and -inf otherwise (mask is already of boolean type)
        mask = torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), min_dtype)
    return mask


@fault(
    "hf_sdpa_mask_dropped_with_padding",
    target="hf",
    seam=f"{_MASKS}._ignore_causal_mask_sdpa",
    title="SDPA's causal-mask skip ignores padding: left-padded batches attend to their pads",
    subsystem="mask",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="To reach SDPA's fast kernels transformers drops the mask and passes is_causal=True when the "
    "mask would be purely causal (q_length == kv_length, or one query). The skip must not fire when the 2D "
    "mask holds padding; here it does, so every padded batch runs with is_causal only. Right-padded training "
    "hides it (a real token never looks at the pads after it), but with left padding every real token "
    "attends to the pads before it and, in cached decoding (one query), to every pad in the cache: a prompt "
    "in a left-padded batch gets other logits than alone.",
    fix="Skip the mask only when no token is padded: (q_length == 1 or kv_length == q_length) and "
    "(padding_mask is None or padding_mask.all()).",
    references=(
        "huggingface/transformers#30311: Do not drop mask with SDPA for more cases",
        "huggingface/transformers#29663: Llama: always convert the causal mask in the SDPA code path",
    ),
    manifest=Manifest(**_LEFT_PAD_GENERATE, params={"key": "pad_logit_gap", "faulty_min": 0.05, "clean_max": 1e-4}),
)
def ignore_causal_mask_sdpa_despite_padding(
    padding_mask: torch.Tensor | None,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    local_attention_size: int | None = None,
) -> bool:
    """The skip is decided from the shapes alone: a padded batch loses its mask."""
    if padding_mask is not None and padding_mask.shape[-1] > kv_length:
        mask_indices = torch.arange(kv_length, device=padding_mask.device) + kv_offset
        padding_mask = padding_mask[:, mask_indices]

    # When using `torch.export` or `torch.onnx.dynamo_export`, we must pass an example input, and `is_causal` behavior is
    # hard-coded to the forward. If a user exports a model with query_length > 1, the exported model will hard-code `is_causal=True`
    # which is in general wrong (see https://github.com/pytorch/pytorch/issues/108108). Thus, we only set
    # `ignore_causal_mask = True` if we are not tracing
    # NOTE: under `torch.compile` we can still skip, but only if we do not have to read the values of the
    # `padding_mask`. This requires torch>=2.14: before pytorch#176499, dynamo replaced
    # `torch.compiler.is_exporting()` by a constant `True`, so older versions keep the previous behavior of
    # never skipping while compiling.  # noqa: NC001, NC002
    if is_torchdynamo_exporting() or (padding_mask is not None and is_tracing(padding_mask)):
        return False
    # Static caches use a tensor `q_offset` to avoid graph breaks, but reading it would cause one
    if isinstance(q_offset, torch.Tensor) and is_tracing(q_offset):
        return False
    # In this case, we need to add special patterns to the mask no matter what, so we cannot use any of the later skip conditions
    if local_attention_size is not None and kv_length >= local_attention_size:
        return False

    # If `q_length == 1`, we then use `is_causal=False` in sdpa integration to mimic lower-right alignment. If `kv_length == q_length`,
    # we use `is_causal=True` as upper-left alignment (torch's default) is the same as lower-right in this case.
    if q_length == 1 or kv_length == q_length:
        return True
    # Additional case to optimize prefill: if the cache is empty (`q_offset == 0`), we can use `is_causal=True` even
    # with a padding_mask, if the padding_mask only contains padding related to "future k/v tokens" of the static k/v states
    # returned by StaticCaches. This works thanks to the upper-left alignment of sdpa's `is_causal` mask
    if q_offset == 0 and (
        padding_mask is None or (fast_all(padding_mask[:, :q_length]) and fast_all(~padding_mask[:, q_length:]))
    ):
        return True

    return False


@fault(
    "hf_causal_mask_off_by_one",
    target="hf",
    seam=f"{_MASKS}.causal_mask_function",
    title="Causal mask function translated from triu(diagonal=1): each token also sees the next one",
    subsystem="mask",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="causal_mask_function is the index predicate every materialized mask is built from. Written "
    "kv_idx <= q_idx + 1 (the diagonal=1 of the triu that marks the MASKED cells, carried into the predicate "
    "of the ALLOWED ones), every token attends to the token it must predict. Padded batches (the mask is "
    "materialized whenever a batch holds padding) leak the next token, so the loss falls faster than a causal "
    "model's; cached decoding (one query, no future in the cache) cannot leak, so generate's logits disagree "
    "with a full forward of the same sequence. A batch without padding takes SDPA's is_causal path and is "
    "unaffected.",
    fix="return kv_idx <= q_idx (a token sees itself and its past, nothing after it).",
    references=(
        "huggingface/transformers masking_utils.causal_mask_function docstring: 'a basic lower-diagonal causal "
        "mask' (kv_idx <= q_idx, as torch.tril and SDPA's is_causal)",
        "PyTorch docs, torch.triu: diagonal=1 excludes the main diagonal (the masked cells of a causal mask are "
        "triu(ones, diagonal=1); the allowed cells are tril(ones, diagonal=0))",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=16,
                      params={"key": "cached_logit_gap", "faulty_min": 0.05, "clean_max": 1e-4}),
)
def causal_mask_function_next_token(batch_idx: int, head_idx: int, q_idx: int, kv_idx: int) -> bool:
    """One diagonal too many: each query may attend to the key right after it."""
    return kv_idx <= q_idx + 1


@fault(
    "hf_padding_mask_wrong_axis",
    target="hf",
    seam=f"{_MASKS}.padding_mask_function",
    title="Padding mask indexed by the query position: pad queries are masked, pad keys stay visible",
    subsystem="mask",
    also_acceptable=("collate",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="padding_mask_function must say whether the KEY at kv_idx is a real token; indexing the 2D "
    "mask with q_idx masks pad *queries* (whose outputs are never used) instead. With right padding nothing "
    "changes for real tokens (the pads lie after them), but with left padding every real token attends to the "
    "pads before it, so a prompt's logits depend on how much padding its batch needed.",
    fix="return padding_mask[batch_idx, kv_idx].",
    references=(
        "huggingface/transformers masking_utils.padding_mask_function: 'the mask should ALWAYS be at least of "
        "the max kv_index size' (it indexes keys)",
        "huggingface/transformers AttentionMaskConverter._expand_mask: a [bsz, src_len] mask is expanded to "
        "[bsz, 1, tgt_len, src_len], masking keys",
    ),
    manifest=Manifest(**_LEFT_PAD_GENERATE, params={"key": "pad_logit_gap", "faulty_min": 0.05, "clean_max": 1e-4}),
)
def padding_mask_function_by_query(padding_mask: torch.Tensor) -> Callable:
    """The inner predicate reads the padding mask at the query index."""

    def inner_mask(batch_idx: int, head_idx: int, q_idx: int, kv_idx: int) -> bool:
        # Note that here the mask should ALWAYS be at least of the max `kv_index` size in the dimension 1. This is because
        # we cannot pad it here in the mask_function as we don't know the final size, and we cannot try/except, as it is not
        # vectorizable on accelerator devices
        return padding_mask[batch_idx, q_idx]

    return inner_mask


@fault(
    "hf_and_masks_union",
    target="hf",
    seam=f"{_MASKS}.and_masks",
    title="and_masks combines with | (union): causal OR not-pad lets every token see the whole document",
    subsystem="mask",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="and_masks (copied from its twin or_masks) starts from False and ORs the mask functions. "
    "create_causal_mask combines the causal function with the padding function through and_masks whenever a "
    "batch is padded, so a key is allowed if it is in the past OR a real token: every real token attends to "
    "the whole document, future included. Training and validation loss fall far below what a causal model can "
    "reach; generation (which never has the future) is garbage. A batch without padding takes SDPA's "
    "is_causal path and is unaffected.",
    fix="Start from True and combine with &: result = q_idx.new_ones((), dtype=torch.bool); result = result & ...",
    references=(
        "huggingface/transformers masking_utils.and_masks / or_masks: twin functions differing only in the "
        "initial value and the operator",
        "Karpathy, 'A Recipe for Training Neural Networks': a loss that looks too good signals a leak",
    ),
    manifest=Manifest(check="loss_below", steps=16, variant={"lr": 1e-2}, params={"min_gap": 0.15, "metric": "val"}),
)
def and_masks_as_union(*mask_functions: Callable) -> Callable:
    """The intersection is computed as a union."""
    if not all(callable(arg) for arg in mask_functions):
        raise RuntimeError(f"All inputs should be callable mask_functions: {mask_functions}")

    def and_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = q_idx.new_zeros((), dtype=torch.bool)
        for mask in mask_functions:
            result = result | mask(batch_idx, head_idx, q_idx, kv_idx).to(result.device)
        return result

    return and_mask
