"""The second blind set: faults modelled on real bug threads, written without reading the detectors.

`make bench-blind BLIND=blind2` scores the suite on these alone (see README.md next to this file). Every id starts
with ``blind2_``; the first part breaks the reference stack (``model/``), the second transformers' Llama under
``Trainer`` (``target="hf"``), each HF fault being the buggy body of the transformers/accelerate function it names.
A fault body runs spliced into its seam's module: the names it does not import are that module's globals.
"""
# ruff: noqa: F821, E501

import torch

from faultbench.faults.registry import Manifest, fault
from faultbench.model.data import IGNORE_INDEX

_LEFT = {"data": {"pad_side": "left"}}
_SMALL_EPOCH = {"data": {"num_docs": 200, "val_fraction": 0.25}}

# ================================================================================================================
# The reference stack (model/)
# ================================================================================================================


@fault(
    "blind2_adam_coupled_weight_decay",
    seam="model.optim.configure_optimizer",
    title="Optimizer built as torch.optim.Adam with weight_decay in the groups: L2 added to the gradient, not AdamW's decay",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="configure_optimizer keeps the two parameter groups but constructs torch.optim.Adam instead of AdamW. "
    "Adam's weight_decay is an L2 term added to the gradient before the moment estimates, so the decay is divided by "
    "sqrt(v) like any gradient: weights with small gradients are decayed hard, weights with large gradients barely. "
    "The run trains and looks ordinary; the regularization is simply not the one the recipe's weight_decay means.",
    fix="torch.optim.AdamW (decoupled decay), also as ZeroRedundancyOptimizer's optimizer_class.",
    references=(
        "https://github.com/pytorch/pytorch/pull/41679 (Adam's weight_decay is L2 regularization, not decoupled "
        "weight decay; documented after user confusion, #41477)",
        "https://github.com/pytorch/pytorch/pull/21250 (AdamW added because Adam + L2 is not weight decay)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 1e-4}),
)
def configure_optimizer_adam_l2(model, cfg):
    """Adam with coupled (L2) weight decay instead of AdamW."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():  # each shared (tied) parameter appears once
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imports TorchScript; only when used

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.Adam, lr=cfg.lr, betas=cfg.betas,
                                       eps=cfg.eps)
    return torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


@fault(
    "blind2_scheduler_stepped_before_optimizer",
    seam="model.train.optimizer_step",
    title="scheduler.step() called before the optimizer step: every update runs one schedule step ahead of the logged LR",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="optimizer_step advances the LambdaLR before scaler.step(optimizer) (the pre-PyTorch-1.1 order). The "
    "first value of the schedule is never used and each update runs at lr_at(step + 1), while the step record "
    "reads the learning rate before the step and logs lr_at(step): during warmup every update is larger than the "
    "logged one, and the logged schedule is not the one that trained the model.",
    fix="scaler.step(optimizer), scaler.update(), then scheduler.step().",
    references=(
        "https://github.com/facebookresearch/ParlAI/issues/2042 (lr_scheduler.step() before optimizer.step(): "
        "PyTorch skips the first value of the schedule)",
        "https://github.com/ThilinaRajapakse/pytorch-transformers-classification/issues/21",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 1e-4}),
)
def optimizer_step_scheduler_first(optimizer, scaler, scheduler) -> bool:
    """The schedule is advanced before the update it should govern."""
    scale_before = scaler.get_scale()
    scheduler.step()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return scaler.get_scale() < scale_before


@fault(
    "blind2_loss_cross_entropy_in_bf16",
    seam="model.loss.lm_loss",
    title="lm_loss feeds the autocast logits to cross_entropy without upcasting: under bf16 the loss is summed in bf16",
    subsystem="precision",
    also_acceptable=("loss",),
    trigger="amp-only",
    symptoms=("eval-metric", "silent-quality"),
    explanation="The .float() on the shifted logits was dropped ('the loss runs under autocast anyway'), but "
    "forward_loss and evaluate call lm_loss outside the autocast context: with bf16 the logits are bf16, the "
    "log-softmax and the summed cross-entropy are bf16, and a sum of hundreds of token losses is rounded to bf16's "
    "8-bit mantissa (steps of 2-8 nats) before the division. The training gradient and the reported train and "
    "validation losses are quantized; fp32 runs are unaffected.",
    fix="shifted_logits = logits[:, :-1].float(): compute the cross-entropy in fp32.",
    references=(
        "https://github.com/Modalities/modalities/pull/464 (causal-LM cross-entropy computed on bf16 logits; the "
        "loss scalar quantized to bf16's grid; fixed by upcasting as torchtitan does)",
        "https://github.com/google-deepmind/optax/issues/1020 (loss values quantized when logits are bf16)",
    ),
    manifest=Manifest(check="metric_differs", steps=20, variant={"train": {"precision": "bf16"}},
                      params={"min_gap": 1e-3}),
)
def lm_loss_bf16(logits, labels, num_targets=None, ignore_index: int = IGNORE_INDEX):
    """Cross-entropy in the logits' dtype."""
    shifted_logits = logits[:, :-1]  # (B, T-1, V)
    shifted_labels = labels[:, 1:]  # (B, T-1)
    total = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
        ignore_index=ignore_index, reduction="sum",
    )
    if num_targets is None:
        num_targets = count_targets(labels, ignore_index)
    return total / max(num_targets, 1)


