"""Blind set 9: faults written without reading the detectors, to score how the suite generalizes.

Each fault is the buggy body of one seam (of the reference, ``model/``, or of the HF target), modelled on a bug
engineers have shipped; its manifest is the proof that it shows against the clean run.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from faultbench.faults.registry import Manifest, fault
from faultbench.model.config import TrainConfig
from faultbench.model.data import IGNORE_INDEX

# ----------------------------------------------------------------------------------------------------------------
# reference target (model/)
# ----------------------------------------------------------------------------------------------------------------


@fault(
    "b9_01",
    seam="model.rope.position_ids_from_mask",
    title="Positions counted with a cumulative sum over the batch axis instead of the sequence axis",
    subsystem="position",
    also_acceptable=("collate", "model"),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="position_ids_from_mask takes attention_mask.cumsum(0): a token's 'position' is the number of real "
    "tokens in its column among the rows above it, not the number of real tokens before it in its own row. Shapes "
    "are unchanged and the values stay inside the RoPE table, so nothing fails; but positions now depend on the "
    "batch composition: the same prompt gets other rotations alone than inside a padded batch, and in training "
    "RoPE carries no information about the order of tokens.",
    fix="Count along the sequence: attention_mask.long().cumsum(-1) - 1.",
    references=(
        "HF transformers GPT-2/Llama generation: position_ids = attention_mask.long().cumsum(-1) - 1 (the axis is "
        "the sequence; cf. huggingface/transformers#7552 on positions of left-padded batches)",
        "seeds/000_8394dc57ef2ba1c4.txt: verify positional embeddings and assert tensor shapes/semantics of position ids",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "pad_logit_gap", "faulty_min": 1e-3, "clean_max": 1e-4}),
)
def positions_cumsum_batch_axis(attention_mask: torch.Tensor, past_len: int = 0) -> torch.Tensor:
    """The cumulative sum runs over dim 0 (rows), not over the sequence."""
    positions = attention_mask.long().cumsum(0) - 1  # (B, T_total)
    return positions.clamp_(min=0)[:, past_len:]


@fault(
    "b9_02",
    seam="model.attention.build_attention_mask",
    title="Causal mask not offset by the cache: decode queries are placed at the start of the sequence",
    subsystem="mask",
    also_acceptable=("model", "position"),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="build_attention_mask numbers the queries 0..T_q-1 instead of T_k-T_q..T_k-1. In training and in "
    "the prefill T_q == T_k and the mask is exact; in cached decoding (one query, T_k keys) the new token is "
    "treated as position 0 and may only attend to the first cached slot: generation ignores the prompt and "
    "cached logits no longer match a full forward of the same sequence.",
    fix="Offset the query positions by the cache length: arange(T_k - T_q, T_k).",
    references=(
        "huggingface/transformers _make_causal_mask(input_ids_shape, dtype, past_key_values_length): the causal "
        "mask of cached decoding must be shifted by the number of cached tokens",
        "Mikyx-1/TinyLLM#17: generate() produces garbage despite a low train loss because the cached path built "
        "the wrong mask",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "cached_logit_gap", "faulty_min": 1e-2, "clean_max": 1e-4}),
)
def mask_queries_not_offset(attention_mask: torch.Tensor, query_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The queries are numbered from 0, ignoring the keys already in the cache."""
    batch, key_len = attention_mask.shape
    if query_len == key_len and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        return None
    device = attention_mask.device
    query_pos = torch.arange(query_len, device=device)[:, None]  # (T_q, 1)
    key_pos = torch.arange(key_len, device=device)[None, :]  # (1, T_k)
    allowed = (key_pos <= query_pos) & attention_mask.bool()[:, None, :]  # (B, T_q, T_k)
    allowed |= key_pos == query_pos
    mask = torch.zeros(batch, 1, query_len, key_len, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


@fault(
    "b9_03",
    seam="model.gpt.GPT.init_weights",
    title="Init by parameter name: every '*weight', LayerNorm gains included, is drawn from N(0, init_std)",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="init_weights loops over named_parameters() and re-draws every tensor whose name ends in 'weight'. "
    "The LayerNorm gains (ln_1, ln_2, ln_f) are weights too, so they start near 0 (std 0.02) instead of 1: every "
    "normalized activation is ~50x too small, the blocks and the tied head see almost nothing, and the first "
    "steps are spent growing the gains back (no weight decay on them, but a tiny gradient signal).",
    fix="Initialize by module type: Linear/Embedding weights ~ N(0, std); LayerNorm weight = 1, bias = 0.",
    references=(
        "HF transformers PreTrainedModel._init_weights: norms are initialized separately (weight 1, bias 0) "
        "because a generic init over every 'weight' would zero them",
        "seeds/004_171ac7c3cf29993a.txt: check the initialization of every parameter group (norm gains at 1) before training",
    ),
    manifest=Manifest(check="loss_above", steps=40, params={"min_gap": 0.1}),
)
def init_by_param_name(self) -> None:
    """Every parameter named '*weight' (LayerNorm gains included) gets the normal init."""
    std = self.config.init_std
    for name, param in self.named_parameters():
        if name.endswith("weight"):
            nn.init.normal_(param, mean=0.0, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(param)
    for block in self.blocks:
        for proj in (block.attn.proj, block.mlp.proj):
            nn.init.normal_(proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))


@fault(
    "b9_04",
    seam="model.loss.lm_loss",
    title="Loss averaged per sequence, then over the batch: short documents weigh as much as long ones",
    subsystem="loss",
    also_acceptable=("eval",),
    trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="lm_loss computes each row's mean over its own targets and returns the mean of the rows. A "
    "3-token document then counts as much as a 60-token one: the tokens of short documents are up-weighted, the "
    "objective is no longer the corpus cross-entropy, num_targets is ignored (accumulation windows are no longer "
    "normalized as one batch) and the evaluation, which weights lm_loss by the token count, reports a number "
    "that is not nats per token.",
    fix="Sum the token losses over the whole batch and divide by the number of targets (of the window).",
    references=(
        "huggingface/transformers#34510: per-sequence vs per-token averaging of the causal-LM loss (the token "
        "mean is the semantics)",
        "imoneoi/openchat#182: per-sequence loss averaging made the model worse at long responses",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.05}),
)
def lm_loss_per_sequence(logits, labels, num_targets=None, ignore_index: int = IGNORE_INDEX):
    """Each row is averaged over its own targets; the batch loss is the mean of the rows."""
    shifted_logits = logits[:, :-1].float()  # (B, T-1, V)
    shifted_labels = labels[:, 1:]  # (B, T-1)
    per_token = F.cross_entropy(shifted_logits.transpose(1, 2), shifted_labels, ignore_index=ignore_index,
                                reduction="none")  # (B, T-1)
    counts = (shifted_labels != ignore_index).sum(-1).clamp(min=1)
    return (per_token.sum(-1) / counts).mean()


