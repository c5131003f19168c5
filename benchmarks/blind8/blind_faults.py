"""Blind set 8: plugin faults on the reference and HF targets, written without looking at any detector.

`make bench-blind BLIND=blind8` scores the suite on these alone. Each is a bug class taken from a real bug
thread or debugging checklist.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from faultbench.faults.registry import Manifest, fault
from faultbench.model.config import TrainConfig
from faultbench.model.data import IGNORE_INDEX

# ----------------------------------------------------------------------------------------------------------------
# reference target
# ----------------------------------------------------------------------------------------------------------------


@fault(
    "b8_cosine_floor_ignored",
    seam="model.optim.lr_at",
    title="Cosine decay ignores min_lr: the schedule anneals to zero instead of the configured floor",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="lr_at computes the cosine as 0.5 * (1 + cos(pi * progress)) * lr and never adds min_lr, so "
    "the last part of training runs at a learning rate far below the configured floor and the run stops "
    "learning early.",
    fix="min_lr + 0.5 * (1 + cos(pi * progress)) * (lr - min_lr).",
    references=("karpathy/nanoGPT train.py get_lr: 'return min_lr + coeff * (learning_rate - min_lr)' and the "
                "issues of forks that dropped the min_lr term",),
    manifest=Manifest(check="lr_ratio", steps=40, params={"min_ratio": 0.0, "max_ratio": 0.5, "step": 39}),
)
def lr_at_no_floor(step: int, cfg: TrainConfig) -> float:
    """Cosine to zero, min_lr ignored."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress)) * cfg.lr


