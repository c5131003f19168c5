"""The third blind set: faults modelled on real bug threads, written without reading the detectors.

`make bench-blind BLIND=blind3` scores the suite on these alone (see README.md next to this file). Every id starts
with ``blind3_``; the first part breaks the reference stack (``model/``), the second transformers' Llama under
``Trainer`` (``target="hf"``), each HF fault being the buggy body of the transformers/accelerate function it names.
A fault body runs spliced into its seam's module: the names it does not import are that module's globals.
"""
# ruff: noqa: F821, E501

from faultbench.faults.registry import Manifest, fault
from faultbench.model.data import IGNORE_INDEX

_LEFT = {"data": {"pad_side": "left"}}

# ================================================================================================================
# The reference stack (model/)
# ================================================================================================================


@fault(
    "blind3_long_documents_filtered_out",
    seam="model.data.load_corpus",
    title="Training documents longer than seq_len are filtered out of the split instead of being cut to it",
    subsystem="data",
    trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="load_corpus keeps only the training examples that already fit the context ('an example that has to "
    "be cut is a broken example') and truncates nothing on the training side; validation documents are still cut to "
    "seq_len. The rare long documents of the source (its long tail, a few percent of the corpus) never reach training, "
    "so the model never sees a document that runs to the end of the window nor the statistics of long documents, "
    "while the validation split still holds them. Nothing fails; the training distribution is silently not the "
    "corpus's.",
    fix="Truncate over-long training documents (keeping EOS) as the validation ones are, or split them into several "
    "windows; never drop them silently.",
    references=(
        "https://github.com/AI-Hypercomputer/maxtext/issues/274 (long sequences are dropped rather than trimmed "
        "by the input pipeline: some of the best documents never train)",
        "https://github.com/NVIDIA-NeMo/RL/issues/169 (examples whose length exceeds the max are masked out "
        "instead of truncated, skewing the batch)",
        "https://github.com/axolotl-ai-cloud/axolotl/pull/3068 (excess_length_strategy: long samples were "
        "dropped by default; truncation added)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-3}),
)
def load_corpus_keep_fitting(cfg):
    """Over-long training documents are dropped rather than truncated."""
    source = MarkovSource.from_config(cfg)
    texts = source.sample(cfg.num_docs, seed=cfg.corpus_seed + 1)
    train_texts = [t for t in texts if split_of(t, cfg.val_fraction) == "train"]
    val_texts = [t for t in texts if split_of(t, cfg.val_fraction) == "val"]
    tok = load_or_train_tokenizer(train_texts, cfg.vocab_size)

    train_ids, val_ids = tok.encode_batch(train_texts), tok.encode_batch(val_texts)
    too_long = sum(len(ids) > cfg.seq_len for ids in train_ids + val_ids)
    if too_long and not cfg.truncate:
        raise ValueError(f"{too_long} documents exceed seq_len={cfg.seq_len} tokens and truncation is off")
    # training examples must fit the context whole; cutting one would teach a fake document end
    train_ids = [ids for ids in train_ids if len(ids) <= cfg.seq_len]
    whole = [(t, ids) for t, ids in zip(val_texts, val_ids, strict=True) if len(ids) <= cfg.seq_len]
    nats = sum(-source.log_prob(t) for t, _ in whole)
    predicted = sum(len(ids) - 1 for _, ids in whole)
    return Corpus(
        tokenizer=tok,
        train=tuple(tuple(ids) for ids in train_ids),
        val=tuple(tuple(truncate(ids, cfg.seq_len, tok.eos_id)) for ids in val_ids),
        loss_floor=nats / predicted,
        truncated_fraction=too_long / len(texts),
    )


@fault(
    "blind3_shard_offset_strides_by_rank_share",
    seam="model.sampler.ResumableSampler.next_indices",
    title="Each rank's slice starts at (position + rank) x per-rank size: rank r replays rank 0's batch r steps later",
    subsystem="distributed",
    also_acceptable=("data",),
    trigger="multi-rank",
    symptoms=("silent-quality",),
    explanation="next_indices computes the start of this rank's slice as (position + rank) * per_rank, striding the "
    "epoch's permutation by the per-rank size instead of the global batch. Within one step the ranks' slices are "
    "still disjoint (nothing looks duplicated), but across steps they overlap: rank 1's slice at step p is rank 0's "
    "slice at step p + 1, so every document is trained twice, one step apart, and only the first half of each epoch's "
    "permutation is ever read. On one process the stride equals the global batch and nothing changes.",
    fix="start = position * global_batch + rank * per_rank.",
    references=(
        "https://github.com/NVIDIA-NeMo/Megatron-Bridge/pull/5944 (rank-strided indices misaligned with the "
        "global batch: a duplicate sample in the nominal global batch)",
        "https://github.com/pytorch/pytorch/pull/16910 (distributed sampler begin index arithmetic per rank "
        "reviewed for duplicates)",
        "https://github.com/NVlabs/LongLive/issues/71 (ranks' shards of the permutation overlap: samples seen "
        "twice, others skipped)",
    ),
    manifest=Manifest(check="metric_differs", scenario="ddp", steps=12, params={"min_gap": 1e-4}),
)
def next_indices_rank_share_stride(self) -> list[int]:
    """The slice offset is counted in per-rank slices."""
    if self.position == self.batches_per_epoch:
        self.set_epoch(self.epoch + 1)
    per_rank = self.global_batch // self.world_size
    offset = (self.position + self.rank) * per_rank
    self.position += 1
    return self._order[offset : offset + per_rank].tolist()


@fault(
    "blind3_positions_taken_before_mask_filled",
    seam="model.data.collate",
    title="collate derives position_ids from the attention mask before the rows are written into it: every position is 0",
    subsystem="collate",
    also_acceptable=("position",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The batch tensors are all allocated up front and position_ids is computed right after the "
    "attention mask is allocated, from the still all-zero mask; the loop that fills the mask runs afterwards. "
    "cumsum - 1 clamped at 0 gives position 0 for every token of every batch, so RoPE rotates nothing in training "
    "and evaluation: the model trains without positional information (only the causal mask tells order). "
    "generate() derives positions from the mask itself, so cached decoding runs with real positions the model was "
    "never trained on.",
    fix="Compute position_ids after the loop has filled the attention mask.",
    references=(
        "https://github.com/NVIDIA/Megatron-LM/issues/453 (RoPE ignores the position ids it is given: positions "
        "silently not the ones the batch describes)",
        "https://github.com/alibaba/ChatLearn/pull/341 (position_ids computed wrong in the collation of a batch)",
        "https://github.com/hiyouga/EasyR1/pull/494 (text position ids discarded: attention computed with the "
        "wrong positions)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-3}),
)
def collate_positions_first(docs, pad_id: int, pad_side: str = "right", ignore_index: int = IGNORE_INDEX) -> dict:
    """position_ids is derived before the mask holds the rows."""
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
    B, T = len(docs), max(len(d) for d in docs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    position_ids = position_ids_from_mask(attention_mask)
    labels = torch.full((B, T), ignore_index, dtype=torch.long)
    for row, ids in enumerate(docs):
        n = len(ids)
        start = 0 if pad_side == "right" else T - n
        tokens = torch.as_tensor(ids, dtype=torch.long)
        input_ids[row, start : start + n] = tokens
        attention_mask[row, start : start + n] = 1
        labels[row, start + 1 : start + n] = tokens[1:]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "labels": labels}


@fault(
    "blind3_rope_rotates_leading_half_of_head",
    seam="model.rope.apply_rope",
    title="apply_rope rotates only the first half of each head (a partial-rotary port) with the full-head frequency table",
    subsystem="position",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="apply_rope was ported from a GPT-NeoX-style partial rotary embedding (rotary_pct = 0.5): it splits "
    "each head into a rotated part (the first hs/2 channels) and a pass-through part, pairs (i, i + hs/4) inside the "
    "rotated part, and takes the first hs/4 columns of the cos/sin tables, which were built for the whole head. Half "
    "of every query and key carries no position, and the rotated half only gets the table's fastest frequencies, so "
    "the slow frequencies that separate distant tokens are gone. Attention stays relative and nothing crashes: the "
    "model simply trains with a weaker, different positional code than the one its tables describe.",
    fix="Rotate every channel pair (i, i + hs/2) with the whole table, or build the tables for the rotary width when "
    "a partial rotary embedding is really meant.",
    references=(
        "https://github.com/pie-project/pie/pull/603 (partial rope rotated with frequencies and pair offsets of the "
        "head width instead of the rotary width: quality falls with distance)",
        "https://github.com/AI-Hypercomputer/maxtext/pull/4615 (partial_rotary_factor silently not honoured: "
        "the rotated channel range disagrees with the reference)",
        "https://github.com/lucidrains/rotary-embedding-torch/issues/4 (rotary dim different from the head dim: "
        "channels past it are never rotated)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-3}),
)
def apply_rope_partial(x, cos, sin):
    """Only the leading half of each head is rotated."""
    rotary = x.shape[-1] // 2
    x_rot, x_pass = x[..., :rotary].float(), x[..., rotary:]
    x1, x2 = x_rot.chunk(2, dim=-1)  # (B, nh, T, hs/4) each
    c, s = cos[..., : rotary // 2], sin[..., : rotary // 2]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated.to(x.dtype), x_pass), dim=-1)


@fault(
    "blind3_keys_rotated_after_cache_append",
    seam="model.attention.CausalSelfAttention.forward",
    title="RoPE is applied to the keys after the KV cache returns them: every cached key is re-rotated to the newest position",
    subsystem="model",
    also_acceptable=("position",),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="The keys go into the cache un-rotated and RoPE is applied to what cache.update returns, with the "
    "angles of the tokens of this forward only. In training and in a prefill the cache is empty or absent and the "
    "result is unchanged; in cached decoding (one new token) the angle of the new position broadcasts over every "
    "cached key, so all keys carry the same rotation as the query: the decoded token sees no relative positions and "
    "cached generation disagrees with the uncached forward of the same tokens.",
    fix="Rotate k with its own positions before it is appended to the cache (cache rotated keys), as the queries are.",
    references=(
        "https://github.com/EleutherAI/gpt-neox/pull/363 ('FIX: cache un-RoPE'd KVs': rotary and the KV cache "
        "applied in the wrong order)",
        "https://github.com/NeuraLegion/shainet/pull/110 (review: re-applying RoPE to the full cached K rotates "
        "cached keys with the wrong positions)",
        "https://github.com/pytorch/executorch/pull/2010 (rotary encoding in the KV-cache branch sliced for the "
        "wrong positions)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=16,
                      params={"key": "cached_logit_gap", "faulty_min": 1e-3, "clean_max": 1e-4}),
)
def attention_forward_rope_after_cache(self, x, rope, attn_mask, cache=None, layer_idx: int = 0):
    """The cache keeps raw keys; they are rotated after being read back."""
    B, T, C = x.shape
    q, k, v = self.qkv(x).split(C, dim=2)
    q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    q = apply_rope(q, *rope)
    if cache is not None:
        k, v = cache.update(layer_idx, k, v)
    k = apply_rope(k, *rope)
    y = attend(q, k, v, attn_mask, self.dropout if self.training else 0.0)
    y = y.transpose(1, 2).reshape(B, T, C)
    return self.resid_dropout(self.proj(y))


@fault(
    "blind3_scheduler_returns_one_lr",
    seam="model.optim.make_scheduler",
    title="A hand-written warmup-cosine LRScheduler writes the new learning rate into param_groups[0] only: the other group is never scheduled",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="make_scheduler replaces LambdaLR with a small LRScheduler subclass whose step() computes "
    "lr_at(step) and writes it into optimizer.param_groups[0]['lr'] (nanoGPT-style, from a single-group script). "
    "Only group 0 (the decayed matrices) follows warmup and cosine; the no-decay group (embeddings, biases, norms) keeps the "
    "constructor's peak learning rate from the first step to the last, with no warmup and no decay. The learning "
    "rate every log shows is group 0's, so the schedule looks right.",
    fix="Set the learning rate of every parameter group (for group in optimizer.param_groups), or keep LambdaLR.",
    references=(
        "https://github.com/deepspeedai/DeepSpeed/pull/7969 (WarmupCosineLR returned a singleton LR list: with "
        "zip(param_groups, lrs) only group 0 was updated)",
        "https://github.com/microsoft/hi-ml/issues/611 (LR scheduler issue with multiple parameter groups: get_lr "
        "must return an LR per group)",
        "https://github.com/speedinghzl/pytorch-segmentation-toolbox/issues/12 (learning rate adjusted on "
        "param_groups[0] only)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-3}),
)
def make_scheduler_single_lr(optimizer, cfg):
    """step() updates the first parameter group only."""

    class WarmupCosine(torch.optim.lr_scheduler.LRScheduler):
        def step(self, epoch=None):
            self.last_epoch += 1
            lr = lr_at(self.last_epoch, cfg)
            self.optimizer.param_groups[0]["lr"] = lr
            self._last_lr = [lr]

    return WarmupCosine(optimizer)


@fault(
    "blind3_backward_after_accumulation_loop",
    seam="model.train.train_step",
    title="The backward pass sits after the micro-batch loop: only the window's last micro-batch contributes a gradient",
    subsystem="optimizer",
    also_acceptable=("loss",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="In train_step the backward call was dedented out of the accumulation loop (the loop then only "
    "'collects the losses'). Every micro-batch's forward runs and its loss is added to the logged step loss, but "
    "micro_loss is rebound each iteration and only the last one is backpropagated: the update uses the gradient of "
    "1/accum of the window, scaled by that micro-batch's share of the targets, so it is about accum times too small "
    "and noisier. The logged loss is the full window's; with accum = 1 nothing changes.",
    fix="Call scaler.scale(micro_loss).backward() inside the loop (and inside the grad-sync context) for every "
    "micro-batch.",
    references=(
        "https://github.com/lucidrains/denoising-diffusion-pytorch/issues/250 (should backward be outside the "
        "gradient-accumulation loop? only the last loss would then be backpropagated)",
        "https://github.com/EleutherAI/gpt-neox/issues/405 (accumulation loop with backward/step in the wrong "
        "place: the update does not cover the window)",
        "https://github.com/karpathy/nanoGPT/issues/206 (gradient accumulation logic error questions)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, variant={"train": {"accum": 4}}, params={"min_gap": 1e-3}),
)
def train_step_backward_after_loop(run, micro_batches):
    """Only the last micro-batch is backpropagated."""
    start = time.perf_counter()
    tcfg = run.config.train
    lr, scale = run.optimizer.param_groups[0]["lr"], run.scaler.get_scale()
    local_targets = sum(count_targets(b["labels"]) for b in micro_batches)
    per_rank_targets = global_target_count(local_targets, tcfg.device) / run.world_size
    loss = 0.0
    for i, batch in enumerate(micro_batches):
        with grad_sync_context(run.train_model, sync=i == len(micro_batches) - 1):
            micro_loss = forward_loss(run.train_model, batch, per_rank_targets, tcfg.precision)
        loss += micro_loss.item()
    run.scaler.scale(micro_loss).backward()
    grad_norm = clip_gradients(run.model, run.optimizer, run.scaler, tcfg.grad_clip)
    skipped = optimizer_step(run.optimizer, run.scaler, run.scheduler)
    record = StepRecord(
        step=run.step, loss=mean_over_ranks(loss, tcfg.device), grad_norm=grad_norm, lr=lr, scale=scale,
        skipped=skipped, tokens=int(sum(b["attention_mask"].sum() for b in micro_batches)),
        seconds=time.perf_counter() - start,
    )
    run.step += 1
    run.history.append(record)
    return record


@fault(
    "blind3_autocast_dtype_left_to_device_default",
    seam="model.precision.autocast_context",
    title="torch.autocast is entered without a dtype: the half type is the device's default, not the configured one",
    subsystem="precision",
    trigger="amp-only",
    symptoms=("silent-quality",),
    explanation="autocast_context returns torch.autocast(device_type) for every precision but fp32, relying on "
    "autocast's default dtype. That default depends on the device, float16 on CUDA and bfloat16 on CPU, so the "
    "configured precision is ignored: on CPU an fp16 run computes in bf16 (with a GradScaler it does not need), on "
    "GPU a bf16 run computes in fp16 with no GradScaler, where small gradients underflow and large activations "
    "overflow. The run reports the configured precision either way.",
    fix="torch.autocast(device_type, dtype=_AUTOCAST_DTYPES[precision]).",
    references=(
        "https://github.com/datawhalechina/happy-llm/pull/195 (autocast() without dtype forces the device default: "
        "--dtype bfloat16 silently ran in FP16)",
        "https://github.com/pytorch/pytorch/pull/63534 (AutocastCPU's default dtype changed from float16 to "
        "bfloat16: CPU and CUDA defaults differ)",
        "https://github.com/pixeli99/SVD_Xtend/pull/44 (autocast enabled only for one half type: bf16 selected, "
        "another dtype used)",
    ),
    manifest=Manifest(check="metric_differs", steps=8, variant={"train": {"precision": "fp16"}},
                      params={"min_gap": 1e-4}),
)
def autocast_context_default_dtype(precision: str, device_type: str):
    """The autocast dtype is whatever the device defaults to."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type)


@fault(
    "blind3_resume_assigns_loaded_tensors",
    seam="model.checkpoint.load_checkpoint",
    title="Resume loads the weights with load_state_dict(assign=True): the optimizer keeps the old tensors and the tied head comes apart",
    subsystem="checkpoint",
    trigger="on-resume",
    symptoms=("silent-quality", "stall"),
    explanation="load_checkpoint passes assign=True to model.load_state_dict (to avoid a copy of every tensor). "
    "assign replaces each Parameter object with the loaded tensor instead of copying into it, but the optimizer was "
    "built from the old Parameter objects: after the resume the model's parameters receive gradients the optimizer "
    "never steps (it still holds the old, now detached tensors, whose grads stay None), so the resumed run stops "
    "learning while the loss and grad norm keep being logged. assign also gives wte.weight and lm_head.weight two "
    "separate tensors: the embedding and the head are no longer tied.",
    fix="Load with the default copy (assign=False) into the live parameters, or build the optimizer after an assign "
    "load and re-tie the weights.",
    references=(
        "https://github.com/pytorch/pytorch/issues/188346 (load_state_dict(assign=True) breaks tied parameter "
        "aliasing; an optimizer built before the load updates other tensors)",
        "https://github.com/pytorch/pytorch/pull/121158 (docs: if assign is True the optimizer must be created "
        "after the call to load_state_dict)",
        "https://github.com/TransformerLensOrg/TransformerLens/issues/1725 (assign=True desyncs tied embed/unembed "
        "weights, silently breaking the forward pass)",
    ),
    manifest=Manifest(check="metric_differs", scenario="resume", steps=16, params={"min_gap": 1e-3}),
)
def load_checkpoint_assign(run, directory) -> None:
    """The loaded tensors replace the model's Parameters."""
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
        raise CheckpointError(f"checkpoint {directory} was trained with another tokenizer")
    state = torch.load(state_path, map_location=run.config.train.device, weights_only=True)
    # the state is already on the right device: take its tensors as they are instead of copying each one
    run.model.load_state_dict(state["model"], assign=True)
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.step = state["step"]
    run.history = [StepRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in state["history"]]
    restore_rng_state(state["rng"][run.rank])


@fault(
    "blind3_eval_batches_stop_one_early",
    seam="model.evaluate.evaluate",
    title="The eval loop's range stops batch_size before the end: the last eval batch is never scored",
    subsystem="eval",
    trigger="always",
    symptoms=("eval-metric",),
    explanation="evaluate iterates range(0, len(docs) - batch_size, batch_size) so that 'every slice is a full "
    "batch'. The stop is exclusive, so the final batch is skipped even when it is full: with 128 documents and "
    "batches of 64 only the first 64 are scored, and in general the last batch_size documents or fewer are left "
    "out. The reported validation loss is an exact token mean, of another, smaller set, and it changes with "
    "eval_batch_size.",
    fix="range(0, len(docs), batch_size), slicing the last (possibly partial) batch as it comes.",
    references=(
        "https://github.com/ChEB-AI/python-chebai/pull/129 (evaluation skips the last batch)",
        "https://github.com/ialhashim/DenseDepth/pull/137 (evaluate's batch count leaves the last batch out of the "
        "evaluation)",
        "https://github.com/google/flax/issues/263 (the example does not evaluate on the entire validation set)",
    ),
    manifest=Manifest(check="metric_differs", steps=8, params={"min_gap": 1e-4}),
)
def evaluate_range_short(model, docs, pad_id: int, batch_size: int, precision: str = "fp32", pad_side: str = "right"):
    """The final batch of the split is skipped."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for i in range(0, len(docs) - batch_size, batch_size):
            batch = {k: v.to(device) for k, v in collate(docs[i : i + batch_size], pad_id, pad_side).items()}
            with autocast_context(precision, device.type):
                logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            n = count_targets(batch["labels"])
            total += lm_loss(logits, batch["labels"], n).item() * n
            count += n
    finally:
        model.train(was_training)
    return total / count


# ================================================================================================================
# The HF target: transformers' Llama under Trainer
# ================================================================================================================

_LLAMA = "transformers.models.llama.modeling_llama"
_TRAINER = "transformers.trainer.Trainer"


@fault(
    "blind3_hf_values_projected_by_key_weights",
    target="hf", seam=f"{_LLAMA}.LlamaAttention.forward",
    title="LlamaAttention computes the values with k_proj: v_proj is never used and the values are the keys' pre-RoPE projection",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="A copy-pasted line projects value_states with self.k_proj. The shapes agree (both are "
    "num_key_value_heads x head_dim), so nothing fails: every head attends with its keys and averages the same "
    "projection as its values, v_proj receives no gradient (its grad stays None and AdamW never touches it), and "
    "k_proj is trained by two roles at once. The model trains, with one projection fewer than it has parameters for.",
    fix="value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2).",
    references=(
        "https://github.com/snu-comparch/InfiniGen/issues/5 (the value slot of the cache is written with k instead "
        "of v; confirmed by the authors)",
        "https://github.com/any-LABS/anyGPT/pull/10 (fixed q,k,v bug in the self-attention block)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-3}),
)
def llama_attention_forward_values_from_keys(self, hidden_states, position_embeddings=None, attention_mask=None,
                                             past_key_values=None, **kwargs):
    """Values come out of the key projection."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)

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
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


@fault(
    "blind3_hf_decoder_layer_parallel_residual",
    target="hf", seam=f"{_LLAMA}.LlamaDecoderLayer.forward",
    title="LlamaDecoderLayer computes the MLP from the layer input (GPT-J/NeoX parallel residual) instead of after attention",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The decoder layer was rewritten in the parallel-residual form x + attn(ln1(x)) + mlp(ln2(x)) "
    "(GPT-J, GPT-NeoX with use_parallel_residual=True), while Llama is sequential: its MLP must read the "
    "residual stream after the attention output has been added. Every shape and every parameter is unchanged and "
    "training runs, but each layer's MLP never sees what its own attention computed, and weights trained or loaded "
    "for the sequential architecture do not mean the same thing here.",
    fix="residual = residual + attn_output; then residual + mlp(post_attention_layernorm(residual)).",
    references=(
        "https://github.com/huggingface/transformers/pull/18695 (use_parallel_residual added: GPT-NeoX checkpoints "
        "differ in whether the MLP reads the attention output)",
        "https://github.com/TransformerLensOrg/TransformerLens/issues/1644 (bridge ignores use_parallel_residual: "
        "sequential checkpoints run as parallel)",
        "https://github.com/deepspeedai/DeepSpeed/pull/2446 (inference kernels not aware of use_parallel_residual: "
        "mlp_after_attn wrong for customized models)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-3}),
)
def llama_decoder_layer_parallel(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                                 use_cache=False, position_embeddings=None, **kwargs):
    """Attention and MLP both read the layer input."""
    residual = hidden_states
    attn_output, _ = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states),
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    mlp_output = self.mlp(self.post_attention_layernorm(residual))
    return residual + attn_output + mlp_output


@fault(
    "blind3_hf_token_average_not_rescaled",
    target="hf", seam=f"{_TRAINER}.compute_loss",
    title="compute_loss divides by the token count of all ranks but never multiplies by the number of processes: DDP's average halves the gradient",
    subsystem="loss",
    also_acceptable=("distributed",),
    trigger="multi-rank",
    symptoms=("silent-quality",),
    explanation="With average_tokens_across_devices (the default), num_items_in_batch is the target count gathered "
    "over every rank, so each rank's loss is its own summed cross-entropy over the global count. DDP then averages "
    "the ranks' gradients, which divides once more by the world size; compute_loss must multiply the loss by "
    "num_processes to undo it, and this version does not. On 2 ranks every gradient (and the logged training loss) "
    "is half the single-process value: clipping engages later, Adam's epsilon weighs more, and the loss curve is "
    "not comparable across world sizes. A single process is unaffected.",
    fix="loss *= self.accelerator.num_processes when the token count was averaged across devices and the model "
    "received num_items_in_batch.",
    references=(
        "https://github.com/huggingface/transformers/pull/34373 (average tokens across devices: the loss must be "
        "multiplied by the world size since DDP averages)",
        "https://github.com/huggingface/transformers/issues/37474 (mean token loss incorrectly normalized with "
        "several GPUs)",
        "https://github.com/huggingface/transformers/issues/39648 (train loss scaled by the wrong number of "
        "processes when the device-count factor is wrong)",
    ),
    manifest=Manifest(check="metric_differs", scenario="ddp", steps=8, params={"min_gap": 1e-3}),
)
def compute_loss_no_device_rescale(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """The loss is divided by the global token count but never multiplied back by the number of processes."""
    pc = getattr(self.accelerator, "parallelism_config", None)
    if pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled and self.model.training:
        return deepspeed_sp_compute_loss(self.accelerator, model, inputs, return_outputs, pc)

    if (self.label_smoother is not None or self.compute_loss_func is not None) and "labels" in inputs:
        labels = inputs.pop("labels")
    else:
        labels = None
    if self.model_accepts_loss_kwargs:
        kwargs = {}
        if num_items_in_batch is not None:
            kwargs["num_items_in_batch"] = num_items_in_batch
        inputs = {**inputs, **kwargs}
    outputs = model(**inputs)

    # User-defined compute_loss function
    if self.compute_loss_func is not None:
        if labels is None:
            logger.warning(
                "Trainer: `compute_loss_func` is defined but `labels=None`. "
                "Your custom loss function will still be called with labels=None. "
            )
        loss = self.compute_loss_func(
            outputs,
            labels,
            num_items_in_batch=num_items_in_batch,
        )
    # Default HF loss handling (label smoothing) if no custom loss function
    elif labels is not None:
        unwrapped_model = self.accelerator.unwrap_model(model)
        model_name = (
            unwrapped_model.base_model.model._get_name()
            if _is_peft_model(unwrapped_model)
            else unwrapped_model._get_name()
        )
        if model_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
            loss = self.label_smoother(outputs, labels, shift_labels=True, num_items_in_batch=num_items_in_batch)
        else:
            loss = self.label_smoother(outputs, labels, num_items_in_batch=num_items_in_batch)
    else:
        if isinstance(outputs, dict) and "loss" not in outputs:
            raise ValueError(
                "The model did not return a loss from the inputs, only the following keys: "
                f"{','.join(outputs.keys())}. For reference, the inputs it received are {','.join(inputs.keys())}."
            )
        # We don't use .loss here since the model may return tuples instead of ModelOutput.
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]

    return (loss, outputs) if return_outputs else loss


@fault(
    "blind3_hf_random_sampler_with_replacement",
    target="hf", seam=f"{_TRAINER}._get_train_sampler",
    title="The default training sampler draws len(dataset) indices with replacement: some documents repeat within an epoch, a third never appear",
    subsystem="data",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="_get_train_sampler builds RandomSampler(train_dataset, replacement=True, num_samples=len(dataset)) "
    "(num_samples used to require replacement=True). An 'epoch' is then len(dataset) independent draws: about 37% "
    "of the documents are never seen in it, others twice or more, sometimes in the same batch. Training runs, the "
    "epoch has the right length and the order looks shuffled; the data is simply not covered.",
    fix="RandomSampler(train_dataset) (a permutation, no replacement).",
    references=(
        "https://github.com/pytorch/pytorch/issues/38032 (RandomSampler refused num_samples without "
        "replacement=True, so users switched replacement on to size an epoch)",
        "https://github.com/pytorch/pytorch/pull/39000 (num_samples allowed with replacement=False)",
        "https://github.com/open-mmlab/mmdetection/issues/2043 (random choice with replacement puts the same "
        "training example in one batch)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-3}),
)
def get_train_sampler_with_replacement(self, train_dataset=None):
    """The default random strategy draws indices with replacement."""
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
    elif self.args.train_sampling_strategy == "sequential":
        return SequentialSampler(train_dataset)
    else:
        # one epoch = len(train_dataset) draws, whatever the dataset's size
        return RandomSampler(train_dataset, replacement=True, num_samples=len(train_dataset))


@fault(
    "blind3_hf_evaluate_casts_model_to_bf16",
    target="hf", seam=f"{_TRAINER}.evaluate",
    title="evaluate() casts the model itself to bf16 whenever the run trains in bf16, and never casts it back",
    subsystem="eval",
    also_acceptable=("precision",),
    trigger="amp-only",
    symptoms=("eval-metric", "silent-quality"),
    explanation="evaluate treats bf16=True as bf16_full_eval: outside training it calls self.model.to(torch.bfloat16) "
    "before the evaluation loop. bf16 mixed precision keeps fp32 weights and autocasts the matmuls; this eval runs "
    "with weights rounded to bf16's 8-bit mantissa, so the reported eval loss is not the loss of the trained model, "
    "and the model stays in bf16 afterwards: generation, saving, or any training resumed from the same Trainer "
    "continue with rounded weights. fp32 runs are unaffected.",
    fix="Cast only under bf16_full_eval, on a copy or with the dtype restored after the loop; otherwise evaluate the "
    "fp32 weights under autocast.",
    references=(
        "https://github.com/huggingface/transformers/pull/10268 (full fp16 evaluation: model.half() in "
        "evaluation/predict, only outside train and only when asked for)",
        "https://github.com/huggingface/accelerate/issues/771 (inference in bf16 during mixed-precision training "
        "means casting the model to bfloat16 and back)",
        "https://github.com/huggingface/transformers/pull/44356 (fp16/bf16 casts of the model in evaluation_loop)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, variant={"precision": "bf16"}, params={"min_gap": 1e-4}),
)
def evaluate_cast_to_bf16(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
    """A bf16 run is evaluated with the model itself cast to bf16, and left so."""
    # handle multiple eval datasets
    override = eval_dataset is not None
    eval_dataset = eval_dataset if override else self.eval_dataset
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

    # a bf16 run evaluates in bf16 outright: half the memory, twice the speed, same numbers as training
    if self.args.bf16 and not self.is_in_train:
        self.model = self.model.to(dtype=torch.bfloat16)

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
    "blind3_hf_cosine_progress_counts_warmup",
    target="hf", seam=f"{_TRAINER}.create_scheduler",
    title="A hand-rolled warmup-cosine schedule measures the cosine's progress from step 0, not from the end of warmup: the LR halves right after warmup",
    subsystem="optimizer",
    trigger="after-step",
    symptoms=("silent-quality",),
    explanation="create_scheduler builds its own warmup + cosine LambdaLR, whose cosine phase computes progress = "
    "current_step / num_training_steps, leaving the warmup steps in both the numerator and the denominator. At the "
    "end of a warmup of w steps out of N the cosine is already at progress w/N: the multiplier jumps from 1 down to "
    "0.5 * (1 + cos(pi * w / N)) in one step (0.5 when warmup is half the run) and the peak learning rate is never "
    "held. The decay still reaches zero at N and the warmup is right, so both ends of the schedule look normal.",
    fix="progress = (current_step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps) (or "
    "transformers' get_scheduler).",
    references=(
        "https://github.com/huggingface/pytorch-image-models/issues/1242 (cosine LR scheduler with warmup: a sharp "
        "drop at the end of warmup unless the cosine is offset by the warmup)",
        "https://github.com/tensorflow/tensorflow/pull/28623 (cosine decay fraction must subtract the warmup steps)",
        "https://github.com/lightly-ai/lightly/pull/1842 (cosine scheduler warmup corner cases)",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 1e-4}),
)
def create_scheduler_cosine_from_zero(self, num_training_steps, optimizer=None):
    """The cosine's progress includes the warmup steps."""
    if self.lr_scheduler is None:
        if optimizer is None:
            optimizer = self.optimizer
        num_warmup_steps = self.args.get_warmup_steps(num_training_steps)

        def lr_lambda(current_step):
            if current_step < num_warmup_steps:
                return float(current_step) / float(max(1, num_warmup_steps))
            progress = float(current_step) / float(max(1, num_training_steps))
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        self._created_lr_scheduler = True
    return self.lr_scheduler


@fault(
    "blind3_hf_resume_fast_forwards_loaded_scheduler",
    target="hf", seam=f"{_TRAINER}._load_optimizer_and_scheduler",
    title="Resume loads the LR scheduler's state and then steps it global_step more times: the schedule jumps ahead",
    subsystem="checkpoint",
    also_acceptable=("optimizer",),
    trigger="on-resume",
    symptoms=("silent-quality",),
    explanation="After loading the optimizer and scheduler states, a catch-up loop written for checkpoints that had "
    "no scheduler state ('bring the schedule to the step training resumes from') calls lr_scheduler.step() "
    "global_step times. The loaded state was already at global_step, so the schedule is advanced twice: a run "
    "resumed at step k continues with the learning rate of step 2k (mid-warmup resumes skip the rest of warmup, "
    "late resumes land at the end of the cosine). The step counter, the data and the optimizer moments are right.",
    fix="Either load the scheduler's state or fast-forward a fresh scheduler, never both.",
    references=(
        "https://github.com/THUDM/slime/pull/1547 (remove double-counting of LR scheduler steps on checkpoint "
        "resume: the load already advanced the scheduler)",
        "https://github.com/Lightning-AI/pytorch-lightning/issues/4655 (LR scheduler position wrong after "
        "resume_from_checkpoint; workaround steps the scheduler epoch times)",
        "https://github.com/vllm-project/speculators/pull/900 (resumed LR schedulers seeded with the wrong step)",
    ),
    manifest=Manifest(check="metric_differs", scenario="resume", steps=16, params={"min_gap": 1e-4}),
)
def load_optimizer_and_scheduler_fast_forward(self, checkpoint):
    """The loaded scheduler is stepped again up to global_step."""
    if checkpoint is None:
        return
    if not (os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME))
            and os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME))):
        return
    map_location = self.args.device if self.args.world_size > 1 and self.args.device.type != "cpu" else "cpu"
    check_torch_load_is_safe()
    self.optimizer.load_state_dict(
        torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location=map_location, weights_only=True)
    )
    with warnings.catch_warnings(record=True) as caught_warnings:
        check_torch_load_is_safe()
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        # bring the schedule to the step training resumes from
        for _ in range(self.state.global_step):
            self.lr_scheduler.step()
    reissue_pt_warnings(caught_warnings)


@fault(
    "blind3_hf_gather_into_aliased_buffers",
    target="hf", seam="accelerate.utils.operations.gather",
    title="gather all-gathers into [torch.empty_like(t)] * world_size: one buffer aliased world_size times, every rank's slot holds the last rank's tensor",
    subsystem="distributed",
    also_acceptable=("eval", "loss"),
    trigger="multi-rank",
    symptoms=("silent-quality", "eval-metric"),
    explanation="The receive list of torch.distributed.all_gather is built with list multiplication, so its entries "
    "are the same tensor object; all_gather writes every rank's contribution into that one buffer and the "
    "concatenation repeats the last rank's value world_size times. Nothing checks that the output tensors are "
    "distinct. Every gather of the run is wrong: the token count that normalizes the training loss is twice rank "
    "1's count instead of the ranks' sum, and the evaluation's gathered losses are rank 1's shard repeated, so the "
    "eval loss is measured on half of the eval set. One process never gathers.",
    fix="[torch.empty_like(tensor) for _ in range(world_size)] (or all_gather_into_tensor into one output).",
    references=(
        "https://github.com/pytorch/pytorch/issues/14632 (c10d: check that allgather/gather output tensors point "
        "to different storage; list replication makes them alias)",
        "https://github.com/Lightning-AI/torchmetrics/pull/220 (fix gather_all_tensors: one distinct buffer per "
        "rank for all_gather)",
    ),
    manifest=Manifest(check="metric_differs", scenario="ddp", steps=8, params={"min_gap": 1e-4}),
)
def gather_aliased(tensor):
    """The all_gather receive buffers are one tensor repeated."""
    state = PartialState()
    if state.distributed_type == DistributedType.XLA:
        return _tpu_gather(tensor)
    if state.distributed_type not in TORCH_DISTRIBUTED_OPERATION_TYPES:
        return tensor

    def _gather_one(tensor):
        if tensor.ndim == 0:
            tensor = tensor.clone()[None]
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        output_tensors = [torch.empty_like(tensor)] * state.num_processes
        torch.distributed.all_gather(output_tensors, tensor)
        return torch.cat(output_tensors, dim=0)

    return recursively_apply(_gather_one, tensor, error_on_other_type=True)