@fault(
    "b9_05",
    seam="model.optim.configure_optimizer",
    title="torch.optim.Adam given the weight_decay groups: L2 regularization instead of decoupled weight decay",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="configure_optimizer builds the same two parameter groups but hands them to torch.optim.Adam, "
    "whose weight_decay adds wd * w to the gradient before the adaptive normalization (L2), not AdamW's "
    "decoupled lr * wd * w shrink. With wd = 0.1 and weights of ~0.02 the penalty gradient is as large as the "
    "data gradient of most matrix entries, Adam normalizes it into full-size steps toward zero, and the matrices "
    "fight the decay the whole run: the loss falls more slowly and ends higher, with nothing in the logs to "
    "say why (the param groups still read weight_decay=0.1).",
    fix="torch.optim.AdamW (decoupled decay) for the same groups.",
    references=(
        "Loshchilov & Hutter, Decoupled Weight Decay Regularization (ICLR 2019): L2 in Adam is not weight decay",
        "PyTorch docs, torch.optim.Adam: 'weight_decay (float) - weight decay (L2 penalty)' vs torch.optim.AdamW",
    ),
    manifest=Manifest(check="loss_above", steps=100, params={"min_gap": 0.05}),
)
def configure_optimizer_adam_l2(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The groups go to Adam (coupled L2), not AdamW."""
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
    if cfg.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.Adam, lr=cfg.lr, betas=cfg.betas,
                                       eps=cfg.eps)
    return torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


@fault(
    "b9_06",
    seam="model.train.optimizer_step",
    title="optimizer.step() called directly instead of scaler.step(optimizer): overflowed fp16 steps are applied",
    subsystem="precision",
    also_acceptable=("optimizer",),
    trigger="amp-only",
    symptoms=("nan",),
    explanation="optimizer_step calls optimizer.step() and then scaler.update(). The gradients were unscaled "
    "(clip_gradients) and the scaler found the inf/NaN, so it still halves the scale and the step is even "
    "reported as skipped; but the optimizer already applied the non-finite gradients (clipping an infinite norm "
    "multiplies inf by 0). The first overflow of fp16 training, which the scaler exists to absorb, writes NaN "
    "into the weights and the loss is NaN from the next step on. bf16 and fp32 runs never overflow and are fine.",
    fix="scaler.step(optimizer): it skips optimizer.step() when the unscaled gradients hold infs or NaNs.",
    references=(
        "PyTorch AMP docs (Gradient Scaling): 'scaler.step() unscales the optimizer's gradients and skips "
        "optimizer.step() if the gradients contain infs or NaNs' (pytorch/pytorch#26512)",
        "IAHispano/Applio#860: optimizer.step() called next to scaler.step(), bypassing the scaler (NaN losses)",
    ),
    manifest=Manifest(check="nan", steps=6, variant={"train": {"precision": "fp16", "init_scale": 2.0**30}},
                      params={"by_step": 3}),
)
def optimizer_step_bypasses_scaler(optimizer, scaler, scheduler) -> bool:
    """The optimizer steps by itself; the scaler only updates its scale."""
    scale_before = scaler.get_scale()
    optimizer.step()
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return scaler.get_scale() < scale_before


@fault(
    "b9_07",
    seam="model.checkpoint.load_checkpoint",
    title="On a DDP resume every rank restores rank 0's RNG state: all replicas draw the same dropout masks",
    subsystem="checkpoint",
    also_acceptable=("distributed",),
    trigger="on-resume",
    symptoms=("silent-quality", "desync"),
    explanation="save_checkpoint gathers one RNG state per rank, but load_checkpoint restores state['rng'][0] on "
    "every rank (the single-process code path, where index 0 is the only entry). After the resume all ranks "
    "share rank 0's generator: their dropout masks are identical where they were independent before the save, "
    "so the resumed run is not the uninterrupted one and the replicas' noise is correlated from then on. Single-"
    "process resumes are exact, which is where resume was tested.",
    fix="Restore state['rng'][run.rank] (each rank its own state), and check the saved world size.",
    references=(
        "huggingface/transformers Trainer: RNG states are saved per process (rng_state_{process_index}.pth) "
        "because one shared file made every rank resume with process 0's generator",
        "seeds/000_8394dc57ef2ba1c4.txt: check checkpoint/resume logic and randomness/seed control (per-rank seeds under DDP)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="ddp_resume", steps=8, variant={"model": {"dropout": 0.1}},
                      params={"key": "resume_loss_diff", "faulty_min": 1e-4, "clean_max": 1e-6}),
)
def load_checkpoint_rank0_rng(run, directory) -> None:
    """Every rank restores the RNG state saved by rank 0."""
    directory = Path(directory)  # noqa: F821 (model.checkpoint's)
    meta = read_meta(directory)  # noqa: F821
    if meta.get("format") != FORMAT:  # noqa: F821
        raise CheckpointError(f"checkpoint format {meta.get('format')!r} is not supported (expected {FORMAT})")  # noqa: F821
    state_path = directory / "state.pt"
    if not state_path.exists():
        raise CheckpointError(f"checkpoint {directory} has no state.pt")  # noqa: F821
    if _sha256(state_path) != meta["sha256"]:  # noqa: F821
        raise CheckpointError(f"{state_path} is corrupted: its sha256 does not match meta.json")  # noqa: F821
    diffs = _config_mismatch(meta["config"], run.config.to_dict())  # noqa: F821
    if diffs:
        raise CheckpointError(f"checkpoint {directory} belongs to another config: " + "; ".join(diffs))  # noqa: F821
    if meta["tokenizer_sha256"] != run.tokenizer.sha256:
        raise CheckpointError(  # noqa: F821
            f"checkpoint {directory} was trained with another tokenizer (sha256 {meta['tokenizer_sha256'][:12]} "
            f"vs {run.tokenizer.sha256[:12]}); token ids would mean different things"
        )
    state = torch.load(state_path, map_location=run.config.train.device, weights_only=True)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.step = state["step"]
    run.history = [StepRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in state["history"]]  # noqa: F821
    restore_rng_state(state["rng"][0])  # noqa: F821


@fault(
    "b9_08",
    seam="model.distributed.wrap_model",
    title="DDP wrapper built but the bare module returned: training never goes through DDP and never syncs",
    subsystem="distributed",
    trigger="multi-rank",
    symptoms=("desync", "silent-quality"),
    explanation="wrap_model constructs DistributedDataParallel (which broadcasts rank 0's weights, so every "
    "replica starts identical and a first check passes) and registers the averaging hook, but returns the "
    "module it wrapped. The training step calls the bare module: DDP's forward never runs, its reducer never "
    "expects a backward, and no gradient is ever all-reduced. Each rank trains on its own shard alone: the "
    "replicas drift apart from the first step, the logged loss is an average of diverging models, and rank 0's "
    "checkpoint holds a model trained on half the data.",
    fix="Return the DDP wrapper and call it (not the inner module) in the training step.",
    references=(
        "PyTorch forums, 'DDP: gradients not synchronized across ranks': forward called on model instead of the "
        "DistributedDataParallel wrapper (ddp_model) skips the reducer",
        "PyTorch DDP notes: gradient synchronization is prepared in DistributedDataParallel.forward",
    ),
    manifest=Manifest(check="extra_at_least", scenario="ddp", steps=8,
                      params={"key": "rank_param_diff", "faulty_min": 1e-4, "clean_max": 1e-6}),
)
def wrap_model_returns_module(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """The DDP wrapper is built, then dropped: the bare module is returned."""
    if not is_distributed() or world_size() == 1:  # noqa: F821 (model.distributed's)
        return model
    device_ids = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)  # noqa: F821
    ddp.register_comm_hook(None, average_gradients_hook)  # noqa: F821
    return model


@fault(
    "b9_09",
    seam="model.sampler.ResumableSampler.next_indices",
    title="Epoch rollover off by one: the epoch's tail is served as one more, short (or empty) batch",
    subsystem="data",
    trigger="after-step",
    symptoms=("crash-shape",),
    explanation="next_indices rolls over to the next epoch only when position > batches_per_epoch, one batch late. "
    "At the end of every epoch it serves the leftover tail of the permutation as a batch of its own: a short "
    "batch (fewer documents than global_batch, and an uneven split across ranks) when the split does not divide "
    "evenly, and an empty list when it does, which makes the micro-batch split fail ('range() arg 3 must not be zero') "
    "after a whole epoch of clean training.",
    fix="Roll over when position == batches_per_epoch (drop the incomplete tail, as the docstring says).",
    references=(
        "pytorch/pytorch DistributedSampler / drop_last: the last incomplete batch of an epoch must be dropped or "
        "padded, or ranks see uneven batches",
        "seeds/000_8394dc57ef2ba1c4.txt: intermittent shape errors 'often only after the run has been going for a while'",
    ),
    manifest=Manifest(check="crash", steps=14,
                      variant={"data": {"num_docs": 200, "val_fraction": 0.25}, "train": {"batch_size": 13}},
                      params={"types": ("ValueError",), "min_step": 11}),
)
def next_indices_late_rollover(self) -> list[int]:
    """Rolls over one batch too late."""
    if self.position > self.batches_per_epoch:
        self.set_epoch(self.epoch + 1)
    per_rank = self.global_batch // self.world_size
    start = self.position * self.global_batch + self.rank * per_rank
    self.position += 1
    return self._order[start : start + per_rank].tolist()


@fault(
    "b9_10",
    seam="model.evaluate.evaluate",
    title="Validation loss divided by the input tokens of each batch, not by its predicted tokens",
    subsystem="eval",
    also_acceptable=("loss",),
    trigger="eval-only",
    symptoms=("eval-metric",),
    explanation="evaluate weights each batch by attention_mask.sum(), the number of real input tokens, instead of "
    "count_targets(labels). The summed cross-entropy is right, but the denominator counts every document's BOS "
    "(never a target: nothing predicts it) as a predicted token, one extra per document. With documents of ~11 "
    "tokens the reported validation loss is ~9% too low, below the corpus floor the model can never beat, and "
    "the train/val comparison is skewed in the model's favour. Training is untouched.",
    fix="Divide by the number of targets after the shift (count_targets), as the training loss does.",
    references=(
        "HF transformers docs, 'Perplexity of fixed-length models': the loss is averaged over the valid labels, "
        "and because the labels are shifted inside the model there is one valid label fewer per sequence than "
        "input tokens",
        "seeds/002_8cab73739bcbd185.txt: reproducibility and metric checks (a loss below the known floor is a bug, not progress)",
    ),
    manifest=Manifest(check="loss_below", steps=30, params={"min_gap": 0.15, "metric": "val"}),
)
def evaluate_per_input_token(model, docs, pad_id: int, batch_size: int, precision: str = "fp32",
                             pad_side: str = "right") -> float:
    """Each batch is weighted by its real input tokens (BOS included), not by its targets."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for i in range(0, len(docs), batch_size):
            batch = {k: v.to(device) for k, v in collate(docs[i : i + batch_size], pad_id, pad_side).items()}  # noqa: F821
            with autocast_context(precision, device.type):  # noqa: F821
                logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            n = int(batch["attention_mask"].sum())
            total += lm_loss(logits, batch["labels"], n).item() * n  # noqa: F821
            count += n
    finally:
        model.train(was_training)
    return total / count


# ----------------------------------------------------------------------------------------------------------------
# HF target (transformers + accelerate)
# ----------------------------------------------------------------------------------------------------------------

_LLAMA = "transformers.models.llama.modeling_llama"
_TRAINER = "transformers.trainer.Trainer"


@fault(
    "b9_11", target="hf", seam=f"{_LLAMA}.LlamaRotaryEmbedding.forward",
    title="Rotary cos/sin computed from the first row's position ids and broadcast to the whole batch",
    subsystem="position", also_acceptable=("model",), trigger="eval-only", symptoms=("silent-quality",),
    explanation="LlamaRotaryEmbedding.forward takes position_ids[:1] ('positions are the same for every row') and "
    "expands the tables over the batch. Training passes no position_ids (one arange shared by all rows) and is "
    "exact, but batched generation of left-padded prompts passes per-row positions from the attention mask: "
    "every row is rotated with the first row's positions, so the padded rows' tokens sit at wrong, non-uniform "
    "positions and a prompt decodes differently alone than in a batch.",
    fix="Use each row's own position_ids: position_ids[..., None] * inv_freq.",
    references=(
        "HF transformers LlamaRotaryEmbedding.forward: inv_freq is multiplied by each row's position_ids (batch, "
        "seq), so rows with different left padding get their own angles",
        "huggingface/transformers#7552: position ids of left-padded batches must come from the attention mask",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=16,
                      params={"key": "pad_logit_gap", "faulty_min": 1e-3, "clean_max": 1e-4}),
)
def rotary_first_row_positions(self, x, position_ids):
    """Row 0's positions are used for every row."""
    freqs = position_ids[:1, :, None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    freqs = freqs.expand(x.shape[0], -1, -1)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * self.attention_scaling
    sin = emb.sin() * self.attention_scaling

    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


@fault(
    "b9_12", target="hf", seam="transformers.modeling_utils.PreTrainedModel._init_weights",
    title="Norm gains initialized to zero (the (1 + weight) RMSNorm convention) in a model that multiplies by weight",
    subsystem="model", trigger="always", symptoms=("silent-quality", "stall"),
    explanation="_init_weights zeroes the weight of every *LayerNorm/*RMSNorm module, the right init for Gemma-style "
    "norms that scale by (1 + weight), but LlamaRMSNorm scales by weight itself. Every normalized activation is "
    "0 at step 0: attention and MLP inputs vanish, the final norm outputs zeros so the logits are uniform (loss "
    "= ln V), and the model has to grow its gains back from the tiny gradient that reaches them before it can "
    "learn anything. The run lags far behind the clean one.",
    fix="Initialize the gains to 1 for weight-scaled norms (zeros only where the forward uses 1 + weight).",
    references=(
        "google-deepmind/gemma and HF GemmaRMSNorm: output * (1.0 + self.weight) with zero-initialized weights, a "
        "convention that must not leak into LlamaRMSNorm (weight * output, initialized to ones)",
        "HF transformers PreTrainedModel._init_weights: norms are matched by class name ('RMSNorm'), so one "
        "rule covers every model's norms",
    ),
    manifest=Manifest(check="loss_above", steps=16, params={"min_gap": 0.2}),
)
def init_weights_norms_zero(self, module):
    """Every norm's gain is set to 0, whatever its forward does with it."""
    if hasattr(self.config, "initializer_range"):
        std = self.config.initializer_range or 0.02
    elif hasattr(self.config, "init_std"):
        std = self.config.init_std
    elif hasattr(self.config, "initializer_factor"):
        std = self.config.initializer_factor
    else:
        std = getattr(self.config.get_text_config(), "initializer_range", 0.02)

    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d)):
        if getattr(module, "weight", None) is not None:
            init.normal_(module.weight, mean=0.0, std=std)  # noqa: F821 (transformers.modeling_utils')
        if module.bias is not None:
            init.zeros_(module.bias)  # noqa: F821
    elif isinstance(module, nn.LSTM):
        for name, param in module.named_parameters():
            if "weight" in name:
                init.xavier_uniform_(param)  # noqa: F821
            elif "bias" in name:
                init.constant_(param, 0.0)  # noqa: F821
    elif isinstance(module, nn.Embedding):
        init.normal_(module.weight, mean=0.0, std=std)  # noqa: F821
        if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
            init.zeros_(module.weight[module.padding_idx])  # noqa: F821
    elif isinstance(module, nn.MultiheadAttention):
        module._reset_parameters()
    elif (
        isinstance(module, (nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))
        or "LayerNorm" in module.__class__.__name__
        or "RMSNorm" in module.__class__.__name__
    ):
        if getattr(module, "weight", None) is not None:
            init.zeros_(module.weight)  # noqa: F821
        if getattr(module, "bias", None) is not None:
            init.zeros_(module.bias)  # noqa: F821
        if getattr(module, "running_mean", None) is not None:
            init.zeros_(module.running_mean)  # noqa: F821
            init.ones_(module.running_var)  # noqa: F821
            init.zeros_(module.num_batches_tracked)  # noqa: F821
    elif "RotaryEmbedding" in module.__class__.__name__ and hasattr(module, "original_inv_freq"):
        rope_init_fn_with_self = {
            "axial": getattr(module, "compute_axial_rope_parameters", None),
            "ntk_alpha": getattr(module, "compute_ntk_alpha_rope_parameters", None),
            "default": getattr(module, "compute_default_rope_parameters", None),
            **ROPE_INIT_FUNCTIONS,  # noqa: F821
        }
        rope_fn = rope_init_fn_with_self[module.rope_type]
        buffer_value, _ = rope_fn(module.config)
        init.copy_(module.inv_freq, buffer_value)  # noqa: F821
        init.copy_(module.original_inv_freq, buffer_value)  # noqa: F821