@fault(
    "blind2_attention_mask_cached_by_shape",
    seam="model.gpt.GPT.forward",
    title="The additive attention mask is memoized per (batch, length): a later batch of the same shape gets an old padding mask",
    subsystem="mask",
    also_acceptable=("model",),
    trigger="rare-batch",
    symptoms=("silent-quality",),
    explanation="To avoid rebuilding the mask every forward, GPT.forward caches build_attention_mask's result in a "
    "dict keyed by the attention_mask's shape, the cache length and the dtype. The causal part only depends on "
    "the shape, but the padding part depends on which positions are pads: whenever a batch has the same (B, T) as "
    "an earlier one (frequent: long documents make T = seq_len), it is masked with the earlier batch's padding. "
    "Under left padding real tokens then attend to pads or lose real context; right-padded runs return no mask and "
    "are unaffected.",
    fix="Cache only what depends on the shape (the causal triangle) and combine it with each batch's padding mask, "
    "or key the cache on the mask's content.",
    references=(
        "https://github.com/NVIDIA/Model-Optimizer/pull/1343 (cached attention masks keyed without all the inputs "
        "they depend on: a stale mask is reused for a later call)",
        "https://github.com/NVIDIA-NeMo/Automodel/pull/2982 (FlexAttention masks cached by geometry; key had to "
        "cover every input of the mask)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, variant=_LEFT, params={"min_gap": 1e-3}),
)
def gpt_forward_mask_cached(self, input_ids, attention_mask=None, position_ids=None, cache=None):
    """The padding mask of the first batch of each shape is reused."""
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
    if not hasattr(self, "_mask_cache"):
        self._mask_cache = {}
    key = (tuple(attention_mask.shape), past_len, _compute_dtype(x))
    if key not in self._mask_cache:
        self._mask_cache[key] = build_attention_mask(attention_mask, T, _compute_dtype(x))
    attn_mask = self._mask_cache[key]
    rope = rope_at(self.rope_cos, self.rope_sin, position_ids)
    for i, block in enumerate(self.blocks):
        x = block(x, rope, attn_mask, cache, i)
    return self.lm_head(self.ln_f(x))  # (B, T, vocab)


@fault(
    "blind2_bos_label_masked_by_column",
    seam="model.data.collate",
    title="collate ignores the label of column 0 instead of each row's first real token: under left padding BOS becomes a target",
    subsystem="collate",
    trigger="rare-batch",
    symptoms=("silent-quality", "eval-metric"),
    explanation="collate copies every real token into labels and then sets labels[:, 0] = ignore_index 'because BOS "
    "is never a target'. With right padding column 0 is BOS and nothing changes; with left padding column 0 is a "
    "pad (already ignored) and each padded row's BOS, sitting at column T - n, stays a label: the model is trained "
    "(and evaluated) on predicting BOS from a pad, an easy extra target per padded row that lowers the reported "
    "loss and changes the target count.",
    fix="Ignore the label at each row's first real position (start), not at column 0.",
    references=(
        "https://github.com/QwenLM/Qwen3-ASR/pull/212 (label masking by tensor column instead of position among "
        "real tokens: wrong tokens kept in the loss under left padding)",
        "https://github.com/mlfoundations/open_flamingo/issues/233 (labels[:, 0] = -100 assumed the first column "
        "holds the prepended special token)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, variant=_LEFT, params={"min_gap": 1e-3}),
)
def collate_bos_by_column(docs, pad_id: int, pad_side: str = "right", ignore_index: int = IGNORE_INDEX) -> dict:
    """BOS masked at column 0 of the padded batch."""
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
    B, T = len(docs), max(len(d) for d in docs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), ignore_index, dtype=torch.long)
    for row, ids in enumerate(docs):
        n = len(ids)
        start = 0 if pad_side == "right" else T - n
        tokens = torch.as_tensor(ids, dtype=torch.long)
        input_ids[row, start : start + n] = tokens
        attention_mask[row, start : start + n] = 1
        labels[row, start : start + n] = tokens
    labels[:, 0] = ignore_index  # BOS is never a target
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "labels": labels,
    }


