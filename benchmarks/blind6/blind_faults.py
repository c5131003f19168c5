"""blind6: a blind set of faults (see README.md in this folder). Loaded with ``--plugin`` / ``--fault-plugin``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from faultbench.faults.registry import Manifest, fault
from faultbench.model.attention import apply_rope, attend, build_attention_mask
from faultbench.model.checkpoint import (
    FORMAT,
    CheckpointError,
    StepRecord,
    _config_mismatch,
    _sha256,
    read_meta,
    restore_rng_state,
)
from faultbench.model.config import TrainConfig
from faultbench.model.data import IGNORE_INDEX, collate
from faultbench.model.gpt import KVCache, _compute_dtype
from faultbench.model.loss import count_targets, lm_loss
from faultbench.model.precision import autocast_context
from faultbench.model.rope import position_ids_from_mask, rope_at

_RESUME = dict(scenario="resume", steps=12, check="extra_at_least")


# ---------------------------------------------------------------------------------------------------- ref


@fault(
    "b6_sched_before_step",
    seam="model.train.optimizer_step",
    title="LR scheduler stepped before the optimizer: every update uses the next step's learning rate",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="optimizer_step advances the scheduler before scaler.step(optimizer), the pre-1.1 PyTorch "
    "order. Each update then runs with the learning rate of the following step: the first value of the "
    "schedule is skipped and warmup is one step ahead all along.",
    fix="Call optimizer.step() (scaler.step) first, then scheduler.step().",
    references=(
        "PyTorch docs, torch.optim 'How to adjust learning rate': since 1.1.0 scheduler.step() must be "
        "called after optimizer.step(), otherwise the first value of the schedule is skipped",
        "ThilinaRajapakse/pytorch-transformers-classification#21: 'Detected call of lr_scheduler.step() before "
        "optimizer.step()' (the first value of the schedule is skipped); fixed by reordering the calls",
    ),
    manifest=Manifest(check="loss_below", steps=8, params={"min_gap": 0.02}),
)
def optimizer_step_sched_first(optimizer, scaler, scheduler) -> bool:
    """The schedule is advanced before the update, so every step uses the next step's LR."""
    scale_before = scaler.get_scale()
    scheduler.step()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return scaler.get_scale() < scale_before


@fault(
    "b6_warmup_zero_first_step",
    seam="model.optim.lr_at",
    title="Linear warmup starts at step / warmup: the first optimizer step runs with learning rate 0",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="lr_at ramps the warmup as lr * step / warmup_steps, so step 0 gets a learning rate of exactly "
    "0: the first batch's gradients (and AdamW's first moment update) are computed and thrown away, and the "
    "whole warmup lags one step behind.",
    fix="Ramp as lr * (step + 1) / warmup_steps so the first step already moves the weights.",
    references=(
        "google-research/bert#1293: in linear warmup the first global step is 0 and so is its learning rate: "
        "the first step updates nothing but Adam's moments",
        "google-research/big_transfer#58: linear warmup learning rate is 0 when step = 0",
        "pytorch/torchtitan#1261: review thread, step 1 has lr=0 'This will cause no learning in the first step'",
    ),
    manifest=Manifest(check="lr_ratio", steps=3, params={"min_ratio": 0.0, "max_ratio": 0.01, "step": 0}),
)
def lr_at_zero_start(step: int, cfg) -> float:
    """Warmup is step / warmup_steps: the first step has LR 0."""
    if step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