@fault(
    "b9_13", target="hf", seam="transformers.loss.loss_utils.ForCausalLMLoss",
    title="Labels padded with F.pad's default value 0 before the shift: the last position of every row targets token 0",
    subsystem="loss", also_acceptable=("collate",), trigger="always", symptoms=("silent-quality", "eval-metric"),
    explanation="ForCausalLMLoss shifts by padding the labels with one column on the right, but the pad value is "
    "left at nn.functional.pad's default, 0, instead of ignore_index. Token id 0 is <pad> here, so every row's "
    "last position gets the target '<pad>' (after an EOS, or after a pad) that the collator would have "
    "ignored: one spurious target per row that num_items_in_batch does not count. The train and eval losses "
    "include B extra terms divided by the real target count, the model is pushed to predict padding, and the "
    "reported numbers are no longer the cross-entropy of the documents.",
    fix="nn.functional.pad(labels, (0, 1), value=ignore_index).",
    references=(
        "PyTorch docs, torch.nn.functional.pad: 'value: fill value for constant padding. Default: 0'",
        "huggingface/transformers#46204: the causal-LM loss shifts the labels by padding them with ignore_index "
        "(count and shift must agree)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 0.05}),
)
def forcausallmloss_pad_zero(logits, labels, vocab_size: int, num_items_in_batch: torch.Tensor | None = None,
                             ignore_index: int = -100, shift_labels: torch.Tensor | None = None, **kwargs):
    """The shift pads the labels with 0 (a real token id), not ignore_index."""
    logits = logits.float()

    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1))
        shift_labels = labels[..., 1:].contiguous()

    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(logits.device)
    loss = fixed_cross_entropy(logits, shift_labels, num_items_in_batch, ignore_index, **kwargs)  # noqa: F821
    return loss