@fault(
    "blind2_logged_loss_is_rank0s",
    seam="model.distributed.mean_over_ranks",
    title="The logged step loss is broadcast from rank 0 instead of averaged: every rank reports rank 0's local loss",
    subsystem="distributed",
    trigger="multi-rank",
    symptoms=("eval-metric",),
    explanation="mean_over_ranks broadcasts rank 0's value so that 'all ranks log the same number' and returns it "
    "undivided. Training is unaffected (gradients are averaged by DDP), but the loss curve is the loss of one "
    "rank's shard of each global batch, not the global batch's: noisier, biased by the shard's lengths, and not "
    "comparable with a single-process run of the same global batch.",
    fix="all_reduce (SUM) the value and divide by the world size.",
    references=(
        "https://github.com/huggingface/transformers/pull/13681 (Trainer showed only the first worker's loss in "
        "distributed training; fixed to average over all workers)",
        "https://github.com/snowflakedb/ArcticTraining/issues/62 (loss has to be averaged across ranks before it "
        "is logged)",
    ),
    # the reported per-step loss is what changes (benchmarks/blind2/test_manifest.py compares the step records)
    manifest=Manifest(check="metric_differs", scenario="ddp", steps=8, params={"min_gap": 0.0}),
)
def mean_over_ranks_broadcast(value: float, device: str = "cpu") -> float:
    """Rank 0's value, for everyone."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t)


@fault(
    "blind2_resume_restores_rank0_rng_everywhere",
    seam="model.checkpoint.load_checkpoint",
    title="On resume every rank restores rank 0's RNG state: after it, all ranks draw the same dropout masks",
    subsystem="checkpoint",
    also_acceptable=("distributed",),
    trigger="on-resume",
    symptoms=("silent-quality",),
    explanation="The checkpoint holds one RNG state per rank, but load_checkpoint restores state['rng'][0] on every "
    "rank. Before the save each rank drew its own dropout masks (rank_seed); after the resume all ranks share rank "
    "0's generator, so their dropout noise is identical and the data-parallel replicas no longer sample independent "
    "masks: the resumed run differs from the uninterrupted one although every tensor was 'restored'.",
    fix="restore_rng_state(state['rng'][run.rank]).",
    references=(
        "https://github.com/NVIDIA/Megatron-LM/pull/6858 (load_checkpoint restored another rank's RNG state on most "
        "ranks; the per-rank independence of the streams was lost after resume)",
        "https://github.com/radixark/miles/pull/3187 (checkpoints saved rank 0's RNG state and restored it on every "
        "rank, changing dropout after resume)",
        "https://github.com/TensorAuto/OpenTau/pull/180 (a consolidated RNG file loaded by all ranks gives them "
        "identical RNG state)",
    ),
    manifest=Manifest(check="metric_differs", scenario="ddp_resume", steps=8, variant={"model": {"dropout": 0.1}},
                      params={"metric": "resume_loss_diff", "min_gap": 1e-6}),
)
def load_checkpoint_rank0_rng(run, directory) -> None:
    """Every rank takes rank 0's RNG state."""
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
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.step = state["step"]
    run.history = [StepRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in state["history"]]
    restore_rng_state(state["rng"][0])