@fault(
    "b8_adam_coupled_decay",
    seam="model.optim.configure_optimizer",
    title="Adam with weight_decay (L2 folded into the gradient) used where AdamW's decoupled decay was meant",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="configure_optimizer builds torch.optim.Adam with the decay group's weight_decay. Adam adds "
    "wd * w to the gradient before the adaptive normalization, so the decay is rescaled per coordinate by the "
    "second moment and interacts with the gradient statistics instead of shrinking weights uniformly.",
    fix="torch.optim.AdamW (decoupled weight decay).",
    references=("Loshchilov & Hutter, 'Decoupled Weight Decay Regularization' and the PyTorch forum threads "
                "'Adam weight_decay is not AdamW'",),
    manifest=Manifest(check="metric_differs", steps=40, params={"min_gap": 0.005}),
)
def configure_optimizer_coupled(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam with L2 penalty instead of AdamW."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


@fault(
    "b8_label_smoothing_everywhere",
    seam="model.loss.lm_loss",
    title="Label smoothing left on in the shared loss: the validation loss is a smoothed loss, not the NLL",
    subsystem="loss",
    also_acceptable=("eval",),
    trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="lm_loss passes label_smoothing=0.1 to cross_entropy. Training is pulled toward a uniform "
    "distribution, and because evaluation reuses the same function, the reported validation loss (and "
    "perplexity) is the smoothed objective, higher than the model's true NLL.",
    fix="Smooth only the training objective if at all; evaluate with plain cross-entropy.",
    references=("huggingface/transformers issue: label_smoothing_factor applied to eval loss, perplexity "
                "reported wrong",),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.05}),
)
def lm_loss_smoothed(logits: torch.Tensor, labels: torch.Tensor, num_targets: int | None = None,
                     ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy with label smoothing."""
    shifted_logits = logits[:, :-1].float()
    shifted_labels = labels[:, 1:]
    total = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
        ignore_index=ignore_index, reduction="sum", label_smoothing=0.1,
    )
    if num_targets is None:
        num_targets = count_targets(labels, ignore_index)  # noqa: F821 (model.loss's)
    return total / max(num_targets, 1)


@fault(
    "b8_mask_skip_with_cache",
    seam="model.attention.build_attention_mask",
    title="Causal-mask shortcut taken in cached decode: SDPA's is_causal aligns the mask top-left",
    subsystem="mask",
    also_acceptable=("model",),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="build_attention_mask decides whether plain causal attention suffices by looking at the mask "
    "columns of the current tokens only, not at the cached ones, and never checks that queries and keys have "
    "the same length. In cached decode the one new column is all ones, so it returns None; SDPA's is_causal "
    "then builds a top-left aligned mask for 1 query x n keys, and the new token attends to the first cached "
    "key only (the left pads and the prompt are both wrong).",
    fix="Skip the explicit mask only when query_len == key_len (no cache).",
    references=("pytorch/pytorch issue: scaled_dot_product_attention is_causal uses top-left alignment when "
                "q_len != kv_len", "transformers _ignore_causal_mask_sdpa: only skip when query_length == "
                "key_value_length or query_length == 1"),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "cached_logit_gap", "faulty_min": 1e-3, "clean_max": 1e-4}),
)
def mask_skip_with_cache(attention_mask: torch.Tensor, query_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The causal shortcut looks at the new columns only."""
    batch, key_len = attention_mask.shape
    new = attention_mask[:, key_len - query_len :]  # the columns of this forward's tokens
    if bool((new[:, 1:] <= new[:, :-1]).all()):
        return None
    device = attention_mask.device
    query_pos = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    key_pos = torch.arange(key_len, device=device)[None, :]
    allowed = (key_pos <= query_pos) & attention_mask.bool()[:, None, :]
    allowed |= key_pos == query_pos
    mask = torch.zeros(batch, 1, query_len, key_len, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


@fault(
    "b8_final_norm_missing",
    seam="model.gpt.GPT.forward",
    title="Final LayerNorm skipped: the head reads the raw residual stream of a pre-norm model",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="forward returns lm_head(x) instead of lm_head(ln_f(x)). In a pre-norm transformer the residual "
    "stream grows with depth and is never normalized before the tied head, so logits scale with it and ln_f "
    "is a dead parameter.",
    fix="Apply ln_f before the LM head.",
    references=("karpathy/nanoGPT model.py (x = self.transformer.ln_f(x) before lm_head) and GPT-2 paper "
                "'an additional layer normalization was added after the final self-attention block'",),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.01}),
)
def forward_no_final_norm(self, input_ids, attention_mask=None, position_ids=None, cache=None):
    """No final norm."""
    B, T = input_ids.shape
    past_len = 0 if cache is None else cache.length
    if past_len + T > self.config.max_positions:
        raise ValueError(f"sequence of {past_len + T} tokens exceeds the position table")
    if attention_mask is None:
        attention_mask = torch.ones(B, past_len + T, dtype=torch.long, device=input_ids.device)
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask, past_len)  # noqa: F821 (model.gpt's)
    x = self.drop(self.wte(input_ids))
    attn_mask = build_attention_mask(attention_mask, T, _compute_dtype(x))  # noqa: F821
    rope = rope_at(self.rope_cos, self.rope_sin, position_ids)  # noqa: F821
    for i, block in enumerate(self.blocks):
        x = block(x, rope, attn_mask, cache, i)
    return self.lm_head(x)


@fault(
    "b8_heads_merged_without_transpose",
    seam="model.attention.CausalSelfAttention.forward",
    title="Attention heads merged with reshape but no transpose: outputs of other tokens are mixed in",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="After attention y is (B, nh, T, hs); forward reshapes it straight to (B, T, C) without moving "
    "the head axis back. Each output row then concatenates several tokens' outputs of one head: token t "
    "receives the outputs of later tokens (a leak of the future) and loses its own heads.",
    fix="y.transpose(1, 2).reshape(B, T, C) (or .contiguous().view).",
    references=("karpathy/minGPT / nanoGPT: 'y = y.transpose(1, 2).contiguous().view(B, T, C) # re-assemble all "
                "head outputs side by side' and PyTorch forum threads on view vs transpose in multi-head "
                "attention",),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.02}),
)
def attn_forward_no_transpose(self, x, rope, attn_mask, cache=None, layer_idx: int = 0):
    """Heads merged without the transpose."""
    B, T, C = x.shape
    q, k, v = self.qkv(x).split(C, dim=2)
    q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    q = apply_rope(q, *rope)  # noqa: F821 (model.attention's)
    k = apply_rope(k, *rope)  # noqa: F821
    if cache is not None:
        k, v = cache.update(layer_idx, k, v)
    y = attend(q, k, v, attn_mask, self.dropout if self.training else 0.0)  # noqa: F821
    y = y.reshape(B, T, C)
    return self.resid_dropout(self.proj(y))