@fault(
    "b6_label_smoothing_everywhere",
    seam="model.loss.lm_loss",
    title="Label smoothing left on in the shared loss: train and validation losses are not the NLL",
    subsystem="loss",
    also_acceptable=("eval",),
    trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="lm_loss passes label_smoothing=0.1 to cross_entropy. The same function scores the "
    "validation split, so the reported val loss (and perplexity) is the smoothed loss, well above the "
    "model's true negative log-likelihood, and the trained distribution is pulled toward uniform.",
    fix="Use label smoothing only as a training regularizer, if at all; evaluate with the plain NLL.",
    references=(
        "PyTorch docs, torch.nn.CrossEntropyLoss: label_smoothing mixes the target with the uniform "
        "distribution (the loss no longer is the NLL)",
        "Noble-Lab/casanovo#261: label smoothing for the training loss only, not for validation",
        "huggingface/transformers#10338: Fix evaluation with label smoothing in Trainer",
    ),
    manifest=Manifest(check="loss_above", steps=20, params={"min_gap": 0.15, "metric": "val"}),
)
def lm_loss_smoothed(logits: torch.Tensor, labels: torch.Tensor, num_targets: int | None = None,
                     ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy with label smoothing 0.1, for training and evaluation alike."""
    shifted_logits = logits[:, :-1].float()
    shifted_labels = labels[:, 1:]
    total = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
        ignore_index=ignore_index, reduction="sum", label_smoothing=0.1,
    )
    if num_targets is None:
        num_targets = count_targets(labels, ignore_index)
    return total / max(num_targets, 1)


@fault(
    "b6_resume_prefix_strict_false",
    seam="model.checkpoint.load_checkpoint",
    title="Resume loads the weights with strict=False under DDP-style 'module.' keys: no weight is restored",
    subsystem="checkpoint",
    trigger="on-resume",
    symptoms=("silent-quality",),
    explanation="load_checkpoint prefixes the saved keys with 'module.' (as saved from a wrapped model) and "
    "loads them with strict=False to silence the resulting error. Every key is 'unexpected', none matches, and "
    "the model silently keeps its fresh initial weights while the optimizer, schedule and step resume: the "
    "loss jumps back to its starting value after the resume.",
    fix="Strip or add the 'module.' prefix so the keys match, and load with strict=True (check the returned "
    "missing/unexpected keys).",
    references=(
        "PyTorch docs, Module.load_state_dict: strict=False ignores non-matching keys and returns them as "
        "missing_keys / unexpected_keys",
        "pytorch/pytorch#3805: resuming from a DataParallel checkpoint: unexpected key 'module.features...'",
        "XuJiacong/PIDNet#30: checkpoint keys do not match, strict=False loads 0 parameters without an error",
        "pytorch/pytorch#53224: consume_prefix_in_state_dict_if_present for DP/DDP state dicts",
    ),
    manifest=Manifest(**_RESUME, params={"key": "resume_loss_diff", "faulty_min": 0.2, "clean_max": 0.0}),
)
def load_checkpoint_strict_false(run, directory) -> None:
    """The saved keys carry a 'module.' prefix and load with strict=False: nothing is restored."""
    directory = Path(directory)
    meta = read_meta(directory)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint format {meta.get('format')!r} is not supported (expected {FORMAT})")
    state_path = directory / "state.pt"
    if not state_path.exists():
        raise CheckpointError(f"checkpoint {directory} has no state.pt")
    if _sha256(state_path) != meta["sha256"]:
        raise CheckpointError(f"{state_path} is corrupted: its sha256 does not match meta.json")
    diffs = _config_mismatch(meta["config"], run.config.to_dict())
    if diffs:
        raise CheckpointError(f"checkpoint {directory} belongs to another config: " + "; ".join(diffs))
    if meta["tokenizer_sha256"] != run.tokenizer.sha256:
        raise CheckpointError(
            f"checkpoint {directory} was trained with another tokenizer (sha256 {meta['tokenizer_sha256'][:12]} "
            f"vs {run.tokenizer.sha256[:12]}); token ids would mean different things"
        )
    state = torch.load(state_path, map_location=run.config.train.device, weights_only=True)
    run.model.load_state_dict({f"module.{k}": v for k, v in state["model"].items()}, strict=False)
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.step = state["step"]
    run.history = [StepRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in state["history"]]
    restore_rng_state(state["rng"][run.rank])


@fault(
    "b6_no_final_norm",
    seam="model.gpt.GPT.forward",
    title="The final LayerNorm is skipped: the LM head reads the raw residual stream",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="forward returns lm_head(x) instead of lm_head(ln_f(x)). In a pre-norm transformer the "
    "residual stream is never normalized before the head, so the logits' scale follows the stream's growth; "
    "ln_f's parameters get no gradient and training is slower and less stable.",
    fix="Apply the final norm before the LM head: lm_head(ln_f(x)).",
    references=(
        "karpathy/nanoGPT model.py: x = self.transformer.ln_f(x) before lm_head (GPT-2 adds a final "
        "layer norm after the last block)",
    ),
    manifest=Manifest(check="loss_above", steps=30, params={"min_gap": 0.1, "metric": "val"}),
)
def gpt_forward_no_ln_f(self, input_ids, attention_mask=None, position_ids=None, cache: KVCache | None = None):
    """The final LayerNorm is never applied before the LM head."""
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
    x = self.drop(self.wte(input_ids))
    attn_mask = build_attention_mask(attention_mask, T, _compute_dtype(x))
    rope = rope_at(self.rope_cos, self.rope_sin, position_ids)
    for i, block in enumerate(self.blocks):
        x = block(x, rope, attn_mask, cache, i)
    return self.lm_head(x)


@fault(
    "b6_rope_on_values",
    seam="model.attention.CausalSelfAttention.forward",
    title="RoPE also rotates the values: attention outputs depend on absolute positions",
    subsystem="position",
    also_acceptable=("model",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="forward applies the rotary embedding to v as well as to q and k. The scores stay relative, "
    "but each value is rotated by its own absolute angle, so the output of attention (and every logit after "
    "it) changes when the same text sits at other positions.",
    fix="Rotate only the queries and the keys; the values carry content, not position.",
    references=(
        "Su et al., RoFormer (arXiv:2104.09864) section 3.4: the rotation is applied to queries and keys only",
        "mistralai/mistral-inference#147: rotary embeddings are applied only to queries and keys (RoFormer 3.2)",
        "labmlai/annotated_deep_learning_paper_implementations#251: value rotated twice in the RoPE value-PE "
        "variant, confirmed a bug",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "rope_shift_gap", "faulty_min": 0.05, "clean_max": 1e-3}),
)
def attention_forward_rope_v(self, x, rope, attn_mask, cache=None, layer_idx: int = 0):
    """The values are rotated too."""
    B, T, C = x.shape
    q, k, v = self.qkv(x).split(C, dim=2)
    q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    q = apply_rope(q, *rope)
    k = apply_rope(k, *rope)
    v = apply_rope(v, *rope)
    if cache is not None:
        k, v = cache.update(layer_idx, k, v)
    y = attend(q, k, v, attn_mask, self.dropout if self.training else 0.0)
    y = y.transpose(1, 2).reshape(B, T, C)
    return self.resid_dropout(self.proj(y))


@fault(
    "b6_adam_coupled_l2",
    seam="model.optim.configure_optimizer",
    title="Adam with weight_decay instead of AdamW: the decay is an L2 term rescaled by the adaptive step",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="configure_optimizer builds torch.optim.Adam with the groups' weight_decay. Adam adds "
    "weight_decay * w to the gradient before the adaptive normalization, so for the many weights with small "
    "gradients the decay dominates the update: weights are pulled toward zero at the full learning rate "
    "and the loss lags far behind AdamW's.",
    fix="Use torch.optim.AdamW (decoupled weight decay), or Adam with weight_decay=0.",
    references=(
        "Loshchilov & Hutter, 'Decoupled Weight Decay Regularization' (arXiv:1711.05101): L2 in Adam is not "
        "weight decay",
        "pytorch/pytorch#41679: Update Adam documentation (Adam's weight_decay is L2 regularization, not "
        "decoupled weight decay)",
        "pytorch/pytorch#21250: Implement AdamW optimizer (L2 and weight decay are not equivalent under Adam)",
    ),
    manifest=Manifest(check="loss_above", steps=30, params={"min_gap": 0.1, "metric": "val"}),
)
def configure_optimizer_adam_l2(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam's coupled L2 penalty stands in for AdamW's decoupled decay."""
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
    "b6_eval_count_includes_bos",
    seam="model.evaluate.evaluate",
    title="Validation loss divided by every real token, the never-predicted first token included",
    subsystem="eval",
    trigger="eval-only",
    symptoms=("eval-metric",),
    explanation="evaluate sums the token losses correctly but divides by attention_mask.sum(), the number of "
    "real tokens, instead of the number of predicted targets: each document's first token is never a target "
    "(nothing precedes it), so the reported val loss (and perplexity) is too low by a factor (n - 1) / n, "
    "largest for short documents.",
    fix="Divide by the number of shifted, non-ignored labels (count_targets), the same count the loss sums over.",
    references=(
        "Shark-NLP/OpenICL#26: perplexity token count taken from all non-pad input ids while the loss starts "
        "at the second token",
        "huggingface/datasets#4258: perplexity metric fix for the start token's mask",
    ),
    manifest=Manifest(check="metric_differs", steps=20, params={"metric": "val_loss", "min_gap": 0.05}),
)
def evaluate_count_real_tokens(model, docs, pad_id: int, batch_size: int, precision: str = "fp32",
                               pad_side: str = "right") -> float:
    """The summed loss is divided by the real tokens, not by the predicted ones."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for i in range(0, len(docs), batch_size):
            batch = {k: v.to(device) for k, v in collate(docs[i : i + batch_size], pad_id, pad_side).items()}
            with autocast_context(precision, device.type):
                logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            n = count_targets(batch["labels"])
            total += lm_loss(logits, batch["labels"], n).item() * n
            count += int(batch["attention_mask"].sum())
    finally:
        model.train(was_training)
    return total / count


@fault(
    "b6_ddp_local_target_count",
    seam="model.distributed.global_target_count",
    title="The step's target count is never summed over ranks: each rank normalizes by its own count",
    subsystem="distributed",
    also_acceptable=("loss",),
    trigger="multi-rank",
    symptoms=("silent-quality",),
    explanation="global_target_count returns the rank's local count without the all_reduce. train_step still "
    "divides it by the world size to get each rank's share, so every rank normalizes its summed loss by about "
    "1/world_size of the tokens it should: after DDP averages the gradients, they are world_size times too "
    "large (and the logged loss too), growing with the number of ranks.",
    fix="All-reduce (sum) the token count over the ranks before normalizing, so the per-rank losses add up to "
    "the global token mean.",
    references=(
        "OpenNMT/OpenNMT-py#2022: loss normalization in multi-GPU training must use the token count summed over "
        "the GPUs",
        "meta-pytorch/torchtune#1917: data parallel and gradient accumulation are normalized alike: divide by "
        "the tokens of the whole global batch",
    ),
    manifest=Manifest(check="grad_norm_ratio", scenario="ddp", steps=4, params={"min_ratio": 1.6, "max_ratio": 2.5}),
)
def global_target_count_local(local_count: int, device: str = "cpu") -> int:
    """The local count is returned without summing over ranks."""
    return local_count


@fault(
    "b6_grad_norm_after_clip",
    seam="model.train.clip_gradients",
    title="The gradient norm is measured after clipping: the recorded norm never exceeds max_norm",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="clip_gradients clips, then recomputes the norm of the already clipped gradients and returns "
    "that. Every recorded grad norm is at most grad_clip, so clipping that fires on every step, gradient "
    "spikes and the true scale of the gradients are invisible in the step records.",
    fix="Record the total norm clip_grad_norm_ returns: the norm before clipping.",
    references=(
        "verl-project/verl#2282: grad_norm is reported before clipping; after clipping it would always be the "
        "clip value",
        "radixark/miles#2132: grad_norm is logged before clipping, not after (a post-clip norm never exceeds "
        "clip_grad and hides that clipping fires every step)",
        "pytorch/pytorch#1032: clip_grad_norm should return the total norm, to log whether clipping occurred",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, params={"min_ratio": 0.05, "max_ratio": 0.7}),
)
def clip_gradients_post_norm(model, optimizer, scaler, max_norm: float) -> float:
    """The returned norm is that of the clipped gradients."""
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
    return float(norm)


# ----------------------------------------------------------------------------------------------------- hf

_LLAMA = "transformers.models.llama.modeling_llama"


@fault(
    "b6_hf_cosine_quarter_wave", target="hf",
    seam="transformers.optimization._get_cosine_schedule_with_warmup_lr_lambda",
    title="Cosine decay computed as cos(pi * num_cycles * progress): with num_cycles=0.5 the LR only falls to half",
    subsystem="optimizer", trigger="after-step", symptoms=("silent-quality",),
    explanation="The cosine factor drops the factor 2 in cos(pi * num_cycles * 2 * progress). With the "
    "default num_cycles=0.5 the schedule traces a quarter wave: at the end of training the multiplier is 0.5 "
    "instead of 0, so the run never anneals and the last steps are taken at several times the intended LR.",
    fix="Use cos(pi * 2 * num_cycles * progress) (num_cycles=0.5 is half a cosine period, from 1 to 0).",
    references=(
        "kekmodel/FixMatch-pytorch#6: get_cosine_schedule_with_warmup's num_cycles convention (7/16 of a "
        "cycle) questioned as a bug in the cosine formula",
        "meta-pytorch/torchtune#242: the reference HF cosine-with-warmup lambda, "
        "cos(pi * num_cycles * 2.0 * progress)",
    ),
    manifest=Manifest(check="lr_ratio", steps=16, params={"min_ratio": 3.0, "max_ratio": 200.0, "step": 15}),
)
def cosine_lambda_quarter(current_step: int, *, num_warmup_steps: int, num_training_steps: int,
                          num_cycles: float, min_lr_rate: float = 0.0):
    """The factor 2 of the cosine's argument is missing: half a cosine period becomes a quarter."""
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * progress))
    factor = factor * (1 - min_lr_rate) + min_lr_rate
    return max(0, factor)