@fault(
    "b9_14", target="hf", seam="transformers.optimization._get_cosine_schedule_with_warmup_lr_lambda",
    title="Cosine progress measured over all training steps, warmup included: the LR never anneals",
    subsystem="optimizer", trigger="after-step", symptoms=("silent-quality",),
    explanation="The decay's progress is (step - warmup) / num_training_steps instead of / (num_training_steps - "
    "warmup). Warmup is exact, but the cosine only reaches cos(pi * (1 - warmup/total)) by the last step: with "
    "half the run in warmup the run ends at ~60% of the peak LR instead of ~0, never annealing, and the last "
    "steps are as noisy as the middle ones.",
    fix="Divide by max(1, num_training_steps - num_warmup_steps).",
    references=(
        "karpathy/nanoGPT get_lr: decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters) (the "
        "warmup is subtracted from the denominator too)",
        "HF transformers get_cosine_schedule_with_warmup docs: the LR decreases to 0 at num_training_steps",
    ),
    manifest=Manifest(check="lr_ratio", steps=16, params={"min_ratio": 3.0, "max_ratio": 1000.0, "step": 15}),
)
def cosine_progress_over_total(current_step: int, *, num_warmup_steps: int, num_training_steps: int,
                               num_cycles: float, min_lr_rate: float = 0.0):
    """The cosine's progress divides by the total step count."""
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    factor = factor * (1 - min_lr_rate) + min_lr_rate
    return max(0, factor)