@fault(
    "b8_eval_mean_of_batch_means",
    seam="model.evaluate.evaluate",
    title="Validation loss averaged over batches, not tokens: short last batch and short documents overweighted",
    subsystem="eval",
    trigger="eval-only",
    symptoms=("eval-metric",),
    explanation="evaluate appends each batch's token-mean loss and returns their plain mean, so a batch with "
    "few target tokens (the short tail batch, or a batch of short documents) weighs as much as a full one; "
    "the metric also changes with eval batch size.",
    fix="Accumulate loss * n_targets and divide by the total target count.",
    references=("huggingface/transformers issue: eval loss is the mean of per-batch losses, not weighted by "
                "tokens (evaluation_loop)", "Lightning docs: self.log with batch_size for correct epoch "
                "averaging"),
    manifest=Manifest(check="metric_differs", steps=20, params={"min_gap": 0.001}),
)
def evaluate_batch_mean(model, docs, pad_id: int, batch_size: int, precision: str = "fp32",
                        pad_side: str = "right") -> float:
    """Mean of per-batch means."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = []
    try:
        with torch.no_grad():
            for i in range(0, len(docs), batch_size):
                batch = {k: v.to(device) for k, v in collate(docs[i : i + batch_size], pad_id, pad_side).items()}  # noqa: F821
                with autocast_context(precision, device.type):  # noqa: F821
                    logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
                losses.append(lm_loss(logits, batch["labels"]).item())  # noqa: F821
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


@fault(
    "b8_truncate_keeps_tail",
    seam="model.data.truncate",
    title="Over-long documents truncated from the left: the kept window starts mid-document with no BOS",
    subsystem="data",
    trigger="rare-batch",
    symptoms=("silent-quality",),
    explanation="truncate keeps ids[-max_len:] (the tokenizer's truncation_side='left' used for a pretraining "
    "corpus), so every cut document loses its BOS and its beginning; the model learns to continue text from "
    "arbitrary starts after a missing BOS.",
    fix="Keep the head: ids[:max_len - 1] + [eos].",
    references=("huggingface/transformers tokenizer truncation_side='left' pitfalls in causal-LM training "
                "(forum threads: left truncation drops the BOS)",),
    manifest=Manifest(check="metric_differs", steps=30, variant={"data": {"seq_len": 8}},
                      params={"min_gap": 0.01}),
)
def truncate_tail(ids: list[int], max_len: int, eos_id: int) -> list[int]:
    """Keeps the tail."""
    if len(ids) <= max_len:
        return ids
    return ids[-max_len:]


@fault(
    "b8_scaler_growth_every_step",
    seam="model.precision.make_grad_scaler",
    title="GradScaler built with growth_interval=1: the loss scale doubles every step and overflows every few steps",
    subsystem="precision",
    trigger="amp-only",
    symptoms=("silent-quality",),
    explanation="make_grad_scaler passes growth_interval=1 (a loss-scale window of one step), so the scale "
    "doubles after every finite step until the fp16 gradients overflow; the step is skipped, the scale halves "
    "and climbs again: a steady fraction of optimizer steps is silently dropped.",
    fix="Keep the default growth_interval (2000) or a window of hundreds of steps.",
    references=("DeepSpeed fp16 config 'loss_scale_window' and PyTorch GradScaler docs (growth_interval: "
                "number of consecutive unskipped steps before the scale grows)",),
    manifest=Manifest(check="skipped_steps", steps=16, variant={"train": {"precision": "fp16"}},
                      params={"faulty_min": 2, "clean_max": 0}),
)
def make_grad_scaler_fast_growth(precision: str, device_type: str, init_scale: float = 2.0**16):
    """Scale grows after every step."""
    return torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=1, enabled=precision == "fp16")


@fault(
    "b8_rope_slot_positions",
    seam="model.rope.rope_at",
    title="RoPE looks up rows by slot index (arange of the input length), ignoring position_ids",
    subsystem="position",
    also_acceptable=("model",),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="rope_at indexes the tables with arange(T) instead of the position_ids it is given. Training "
    "batches are right-padded, so nothing changes there; but left-padded prompts get positions that count "
    "their pads, and in cached decode (T = 1) every generated token is rotated as position 0, so cached "
    "generation diverges from the full forward.",
    fix="cos[position_ids], sin[position_ids].",
    references=("huggingface/transformers issues: position_ids ignored by rotary embedding during generation "
                "with past_key_values / left padding",),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "cached_logit_gap", "faulty_min": 1e-3, "clean_max": 1e-4}),
)
def rope_at_slots(cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor):
    """Slot indices instead of positions."""
    slots = torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)
    return cos[slots].unsqueeze(1), sin[slots].unsqueeze(1)


# ----------------------------------------------------------------------------------------------------------------
# HF target
# ----------------------------------------------------------------------------------------------------------------


@fault(
    "b8_hf_shift_pad_with_token_zero", target="hf",
    seam="transformers.loss.loss_utils.ForCausalLMLoss",
    title="Shifted labels padded with 0 instead of ignore_index: every row's last position learns token 0",
    subsystem="loss", trigger="always", symptoms=("silent-quality", "eval-metric"),
    explanation="ForCausalLMLoss pads the labels on the right before shifting with value=0 (F.pad's default) "
    "rather than ignore_index, so the final position of every row gets the target id 0 and is counted in the "
    "loss; the model learns to emit token 0 after the last column.",
    fix="nn.functional.pad(labels, (0, 1), value=ignore_index).",
    references=("huggingface/transformers PR moving the shift to F.pad with value=ignore_index (loss_utils.py), "
                "and issues about shift labels padded with 0",),
    manifest=Manifest(check="metric_differs", scenario="train", steps=16, params={"min_gap": 0.02}),
)
def for_causal_lm_loss_pad_zero(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                                shift_labels=None, **kwargs):
    """Shift padded with 0."""
    logits = logits.float()
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1))
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(logits.device)
    return fixed_cross_entropy(logits, shift_labels, num_items_in_batch, ignore_index, **kwargs)  # noqa: F821


@fault(
    "b8_hf_rmsnorm_offset_weight", target="hf",
    seam="transformers.models.llama.modeling_llama.LlamaRMSNorm.forward",
    title="RMSNorm scaled by (1 + weight), Gemma's convention, on weights initialised to one",
    subsystem="model", trigger="always", symptoms=("silent-quality",),
    explanation="LlamaRMSNorm.forward multiplies by (1 + weight) as Gemma's norm does, but Llama initialises "
    "the weight to ones: every norm doubles its output, the residual branches and the logits start twice as "
    "large and weight decay pulls the effective gain toward 1 rather than 0.",
    fix="Use weight * x for Llama-style norms (ones init); (1 + weight) only with zero-initialised weights.",
    references=("huggingface/transformers Gemma RMSNorm '(1.0 + self.weight.float())' and the issues about "
                "converting Gemma weights with the wrong norm convention",),
    manifest=Manifest(check="metric_differs", scenario="train", steps=16, params={"min_gap": 0.01}),
)
def rmsnorm_offset(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """(1 + weight) scaling."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (1.0 + self.weight) * hidden_states.to(input_dtype)