@fault(
    "b6_hf_rmsnorm_unit_offset", target="hf", seam=f"{_LLAMA}.LlamaRMSNorm.forward",
    title="RMSNorm applies (1 + weight), Gemma's convention, to a gain initialized at 1: every norm doubles",
    subsystem="model", trigger="always", symptoms=("silent-quality",),
    explanation="The norm multiplies by (1 + weight) as Gemma does, but Llama stores the gain itself and "
    "initializes it to ones. Every RMSNorm output is twice as large as intended (and its gain's effective "
    "value is offset by one), so each residual branch and the final logits start at the wrong scale.",
    fix="Match the convention to the parameterization: weight * x for gains initialized at 1, (1 + weight) * x "
    "only for gains stored as offsets initialized at 0.",
    references=(
        "linkedin/Liger-Kernel#74: Gemma needs RMSNorm with a 1.0 offset (llama-style RMSNorm applied to gemma)",
        "pytorch/executorch#19901: Gemma RMSNorm +1 offset missing on the --checkpoint path",
        "utensils/mold#1078: Gemma's RMSNorm +1 applied twice: every norm scaled by (w + 2)",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, params={"min_ratio": 1.15, "max_ratio": 50.0}),
)
def rmsnorm_unit_offset(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The gain is applied as 1 + weight while it is initialized at 1."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (1.0 + self.weight) * hidden_states.to(input_dtype)


@fault(
    "b6_hf_fixed_ce_double_norm", target="hf", seam="transformers.loss.loss_utils.fixed_cross_entropy",
    title="fixed_cross_entropy takes the token mean and then divides by num_items_in_batch again",
    subsystem="loss", also_acceptable=("optimizer",), trigger="always", symptoms=("silent-quality", "eval-metric"),
    explanation="The loss is reduced with 'mean' and the result is still divided by num_items_in_batch, the "
    "count Trainer passes for gradient accumulation. Loss and gradients are about as many times too small as "
    "the window has targets: AdamW's normalization hides much of it, but the logged loss, the clipping "
    "threshold and the eval loss are all off by that factor.",
    fix="Divide by num_items_in_batch only after a 'sum' reduction; use 'mean' alone when no count is given.",
    references=(
        "huggingface/transformers#34191: Fix Gradient Accumulation issue (reduction='sum' then division by "
        "num_items_in_batch)",
        "PyTorch docs, torch.nn.functional.cross_entropy: reduction='mean' already divides by the number of "
        "non-ignored targets",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, params={"min_ratio": 1e-5, "max_ratio": 0.1}),
)
def fixed_cross_entropy_double_norm(source: torch.Tensor, target: torch.Tensor,
                                    num_items_in_batch: torch.Tensor | None = None, ignore_index: int = -100,
                                    **kwargs) -> torch.Tensor:
    """The mean loss is divided by the item count a second time."""
    loss = nn.functional.cross_entropy(source, target, ignore_index=ignore_index, reduction="mean")
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


@fault(
    "b6_hf_packing_no_boundaries", target="hf",
    seam="transformers.data.data_collator.DataCollatorForLanguageModeling.torch_call",
    title="Collator packs the batch's documents into one row with no boundaries: cross-document attention",
    subsystem="collate", also_acceptable=("mask", "position"), trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="torch_call concatenates every example of the batch into a single row, with an all-ones "
    "attention mask and default positions. Tokens attend to the previous documents of the row, positions run on "
    "across documents, and each BOS becomes a target predicted from the previous EOS: the train and eval "
    "losses are no longer per-document next-token losses.",
    fix="Pad the documents into separate rows, or pack with per-document position_ids (reset at each start) "
    "and a block-diagonal mask, and mask the labels at the boundaries.",
    references=(
        "alex-hh/profam#495: sequence packing not working as expected: attention applied across documents",
        "huggingface/nanoVLM#204: fix packed sequence position IDs and cross-sample attention",
        "huggingface/transformers#31629: packing with position_ids so FlashAttention respects document "
        "boundaries",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"metric": "val_loss", "min_gap": 0.05}),
)
def torch_call_packed(self, examples):
    """All examples are concatenated into one unmasked row."""
    import torch

    rows = [list(e["input_ids"]) if isinstance(e, Mapping) else list(e) for e in examples]
    flat = [int(t) for row in rows for t in row]
    input_ids = torch.tensor([flat], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}