@fault(
    "b9_15", target="hf", seam=f"{_TRAINER}._load_from_checkpoint",
    title="Resume loads the checkpoint's weights into model.base_model with strict=False: no key matches, nothing loads",
    subsystem="checkpoint", trigger="on-resume", symptoms=("silent-quality",),
    explanation="_load_from_checkpoint loads the saved state dict into model.base_model (the decoder inside "
    "LlamaForCausalLM) non-strictly. The saved keys are the full model's ('model.layers.0...', 'lm_head.weight') "
    "while the base model's are 'layers.0...': every key is unexpected or missing, strict=False turns that into "
    "a log line below the run's log level, and the resumed run continues from freshly initialized weights with "
    "the restored optimizer moments, schedule and data position. The loss jumps back up at the resume.",
    fix="Load into the model the checkpoint was saved from (model.load_state_dict(state_dict)), strictly, or fail "
    "when any key is missing or unexpected.",
    references=(
        "salesforce/LAVIS#153: resume fixed by load_state_dict(strict=False) on the unwrapped model; the reply notes "
        "users are no longer alerted when the checkpoint and the model do not match",
        "mosaicml/composer#2216: 'Change state dict loading default to strict' to prevent silent failures to load "
        "the model correctly",
    ),
    manifest=Manifest(check="extra_at_least", scenario="resume", steps=12,
                      params={"key": "resume_loss_gap", "faulty_min": 0.1, "clean_max": 1e-6}),
)
def load_from_checkpoint_into_base_model(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
    """The decoder's state dict is loaded into the base model, non-strictly: no key matches."""
    if model is None:
        model = self.model

    config_file = os.path.join(resume_from_checkpoint, CONFIG_NAME)
    adapter_weights_file = os.path.join(resume_from_checkpoint, ADAPTER_WEIGHTS_NAME)
    adapter_safe_weights_file = os.path.join(resume_from_checkpoint, ADAPTER_SAFE_WEIGHTS_NAME)
    weights_file = os.path.join(resume_from_checkpoint, WEIGHTS_NAME)
    weights_index_file = os.path.join(resume_from_checkpoint, WEIGHTS_INDEX_NAME)
    safe_weights_file = os.path.join(resume_from_checkpoint, SAFE_WEIGHTS_NAME)
    safe_weights_index_file = os.path.join(resume_from_checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    is_fsdp_ckpt = os.path.isdir(resume_from_checkpoint) and (
        # this checks the FSDP state dict when `SHARDED_STATE_DICT` is used
        any(
            FSDP_MODEL_NAME in folder_name
            for folder_name in os.listdir(resume_from_checkpoint)
            if os.path.isdir(os.path.join(resume_from_checkpoint, folder_name))
        )
        # this checks the FSDP state dict when `FULL_STATE_DICT` is used
        or os.path.isfile(os.path.join(resume_from_checkpoint, f"{FSDP_MODEL_NAME}.bin"))
    )
    # if multiple adapters exist, they get saved in sub directories
    adapter_subdirs = (
        [
            folder_name
            for folder_name in os.listdir(resume_from_checkpoint)
            if os.path.isdir(os.path.join(resume_from_checkpoint, folder_name))
            and (
                os.path.isfile(os.path.join(resume_from_checkpoint, folder_name, ADAPTER_WEIGHTS_NAME))
                or os.path.isfile(os.path.join(resume_from_checkpoint, folder_name, ADAPTER_SAFE_WEIGHTS_NAME))
            )
        ]
        if os.path.isdir(resume_from_checkpoint)
        else []
    )

    if is_fsdp_ckpt and not self.is_fsdp_enabled:
        raise ValueError(f"Checkpoint found at {resume_from_checkpoint} is only supported when using PyTorch FSDP")

    if not (
        any(
            os.path.isfile(f)
            for f in [
                weights_file,
                safe_weights_file,
                weights_index_file,
                safe_weights_index_file,
                adapter_weights_file,
                adapter_safe_weights_file,
            ]
        )
        or is_fsdp_ckpt
        or adapter_subdirs
    ):
        raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}")

    logger.info(f"Loading model from {resume_from_checkpoint}.")

    if os.path.isfile(config_file):
        config = PreTrainedConfig.from_json_file(config_file)
        checkpoint_version = config.transformers_version
        if checkpoint_version is not None and checkpoint_version != __version__:
            logger.warning(
                f"You are resuming training from a checkpoint trained with {checkpoint_version} of "
                f"Transformers but your current version is {__version__}. This is not recommended and could "
                "yield to errors or unwanted behaviors."
            )

    if os.path.isfile(weights_file) or os.path.isfile(safe_weights_file) or is_fsdp_ckpt:
        # If the model is on the GPU, it still works!
        if is_sagemaker_mp_enabled():
            smp.resume_from_checkpoint(
                path=resume_from_checkpoint, tag=WEIGHTS_NAME, partial=False, load_optimizer=False
            )
        elif self.is_fsdp_enabled:
            load_fsdp_model(
                self.accelerator.state.fsdp_plugin,
                self.accelerator,
                model,
                resume_from_checkpoint,
                **get_fsdp_ckpt_kwargs(),
            )
        else:
            # We load the model state dict on the CPU to avoid an OOM error.
            if os.path.isfile(safe_weights_file):
                state_dict = safetensors.torch.load_file(safe_weights_file, device="cpu")
            else:
                check_torch_load_is_safe()
                state_dict = torch.load(weights_file, map_location="cpu", weights_only=True)

            # workaround for FSDP bug https://github.com/pytorch/pytorch/issues/82963
            # which takes *args instead of **kwargs
            load_result = model.base_model.load_state_dict(state_dict, False)
            # release memory
            del state_dict
            self._issue_warnings_after_load(load_result)

    # Load adapters following PR # 24096
    elif _is_peft_model(model):
        # If training a model using PEFT, assume that adapter have been saved properly.
        if hasattr(model, "active_adapters") and hasattr(model, "load_adapter"):
            if os.path.exists(resume_from_checkpoint):
                active_adapters = model.active_adapters
                if len(active_adapters) > 1:
                    logger.warning("Multiple active adapters detected will only consider the first adapter")
                active_adapter = active_adapters[0]

                if adapter_subdirs:
                    if os.path.exists(adapter_weights_file) or os.path.exists(adapter_safe_weights_file):
                        model.load_adapter(
                            resume_from_checkpoint, "default", is_trainable=(active_adapter == "default")
                        )
                    for subdir_name in adapter_subdirs:
                        peft_id = os.path.join(resume_from_checkpoint, subdir_name)
                        model.load_adapter(peft_id, subdir_name, is_trainable=(subdir_name == active_adapter))
                    model.set_adapter(active_adapter)
                else:
                    model.load_adapter(resume_from_checkpoint, active_adapter, is_trainable=True)
            else:
                logger.warning(
                    "The intermediate checkpoints of PEFT may not be saved correctly, "
                    f"consider using a custom callback to save {ADAPTER_WEIGHTS_NAME} in corresponding saving folders. "
                    "Check some examples here: https://github.com/huggingface/peft/issues/96"
                )
        else:
            logger.warning(f"Could not load adapter model, make sure to have PEFT >= {MIN_PEFT_VERSION} installed")
    else:
        # We load the sharded checkpoint
        load_result = load_sharded_checkpoint(model, resume_from_checkpoint, strict=is_sagemaker_mp_enabled())
        if not is_sagemaker_mp_enabled():
            self._issue_warnings_after_load(load_result)


@fault(
    "b9_16", target="hf", seam="accelerate.utils.operations.gather",
    title="gather only gathers under MULTI_GPU: on a CPU (gloo) process group it returns the local tensor",
    subsystem="distributed", also_acceptable=("loss", "eval"), trigger="multi-rank",
    symptoms=("silent-quality", "eval-metric"),
    explanation="gather tests distributed_type == MULTI_GPU instead of membership in the torch-distributed types, so "
    "under MULTI_CPU (gloo) it silently returns this rank's tensor. Trainer gathers num_items_in_batch across "
    "ranks (average_tokens_across_devices) and multiplies the loss by the world size: with the local count each "
    "rank's loss is its own token mean times 2, DDP averages, and the gradient is ~2x the true mean (the logged "
    "loss too). Evaluation's gathered losses cover rank 0's shard only. Nothing fails and one-process runs are "
    "exact.",
    fix="Gather whenever the state is any torch.distributed type (TORCH_DISTRIBUTED_OPERATION_TYPES), CPU included.",
    references=(
        "huggingface/transformers#34373: 'enable average tokens across devices' (num_items_in_batch gathered across "
        "processes, loss multiplied by world_size)",
        "huggingface/accelerate#575: gather_for_metrics wrongly computes metrics in distributed setup",
    ),
    manifest=Manifest(check="grad_norm_ratio", scenario="ddp", steps=4,
                      params={"min_ratio": 1.5, "max_ratio": 3.0}),
)
def gather_only_multi_gpu(tensor):
    """Only MULTI_GPU gathers: a gloo/CPU process group gets the local tensor back."""
    if PartialState().distributed_type == DistributedType.XLA:
        return _tpu_gather(tensor)
    elif PartialState().distributed_type == DistributedType.MULTI_GPU:
        return _gpu_gather(tensor)
    else:
        return tensor


@fault(
    "b9_17", target="hf", seam=f"{_TRAINER}.prediction_step",
    title="Evaluation forward passes input_ids and labels only: the attention_mask is dropped",
    subsystem="eval", also_acceptable=("mask",), trigger="eval-only", symptoms=("eval-metric",),
    explanation="prediction_step rebuilds the inputs as {input_ids, labels} before compute_loss ('the loss only "
    "needs those'). Training still gets the mask. With right padding nothing changes (pads come after every real "
    "token and their labels are ignored), but with left padding every real token of the evaluation attends to "
    "the pads before it: the eval loss measures another model than the one trained, and changes with the "
    "padding of the batch.",
    fix="Forward the whole batch (attention_mask included) in evaluation, exactly as in training.",
    references=(
        "HF transformers warning 'We strongly recommend passing in an `attention_mask` since your input_ids may "
        "be padded' (modeling_utils.warn_if_padding_and_no_attention_mask)",
        "seeds/000_8394dc57ef2ba1c4.txt: verify attention masks (causal vs padding) in every code path, evaluation included",
    ),
    manifest=Manifest(check="metric_differs", steps=16, variant={"recipe": "left_pad"}, params={"min_gap": 0.02}),
)
def prediction_step_without_mask(
    self,
    model: nn.Module,
    inputs: dict[str, torch.Tensor | Any],
    prediction_loss_only: bool,
    ignore_keys: list[str] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The evaluation forward gets input_ids and labels only: no attention_mask."""
    has_labels = False if len(self.label_names) == 0 else all(inputs.get(k) is not None for k in self.label_names)
    # For CLIP-like models capable of returning loss values.
    # If `return_loss` is not specified or being `None` in `inputs`, we check if the default value of `return_loss`
    # is `True` in `model.forward`.
    return_loss = inputs.get("return_loss")
    if return_loss is None:
        return_loss = self.can_return_loss
    loss_without_labels = len(self.label_names) == 0 and return_loss

    inputs = self._prepare_inputs(inputs)
    if ignore_keys is None:
        if hasattr(self.model, "config"):
            ignore_keys = getattr(self.model.config, "keys_to_ignore_at_inference", ["past_key_values"])
        else:
            ignore_keys = []

    # labels may be popped when computing the loss (label smoothing for instance) so we grab them first.
    if has_labels or loss_without_labels:
        labels = nested_detach(tuple(inputs.get(name) for name in self.label_names))
        if len(labels) == 1:
            labels = labels[0]
    else:
        labels = None

    with torch.no_grad():
        if is_sagemaker_mp_enabled():
            raw_outputs = smp_forward_only(model, inputs)
            if has_labels or loss_without_labels:
                if isinstance(raw_outputs, dict):
                    loss_mb = raw_outputs["loss"]
                    logits_mb = tuple(v for k, v in raw_outputs.items() if k not in ignore_keys + ["loss"])
                else:
                    loss_mb = raw_outputs[0]
                    logits_mb = raw_outputs[1:]

                loss = loss_mb.reduce_mean().detach().cpu()
                logits = smp_nested_concat(logits_mb)
            else:
                loss = None
                if isinstance(raw_outputs, dict):
                    logits_mb = tuple(v for k, v in raw_outputs.items() if k not in ignore_keys)
                else:
                    logits_mb = raw_outputs
                logits = smp_nested_concat(logits_mb)
        else:
            if has_labels or loss_without_labels:
                # Count before sharding: `context_parallel` splits the buffers in place.
                num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
                cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)
                inputs = {"input_ids": inputs["input_ids"], "labels": inputs["labels"]}
                with self.compute_loss_context_manager(), cp_context():
                    if self.args.use_liger_kernel and prediction_loss_only:
                        inputs = {**inputs, "skip_logits": True}
                    loss, outputs = self.compute_loss(
                        model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
                    )
                loss = loss.detach().mean()

                if isinstance(outputs, dict):
                    logits = tuple(v for k, v in outputs.items() if k not in ignore_keys + ["loss"])
                else:
                    logits = outputs[1:]
            else:
                loss = None
                with self.compute_loss_context_manager():
                    outputs = model(**inputs)
                if isinstance(outputs, dict):
                    logits = tuple(v for k, v in outputs.items() if k not in ignore_keys)
                else:
                    logits = outputs

    if prediction_loss_only:
        return (loss, None, None)

    logits = nested_detach(logits)
    if len(logits) == 1:
        logits = logits[0]

    return (loss, logits, labels)