@fault(
    "b8_hf_cosine_half_period", target="hf",
    seam="transformers.optimization._get_cosine_schedule_with_warmup_lr_lambda",
    title="Cosine num_cycles read as periods of pi: the default 0.5 anneals only to half the peak LR",
    subsystem="optimizer", trigger="always", symptoms=("silent-quality",),
    explanation="The lambda computes cos(pi * num_cycles * progress) instead of cos(pi * 2 * num_cycles * "
    "progress). With the default num_cycles=0.5 the cosine covers a quarter period: the LR ends at half "
    "the peak instead of zero and the run never anneals.",
    fix="factor = 0.5 * (1 + cos(pi * num_cycles * 2 * progress)).",
    references=("huggingface/transformers issues on get_cosine_schedule_with_warmup num_cycles semantics "
                "('0.5 means half a cosine, i.e. decrease to 0')",),
    manifest=Manifest(check="lr_ratio", scenario="train", steps=16,
                      params={"min_ratio": 3.0, "max_ratio": 1000.0, "step": 15}),
)
def cosine_lambda_half_period(current_step: int, *, num_warmup_steps: int, num_training_steps: int,
                              num_cycles: float, min_lr_rate: float = 0.0):
    """Missing factor 2 in the cosine."""
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * progress))
    factor = factor * (1 - min_lr_rate) + min_lr_rate
    return max(0, factor)