@fault(
    "blind2_checkpoint_saves_ddp_wrapper_state",
    seam="model.checkpoint.save_checkpoint",
    title="The checkpoint stores the state_dict of the training model (the DDP wrapper): keys carry 'module.' and resume fails",
    subsystem="checkpoint",
    also_acceptable=("distributed",),
    trigger="on-resume",
    symptoms=("crash-state",),
    explanation="save_checkpoint writes run.train_model.state_dict(), the model the step trains. Single-process that "
    "is the model itself; under DDP it is the DistributedDataParallel wrapper, whose keys are prefixed 'module.'. "
    "The save succeeds, but load_checkpoint loads into the bare model and raises on missing and unexpected keys: "
    "every data-parallel run dies at its first resume, long after the checkpoint was written.",
    fix="Save run.model.state_dict() (the unwrapped module), or strip the 'module.' prefix.",
    references=(
        "https://github.com/pytorch/pytorch/issues/3805 (unexpected key 'module.features...' when resuming from a "
        "state_dict saved from a DataParallel-wrapped model)",
        "https://github.com/facebookresearch/fairchem/pull/76 (loading a DDP-trained checkpoint: module. prefix)",
    ),
    manifest=Manifest(check="crash", scenario="ddp_resume", steps=8, params={"types": ["RuntimeError", "RankFailure"]}),
)
def save_checkpoint_wrapper_state(run, directory):
    """The wrapper's state_dict is saved."""
    directory = Path(directory)
    if hasattr(run.optimizer, "consolidate_state_dict"):  # ZeRO: each rank holds one shard
        run.optimizer.consolidate_state_dict(to=0)
    rng_states = _gather_rng_states(run)
    if run.rank == 0:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        state = {
            "model": run.train_model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "scaler": run.scaler.state_dict(),
            "sampler": run.sampler.state_dict(),
            "step": run.step,
            "history": [r.to_dict() for r in run.history],
            "rng": rng_states,
        }
        torch.save(state, tmp / "state.pt")
        meta = {
            "format": FORMAT,
            "step": run.step,
            "world_size": run.world_size,
            "sha256": _sha256(tmp / "state.pt"),
            "config": run.config.to_dict(),
            "tokenizer_sha256": run.tokenizer.sha256,
            "torch_version": torch.__version__,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
        if directory.exists():
            directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    if run.world_size > 1:
        dist.barrier()  # no rank goes on (and maybe loads) before the checkpoint exists
    return directory


@fault(
    "blind2_sampler_serves_short_last_batch",
    seam="model.sampler.ResumableSampler.next_indices",
    title="The epoch rolls over one batch late: the incomplete last batch of every epoch is served as a step",
    subsystem="data",
    trigger="rare-batch",
    symptoms=("silent-quality",),
    explanation="next_indices rolls over when position > batches_per_epoch instead of ==, so once per epoch it serves "
    "the slice past the last full batch: the leftover documents (fewer than a global batch, unevenly split across "
    "ranks and micro-batches, an accumulation window of odd sizes) make one step of their own. The documented "
    "'last incomplete batch is dropped' no longer holds, the step count per epoch is off by one and every later "
    "epoch is shifted.",
    fix="Roll over at position == batches_per_epoch.",
    references=(
        "https://github.com/Deci-AI/super-gradients/pull/463 (drop_last not respected by the batch sampler: the "
        "incomplete last batch was served)",
        "https://github.com/alibaba/graphlearn-for-pytorch/pull/125 (drop_last in a distributed sampler still "
        "yielded the short last batch)",
    ),
    manifest=Manifest(check="metric_differs", steps=12, variant=_SMALL_EPOCH, params={"min_gap": 1e-4}),
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
    "blind2_attention_scaled_by_model_width",
    seam="model.attention.attend",
    title="Attention scores scaled by 1/sqrt(n_embd) instead of 1/sqrt(head_dim): every head's softmax is flattened",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="attend passes scale = 1/sqrt(n_head * head_dim) to SDPA, the model width instead of the per-head "
    "dimension (the 'd_k' of the paper read as d_model). With 4 heads the logits are 2x too small: attention is "
    "closer to uniform, the model needs larger q/k weights to focus and trains measurably worse; nothing crashes.",
    fix="Leave SDPA's default scale (1/sqrt(q.size(-1))).",
    references=(
        "https://github.com/lucidrains/vit-pytorch/issues/65 (scale = dim ** -0.5 used the model dim instead of "
        "dim_head)",
        "https://github.com/omihub777/ViT-CIFAR/pull/11 (attention scaled by sqrt(d_model) instead of the per-head "
        "dimension)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 1e-3}),
)
def attend_scaled_by_width(q, k, v, attn_mask, dropout_p):
    """Scaled by the model width."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=attn_mask is None,
        scale=(q.size(1) * q.size(-1)) ** -0.5,
    )


# ================================================================================================================
# The HF target: transformers' Llama under Trainer
# ================================================================================================================

_LLAMA = "transformers.models.llama.modeling_llama"
_TRAINER = "transformers.trainer.Trainer"


@fault(
    "blind2_hf_rmsnorm_one_plus_weight",
    target="hf", seam=f"{_LLAMA}.LlamaRMSNorm.forward",
    title="LlamaRMSNorm scales by (1 + weight), Gemma's convention, while its weight is initialized to ones",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The norm's forward was written Gemma-style, hidden * (1 + weight), for a weight that Llama "
    "initializes to 1 (Gemma's is 0-centred). Every RMSNorm starts with gain 2 instead of 1, the residual branches "
    "and the final norm feed doubled activations to attention, the MLP and the head, and the learned gain lives "
    "around another point: the model trains but not as the architecture specifies.",
    fix="self.weight * hidden_states (Llama), or a 0-initialized weight with the (1 + weight) form (Gemma).",
    references=(
        "https://github.com/huggingface/transformers/pull/40796 (RMSNorm (1 + weight) with the standard init of 1: "
        "1 + 1 = 2, a doubling effect)",
        "https://github.com/linkedin/Liger-Kernel/issues/74 (Llama-style RMSNorm applied to Gemma, which needs the "
        "1.0 offset: the two conventions mixed up)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-3}),
)
def rmsnorm_one_plus_weight(self, hidden_states):
    """Gain 1 + weight on a weight initialized to 1."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (1.0 + self.weight) * hidden_states.to(input_dtype)


@fault(
    "blind2_hf_shift_pads_labels_with_zero",
    target="hf", seam="transformers.loss.loss_utils.ForCausalLMLoss",
    title="ForCausalLMLoss pads the labels before shifting without value=ignore_index: the last position targets token 0",
    subsystem="loss",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="nn.functional.pad(labels, (0, 1)) pads with 0, not ignore_index. After the shift every row's last "
    "position gets label 0, the <pad> id: a full-length row's EOS position is trained to predict <pad>, a padded "
    "row's last pad position too. num_items_in_batch was counted from the unshifted labels, so these extra targets "
    "are added to the sum but not to the count; the model learns to emit <pad> at the end of a window.",
    fix="nn.functional.pad(labels, (0, 1), value=ignore_index).",
    references=(
        "https://github.com/imoneoi/openchat/issues/119 (shifted labels filled with 0 where -100 was meant)",
        "https://github.com/lucidrains/DALLE-pytorch/issues/57 (pad id 0 and ignore_index disagreeing: padding "
        "positions counted in the loss)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-3}),
)
def for_causal_lm_loss_pad_zero(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                                shift_labels=None, **kwargs):
    """The shift pads the labels with 0."""
    logits = logits.float()

    if shift_labels is None:
        # Shift so that tokens < n predict n
        labels = nn.functional.pad(labels, (0, 1))
        shift_labels = labels[..., 1:].contiguous()

    # Flatten the tokens
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(logits.device)
    loss = fixed_cross_entropy(logits, shift_labels, num_items_in_batch, ignore_index, **kwargs)
    return loss


@fault(
    "blind2_hf_rope_frequencies_half_spectrum",
    target="hf", seam=f"{_LLAMA}.LlamaRotaryEmbedding.compute_default_rope_parameters",
    title="RoPE inverse frequencies computed as base^(-i/dim) over i < dim/2: the factor 2 is lost, half the spectrum",
    subsystem="position",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="inv_freq = 1 / base ** (arange(0, dim // 2) / dim) instead of arange(0, dim, 2) / dim: the exponent "
    "runs only to -1/2, so the slowest pair rotates base^(1/2) times faster than it should and long-range positions "
    "alias onto each other. Positions stay relative (training works), but the model has lost the low frequencies "
    "that distinguish distant tokens, and weights trained with the correct table would not transfer.",
    fix="torch.arange(0, dim, 2, dtype=torch.float) / dim.",
    references=(
        "https://github.com/rasbt/LLMs-from-scratch/issues/410 (RoPE inv_freq: dividing arange(head_dim // 2) by "
        "head_dim instead of head_dim // 2 changes the frequencies)",
        "https://github.com/hkproj/pytorch-llama/issues/3 (where did the factor 2 go in the rotary frequencies)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-3}),
)
def compute_default_rope_parameters_half(config, **kwargs):
    """The exponent lacks its factor 2."""
    base = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    attention_factor = 1.0  # Unused in this type of RoPE
    # Compute the inverse frequencies
    inv_freq = 1.0 / (base ** (torch.arange(0, dim // 2, dtype=torch.float) / dim))
    return inv_freq, attention_factor


@fault(
    "blind2_hf_forward_through_unwrapped_model",
    target="hf", seam=f"{_TRAINER}.training_step",
    title="training_step unwraps the model before the forward: the DDP wrapper is bypassed and gradients are never all-reduced",
    subsystem="distributed",
    also_acceptable=("optimizer",),
    trigger="multi-rank",
    symptoms=("desync", "silent-quality"),
    explanation="training_step calls self.accelerator.unwrap_model(model) 'to reach the model's loss kwargs' and "
    "runs compute_loss on the bare module. DDP arms its gradient all-reduce in its own forward, so the backward "
    "reduces nothing: each rank steps on the gradient of its own shard, the replicas drift apart from the first "
    "step, and nothing fails (single-process runs are unaffected).",
    fix="Run the forward through the wrapped model Trainer passes in; unwrap only to read attributes.",
    references=(
        "https://github.com/jingyaogong/minimind/issues/853 (forward run through .module bypasses DDP: gradients "
        "never all-reduced, replicas diverge silently)",
        "https://github.com/kohya-ss/sd-scripts/issues/924 (unwrapping the DDP module left multi-GPU training "
        "unsynchronized)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="ddp", steps=8,
                      params={"key": "rank_param_gap", "faulty_min": 1e-4, "clean_max": 1e-6}),
)
def training_step_unwrapped(self, model, inputs, num_items_in_batch=None):
    """The forward and backward run on the unwrapped module."""
    # Prepare buffers for context parallelism

    cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)

    # Context manager is no-op if CP isn't enabled
    with cp_context():
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()

        inputs = self._prepare_inputs(inputs)
        if is_sagemaker_mp_enabled():
            loss_mb = smp_forward_backward(model, inputs, self.args.gradient_accumulation_steps)
            return loss_mb.reduce_mean().detach().to(self.args.device)

        # compute_loss reads the loss kwargs of the underlying model
        model = self.accelerator.unwrap_model(model)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)

        del inputs
        if (
            self.args.torch_empty_cache_steps is not None
            and self.state.global_step % self.args.torch_empty_cache_steps == 0
        ):
            clear_device_cache()
            if torch.backends.mps.is_available() and hasattr(torch.mps, "clear_graph_cache"):
                torch.mps.clear_graph_cache()

        kwargs = {}

        # For LOMO optimizers you need to explicitly use the learning rate
        if self.args.optim in [OptimizerNames.LOMO, OptimizerNames.ADALOMO]:
            kwargs["learning_rate"] = self._get_learning_rate()

        if self.args.n_gpu > 1:
            loss = loss.mean()  # mean() to average on multi-gpu parallel training

        # Finally we need to normalize the loss for reporting if GA loss bug is not fixed during compute loss
        if self.loss_is_scaled_for_ga is not None:
            loss_is_scaled_for_ga = self.loss_is_scaled_for_ga
        else:
            # The loss is scaled when it was normalized by `num_items_in_batch`, by the model or by `compute_loss_func`
            loss_is_scaled_for_ga = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not loss_is_scaled_for_ga:
            loss = loss / self.current_gradient_accumulation_steps

        # Turning off loss scaling w.r.t. gradient accumulation when DeepSpeed is enabled
        # https://github.com/huggingface/transformers/pull/35808
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            kwargs["scale_wrt_gas"] = False

        self.accelerator.backward(loss, **kwargs)

        return loss.detach()


@fault(
    "blind2_hf_evaluate_defaults_to_train_dataset",
    target="hf", seam=f"{_TRAINER}.evaluate",
    title="evaluate() without an eval_dataset argument falls back to self.train_dataset: the eval loss is measured on training text",
    subsystem="eval",
    trigger="eval-only",
    symptoms=("eval-metric",),
    explanation="The default of evaluate() was copied from the training path: with no eval_dataset passed it "
    "evaluates self.train_dataset. trainer.evaluate() is how every loop asks for the validation loss, so the "
    "reported eval loss is computed over the training split (documents the model was fitted on, and many more of "
    "them) instead of the held-out set: it is optimistic, tracks the training loss and the evaluation takes many "
    "times longer. Training itself is untouched.",
    fix="Fall back to self.eval_dataset.",
    references=(
        "https://github.com/XuyangBai/KPConv.pytorch/issues/3 (the evaluation iterates the train loader: a "
        "copy-paste slip)",
        "https://github.com/sihyun-yu/PVDM/issues/40 (training set used as the eval/test set)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-3}),
)
def evaluate_on_train_dataset(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
    """Falls back to the training set."""
    # handle multiple eval datasets
    override = eval_dataset is not None
    eval_dataset = eval_dataset if override else self.train_dataset
    if isinstance(eval_dataset, dict):
        metrics = {}
        for eval_dataset_name, _eval_dataset in eval_dataset.items():
            dataset_metrics = self.evaluate(
                eval_dataset=_eval_dataset if override else eval_dataset_name,
                ignore_keys=ignore_keys,
                metric_key_prefix=f"{metric_key_prefix}_{eval_dataset_name}",
            )
            metrics.update(dataset_metrics)
        return metrics

    # memory metrics - must set up as early as possible
    self._memory_tracker.start()

    eval_dataloader = self.get_eval_dataloader(eval_dataset)
    if self.is_fsdp_xla_v2_enabled:
        eval_dataloader = tpu_spmd_dataloader(eval_dataloader)

    start_time = time.time()

    output = self.evaluation_loop(
        eval_dataloader,
        description="Evaluation",
        # No point gathering the predictions if there are no metrics, otherwise we defer to
        # self.args.prediction_loss_only
        prediction_loss_only=True if self.compute_metrics is None else None,
        ignore_keys=ignore_keys,
        metric_key_prefix=metric_key_prefix,
    )

    total_batch_size = self.args.eval_batch_size * self.args.world_size
    if f"{metric_key_prefix}_model_preparation_time" in output.metrics:
        start_time += output.metrics[f"{metric_key_prefix}_model_preparation_time"]
    output.metrics.update(
        speed_metrics(
            metric_key_prefix,
            start_time,
            num_samples=output.num_samples,
            num_steps=math.ceil(output.num_samples / total_batch_size),
        )
    )

    self.log(output.metrics)

    if DebugOption.TPU_METRICS_DEBUG in self.args.debug:
        xm.master_print(met.metrics_report())

    self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, output.metrics)

    self._memory_tracker.stop_and_update_metrics(output.metrics)

    return output.metrics


@fault(
    "blind2_hf_train_sampler_strategies_swapped",
    target="hf", seam=f"{_TRAINER}._get_train_sampler",
    title="_get_train_sampler maps the default 'random' strategy to SequentialSampler: the training data is never shuffled",
    subsystem="data",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The last two branches of _get_train_sampler return the samplers the wrong way round: "
    "train_sampling_strategy='random' (the default) gets SequentialSampler and 'sequential' gets RandomSampler. "
    "Every run reads the training set in file order, every epoch the same order, and the seed no longer changes "
    "the data order; on sorted or grouped data the batches are far from i.i.d.",
    fix="'sequential' -> SequentialSampler, anything else -> RandomSampler.",
    references=(
        "https://github.com/Deci-AI/super-gradients/issues/416 (training dataloader built without shuffle: a "
        "SequentialSampler fed the model one class at a time)",
        "https://github.com/joaoamcarvalho/mpd-public/issues/6 (shuffle=True missing on the train dataloader)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-4}),
)
def get_train_sampler_swapped(self, train_dataset=None):
    """The default strategy gets the sequential sampler."""
    if train_dataset is None:
        train_dataset = self.train_dataset
    if train_dataset is None or not has_length(train_dataset):
        if train_dataset is not None and self.args.train_sampling_strategy in (
            "group_by_length",
            "batch_rebalance",
        ):
            logger.warning(
                f"`train_sampling_strategy='{self.args.train_sampling_strategy}'` is ignored because the training dataset does not "
                "implement `__len__` (e.g. an `IterableDataset`). Examples will be consumed in the dataset's own "
                "order."
            )
        return None

    # Build the sampler.
    if self.args.train_sampling_strategy == "group_by_length":
        if is_datasets_available() and isinstance(train_dataset, datasets.Dataset):
            lengths = (
                train_dataset[self.args.length_column_name]
                if self.args.length_column_name in train_dataset.column_names
                else None
            )
        else:
            lengths = None
        model_input_name = (
            self.processing_class.model_input_names[0] if self.processing_class is not None else None
        )
        return LengthGroupedSampler(
            self.args.train_batch_size * self.args.gradient_accumulation_steps,
            dataset=train_dataset,
            lengths=lengths,
            model_input_name=model_input_name,
        )
    elif self.args.train_sampling_strategy == "batch_rebalance":
        if is_datasets_available() and isinstance(train_dataset, datasets.Dataset):
            lengths = (
                train_dataset[self.args.length_column_name]
                if self.args.length_column_name in train_dataset.column_names
                else None
            )
        else:
            lengths = None
        model_input_name = (
            self.processing_class.model_input_names[0] if self.processing_class is not None else None
        )
        if lengths is None:
            model_input_name = model_input_name if model_input_name is not None else "input_ids"
            if not isinstance(train_dataset[0], (dict, BatchEncoding)) or model_input_name not in train_dataset[0]:
                raise ValueError(
                    "Can only automatically infer lengths for datasets whose items are dictionaries with an "
                    f"'{model_input_name}' key."
                )
            lengths = [len(feature[model_input_name]) for feature in train_dataset]
        elif isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()

        world_size = max(1, self.args.world_size)
        rank = self.args.process_index if self.args.world_size > 1 else 0
        grad_accum = self.args.gradient_accumulation_steps
        effective_batch_size = self.args.train_batch_size * grad_accum * world_size

        return BatchRebalanceSampler(
            lengths=lengths,
            effective_batch_size=effective_batch_size,
            dp_size=world_size,
            grad_accum=grad_accum,
            rank=rank,
            drop_last=self.args.dataloader_drop_last,
        )
    elif self.args.train_sampling_strategy == "random":
        return SequentialSampler(train_dataset)
    else:
        return RandomSampler(train_dataset)


@fault(
    "blind2_hf_accumulation_boundary_off_by_one",
    target="hf", seam=f"{_TRAINER}._run_epoch",
    title="The accumulation boundary is tested with step % GA instead of (step + 1) % GA: the optimizer steps after each window's first micro-batch",
    subsystem="optimizer",
    also_acceptable=("loss",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="do_sync_step = step % gradient_accumulation_steps == 0: with accumulation the optimizer, the "
    "clipping and the scheduler run after the first micro-batch of each prefetched window instead of the last. The "
    "first update uses one micro-batch, every later update the last GA-1 micro-batches of one window plus the first "
    "of the next (each normalized by its own window's token count), and the run stops GA-1 micro-batches early. "
    "Without accumulation (GA = 1) nothing changes.",
    fix="(step + 1) % gradient_accumulation_steps == 0 or (step + 1) == steps_in_epoch.",
    references=(
        "https://github.com/rasbt/LLMs-from-scratch/issues/299 (batch_idx % accumulation_steps == 0 triggers an "
        "optimizer step on the very first batch)",
        "https://github.com/huggingface/accelerate/issues/435 (gradient accumulation example synchronizing on the "
        "wrong steps)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, variant={"recipe": "accum"}, params={"min_gap": 1e-4}),
)
def run_epoch_sync_off_by_one(self, model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                              ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                              steps_trained_in_current_epoch):
    """The accumulation boundary is tested on step, not step + 1."""
    step = -1
    grad_norm = None
    learning_rate = None
    rng_to_sync = False

    # Handle resumption from checkpoint: skip already-trained batches in the resumed epoch
    num_update_steps_trained = 0
    if epoch == epochs_trained and resume_from_checkpoint is not None:
        if steps_trained_in_current_epoch > 0 and not self.args.ignore_data_skip:
            train_dataloader = skip_first_batches(train_dataloader, steps_trained_in_current_epoch)
            step = steps_trained_in_current_epoch - 1
            num_update_steps_trained = steps_trained_in_current_epoch // self.args.gradient_accumulation_steps
            rng_to_sync = True
        elif steps_trained_in_current_epoch == 0:
            self._load_rng_state(resume_from_checkpoint)

    if hasattr(train_dataloader, "set_epoch"):
        train_dataloader.set_epoch(epoch)
    # `DataLoaderShard.set_epoch` (accelerate) does not forward to a batch sampler wrapped
    # in `BatchSamplerShard`, so reach it explicitly.
    shard_wrapper = getattr(train_dataloader, "batch_sampler", None)
    underlying_sampler = getattr(shard_wrapper, "batch_sampler", None)
    if hasattr(underlying_sampler, "set_epoch"):
        underlying_sampler.set_epoch(epoch)
    epoch_iterator = iter(train_dataloader)

    # We chunkify the epoch iterator into gradient accumulation steps `n` batches
    remainder = steps_in_epoch % self.args.gradient_accumulation_steps
    if remainder == 0:
        remainder = self.args.gradient_accumulation_steps

    # Outer loop: one iteration per optimizer step. Each iteration prefetches
    # `gradient_accumulation_steps` batches (fewer for the last step if the epoch
    # doesn't divide evenly).
    for update_step in range(num_update_steps_trained, num_update_steps_per_epoch):
        num_batches = (
            self.args.gradient_accumulation_steps if update_step != (num_update_steps_per_epoch - 1) else remainder
        )
        batch_samples, num_items_in_batch = self.get_batch_samples(epoch_iterator, num_batches, self.args.device)

        # This is used to correctly scale the loss when the last accumulation step has fewer batches.
        # Not used if `num_items_in_batch` is not None.
        self.current_gradient_accumulation_steps = len(batch_samples)

        # need to sync after if we skipped the batches in `get_batch_samples` for shuffle order reason
        if rng_to_sync:
            self._load_rng_state(resume_from_checkpoint)
            rng_to_sync = False

        # Inner loop: forward + backward for each micro-batch. Gradients are
        # accumulated without syncing until the last micro-batch, then we clip,
        # step the optimizer, and log/save/evaluate.
        for i, inputs in enumerate(batch_samples):
            step += 1
            do_sync_step = step % self.args.gradient_accumulation_steps == 0 or (step + 1) == steps_in_epoch
            # Since we perform prefetching, we need to manually set sync_gradients
            self.accelerator.gradient_state._set_sync_gradients(do_sync_step)

            if step % self.args.gradient_accumulation_steps == 0:
                self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)

            # We sync the gradients in the following cases: 1. sync_each_batch set to True 2. Using deepspeed 3. when we are at the last batch sample
            if (
                self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
                or self.accelerator.distributed_type == DistributedType.DEEPSPEED
                or i == len(batch_samples) - 1
            ):
                sync_context = contextlib.nullcontext
            elif self.is_distributed_loading_by_transformers and is_fsdp_managed_module(self.model):
                # Accelerate did not wrap a model sharded at load time, so its `no_sync` does not apply
                sync_context = self._defer_fsdp_gradient_reduction
            else:
                sync_context = functools.partial(self.accelerator.no_sync, model=model)
            with sync_context():
                tr_loss_step = self.training_step(model, inputs, num_items_in_batch)

            if (
                self.args.logging_nan_inf_filter
                and not is_torch_xla_available()
                and (torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step))
            ):
                # if loss is nan or inf simply add the average of previous logged losses
                self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
            else:
                if self._tr_loss.device != tr_loss_step.device:
                    raise ValueError(
                        f"Calculated loss must be on the original device: {self._tr_loss.device} but device in use is {tr_loss_step.device}"
                    )
                self._tr_loss += tr_loss_step

            self.current_flos += float(self.floating_point_ops(inputs))
            self._track_num_input_tokens(inputs)

            if do_sync_step:
                grad_norm = None
                if self.args.max_grad_norm > 0:
                    grad_norm = self._clip_grad_norm(model)
                grad_norm = self._get_grad_norm(model, grad_norm=grad_norm)

                self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
                self.optimizer.step()
                self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)

                # get leaning rate before update
                learning_rate = self._get_learning_rate()

                if not self.accelerator.optimizer_step_was_skipped:
                    # Delay optimizer scheduling until metrics are generated
                    if not isinstance(self.lr_scheduler, (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)):
                        self.lr_scheduler.step()

                model.zero_grad()
                self.state.global_step += 1
                self.state.epoch = epoch + (step + 1) / steps_in_epoch
                self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
                self._maybe_log_save_evaluate(
                    self._tr_loss,
                    grad_norm,
                    model,
                    trial,
                    epoch,
                    ignore_keys_for_eval,
                    start_time,
                    learning_rate=learning_rate,
                )
            else:
                self.control = self.callback_handler.on_substep_end(self.args, self.state, self.control)

            if self.control.should_epoch_stop or self.control.should_training_stop:
                break
        if self.control.should_epoch_stop or self.control.should_training_stop:
            break

    # PyTorch/XLA relies on the dataloader to insert mark_step each iteration.
    # When we break out of the loop early, we flush the pending graph manually.
    if is_torch_xla_available():
        xm.mark_step()

    if step < 0:
        logger.warning(
            "There seems not to be a single sample in your epoch_iterator, stopping training at step"
            f" {self.state.global_step}! This is expected if you're using an IterableDataset and set"
            f" num_steps ({self.state.max_steps}) higher than the number of available samples."
        )
        self.control.should_training_stop = True

    self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
    self._maybe_log_save_evaluate(
        self._tr_loss,
        grad_norm,
        model,
        trial,
        epoch,
        ignore_keys_for_eval,
        start_time,
        learning_rate=learning_rate,
    )


@fault(
    "blind2_hf_resume_head_taken_from_embeddings",
    target="hf", seam=f"{_TRAINER}._load_from_checkpoint",
    title="Resume overwrites the saved lm_head with the input embeddings: the model's _tied_weights_keys are applied to an untied model",
    subsystem="checkpoint",
    also_acceptable=("model",),
    trigger="on-resume",
    symptoms=("silent-quality",),
    explanation="_load_from_checkpoint 'restores tied weights' by copying each source of model._tied_weights_keys "
    "into its target before load_state_dict. LlamaForCausalLM declares lm_head.weight -> model.embed_tokens.weight "
    "whatever the config says, and this model is untied (tie_word_embeddings=False): the trained head is replaced "
    "by the embedding matrix, so the resumed run starts from a different model (a loss jump at the resume) and "
    "continues training it as if nothing happened.",
    fix="Only re-tie when config.tie_word_embeddings is true (or the tensors really alias); otherwise load the "
    "saved lm_head.weight as it is.",
    references=(
        "https://github.com/NVIDIA-NeMo/Automodel/issues/2571 (lm_head omitted from the checkpoint as 'tied' and "
        "rebuilt from embed_tokens on resume: a loss spike after resume)",
        "https://github.com/NVIDIA-NeMo/Automodel/issues/2941 (_tied_weights_keys re-tie applied without checking "
        "tie_word_embeddings: trained heads of untied models discarded)",
    ),
    manifest=Manifest(check="metric_differs", scenario="resume", steps=16, variant={"model": {"attention_dropout": 0.1}},
                      params={"min_gap": 1e-3}),
)
def load_from_checkpoint_head_from_embeddings(self, resume_from_checkpoint, model=None):
    """The saved lm_head is replaced by the embedding matrix."""
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

            # tied weights: the head is the input embedding, take it from there
            for tied_key, source_key in (getattr(model, "_tied_weights_keys", None) or {}).items():
                if source_key in state_dict:
                    state_dict[tied_key] = state_dict[source_key]

            # workaround for FSDP bug https://github.com/pytorch/pytorch/issues/82963
            # which takes *args instead of **kwargs
            load_result = model.load_state_dict(state_dict, False)
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