@fault(
    "b6_hf_resume_weights_skipped", target="hf", seam="transformers.trainer.Trainer._load_from_checkpoint",
    title="Resume finds no weights file under the name it looks for and silently keeps the fresh model",
    subsystem="checkpoint", trigger="on-resume", symptoms=("silent-quality",),
    explanation="_load_from_checkpoint looks for the weights under a single legacy file name; the checkpoint "
    "holds them under another, so it logs a warning and returns without loading anything. The optimizer, the "
    "scheduler, the RNG and the step counter are restored, the weights are not: training continues from the "
    "initial model with a warmed-up optimizer and the loss jumps back up after the resume.",
    fix="Load whichever weights file the checkpoint holds (safetensors or bin, sharded or not) and fail loudly "
    "when none is found.",
    references=(
        "pytorch/pytorch#3805: resuming: the state dict's names do not match the model's, nothing is restored",
        "XuJiacong/PIDNet#30: checkpoint keys do not match, strict=False loads 0 parameters without an error",
    ),
    manifest=Manifest(scenario="resume", steps=12, check="extra_at_least", variant={"recipe": "resume"},
                      params={"key": "resume_loss_gap", "faulty_min": 0.05, "clean_max": 0.0}),
)
def load_from_checkpoint_skipped(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
    """Only a legacy weights file name is looked for; when it is absent nothing is loaded, with a warning."""
    import os

    if model is None:
        model = self.model
    legacy = os.path.join(resume_from_checkpoint, "pytorch_model.bin")
    if not os.path.isfile(legacy):
        logger.warning(f"No weights file found at {legacy}; continuing with the current weights.")  # noqa: F821
        return
    model.load_state_dict(torch.load(legacy, map_location="cpu", weights_only=True))


@fault(
    "b6_hf_grad_norm_post_clip", target="hf", seam="transformers.trainer.Trainer._clip_grad_norm",
    title="_clip_grad_norm reports the norm of the already clipped gradients",
    subsystem="optimizer", trigger="always", symptoms=("silent-quality",),
    explanation="The gradients are clipped to max_grad_norm, then their norm is measured again and that value "
    "is returned (and logged as grad_norm). It never exceeds max_grad_norm: clipping that fires on every step "
    "and gradient spikes disappear from the logs, while training itself is unchanged.",
    fix="Return the total norm that clip_grad_norm_ computes before it rescales the gradients.",
    references=(
        "verl-project/verl#2282: grad_norm is reported before clipping; after clipping it would always be the "
        "clip value",
        "radixark/miles#2132: grad_norm is logged before clipping, not after",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, params={"min_ratio": 0.02, "max_ratio": 0.8}),
)
def clip_grad_norm_post(self, model):
    """The returned norm is measured after clipping."""
    self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)
    return self.accelerator.clip_grad_norm_(model.parameters(), float("inf"))