@fault(
    "b8_hf_grad_norm_after_clip", target="hf",
    seam="accelerate.accelerator.Accelerator.clip_grad_norm_",
    title="clip_grad_norm_ returns the norm after clipping: the logged grad_norm never exceeds max_grad_norm",
    subsystem="optimizer", also_acceptable=("precision",), trigger="always", symptoms=("silent-quality",),
    explanation="clip_grad_norm_ clips, then recomputes and returns the norm of the clipped gradients. The "
    "logged grad_norm is capped at max_grad_norm, hiding spikes and divergence from every dashboard and "
    "monitor that reads it.",
    fix="Return the total norm computed before clipping (what torch.nn.utils.clip_grad_norm_ returns).",
    references=("huggingface/accelerate and DeepSpeed issues: reported grad_norm is post-clipping "
                "(get_global_grad_norm after clip)",),
    manifest=Manifest(check="grad_norm_ratio", scenario="train", steps=4,
                      params={"min_ratio": 0.0, "max_ratio": 0.95, "step": 0}),
)
def clip_grad_norm_post(self, parameters, max_norm, norm_type=2):
    """Returns the post-clip norm."""
    self.unscale_gradients()
    params = [p for p in parameters if p.grad is not None]
    torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)


@fault(
    "b8_hf_eval_capped_by_train_batch", target="hf",
    seam="transformers.trainer.Trainer.get_eval_dataloader",
    title="Eval set capped with the wrong limit: only the first per-device-train-batch documents are evaluated",
    subsystem="eval", trigger="eval-only", symptoms=("eval-metric",),
    explanation="get_eval_dataloader applies a max_eval_samples cap but reads it from the training batch size "
    "(a copy-paste of the train branch), so the reported eval loss is measured on the first few validation "
    "documents only: a noisy, biased estimate that does not track the full split.",
    fix="Evaluate the whole validation split (or cap it with the eval limit, deliberately).",
    references=("huggingface/transformers examples run_clm.py max_eval_samples / max_train_samples handling and "
                "forum threads where the eval set was silently subsampled",),
    manifest=Manifest(check="metric_differs", scenario="train", steps=16, params={"min_gap": 0.005}),
)
def get_eval_dataloader_capped(self, eval_dataset=None):
    """Evaluates a prefix of the validation split."""
    from torch.utils.data import Subset

    if eval_dataset is None and self.eval_dataset is None:
        raise ValueError("Trainer: evaluation requires an eval_dataset.")
    dataloader_key = eval_dataset if isinstance(eval_dataset, str) else "eval"
    eval_dataset = (
        self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str)
        else eval_dataset if eval_dataset is not None else self.eval_dataset
    )
    max_eval_samples = self.args.per_device_train_batch_size
    if len(eval_dataset) > max_eval_samples:
        eval_dataset = Subset(eval_dataset, range(max_eval_samples))
    return self._get_dataloader(
        dataset=eval_dataset, description="Evaluation", batch_size=self.args.eval_batch_size,
        sampler_fn=self._get_eval_sampler, dataloader_key=dataloader_key,
    )


@fault(
    "b8_hf_eager_scaling_inverted", target="hf",
    seam="transformers.models.llama.modeling_llama.eager_attention_forward",
    title="Eager attention divides the scores by `scaling` (already head_dim**-0.5): scores multiplied by sqrt(d)",
    subsystem="model", also_acceptable=("mask",), trigger="always", symptoms=("silent-quality",),
    explanation="eager_attention_forward computes q k^T / scaling, but scaling is already the inverse square "
    "root of head_dim: the logits are sqrt(d) times too large instead of 1/sqrt(d), the softmax saturates "
    "and attention gradients vanish; the SDPA path is unaffected, so eager and SDPA runs disagree.",
    fix="Multiply by scaling.",
    references=("huggingface/transformers issues: attention 'scaling' vs 'softmax_scale' confusion when "
                "porting models (eager vs sdpa mismatch)",),
    manifest=Manifest(check="metric_differs", scenario="train", steps=32,
                      variant={"model": {"attn_implementation": "eager"}}, params={"min_gap": 0.01}),
)
def eager_attention_scaling_inverted(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                                     **kwargs):
    """Scores divided by scaling."""
    key_states = repeat_kv(key, module.num_key_value_groups)  # noqa: F821 (modeling_llama's)
    value_states = repeat_kv(value, module.num_key_value_groups)  # noqa: F821
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) / scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


@fault(
    "b8_hf_tokenizer_context_too_long", target="hf",
    seam="targets.hf.data.wrap_tokenizer",
    title="Tokenizer model_max_length taken from the base model, not the training context: truncation lets 4x seq_len through",
    subsystem="data", trigger="rare-batch", symptoms=("silent-quality",),
    explanation="wrap_tokenizer sets model_max_length to the base checkpoint's context (4 x seq_len) instead of "
    "the training seq_len, so `truncation=True, max_length=tokenizer.model_max_length` lets over-long "
    "documents through: batches run longer than the configured context, in training and evaluation alike.",
    fix="Pass model_max_length=seq_len (or an explicit max_length) when building the tokenizer.",
    references=("huggingface/transformers warning 'Token indices sequence length is longer than the specified "
                "maximum sequence length for this model' and issues where model_max_length was 1e30",),
    manifest=Manifest(check="metric_differs", scenario="train", steps=16, variant={"data": {"seq_len": 8}},
                      params={"min_gap": 0.01}),
)
def wrap_tokenizer_no_max_length(tokenizer_json: str, seq_len: int, padding_side: str):
    """model_max_length never set."""
    backend = BackendTokenizer.from_str(tokenizer_json)  # noqa: F821 (targets.hf.data's)
    pad, bos, eos, unk = SPECIAL_TOKENS  # noqa: F821
    backend.post_processor = processors.TemplateProcessing(  # noqa: F821
        single=f"{bos} $A {eos}", special_tokens=[(bos, backend.token_to_id(bos)), (eos, backend.token_to_id(eos))]
    )
    # the base checkpoint's context length, not the training context
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, bos_token=bos,  # noqa: F821
                                   eos_token=eos, unk_token=unk, model_max_length=4 * seq_len,
                                   padding_side=padding_side)
