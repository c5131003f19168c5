"""The fourth blind fault set: bugs of real public threads, written by someone who never read the detectors.

``make bench-blind BLIND=blind4`` (``faultbench bench --plugin benchmarks/blind4/blind_faults.py
--only-plugin-faults --blind``) scores the suite on these faults alone; ``benchmarks/blind4/test_manifest.py``
proves that each one changes its run against the clean run. Every fault replaces one seam of the reference
(``ref``) or of the Hugging Face target (``hf``) with the buggy code a real engineer shipped, as the cited
issue or pull request describes it. The set was written from the registry (to avoid its mechanisms), the
targets' source and the bug threads only.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Mapping

import safetensors.torch
import torch
import torch.nn.functional as F
from accelerate.state import PartialState
from accelerate.utils.dataclasses import DistributedType
from torch import nn
from transformers.data.data_collator import _torch_collate_batch, pad_without_fast_tokenizer_warning
from transformers.masking_utils import causal_mask_function
from transformers.trainer import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    CONFIG_NAME,
    FSDP_MODEL_NAME,
    MIN_PEFT_VERSION,
    OPTIMIZER_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SCHEDULER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    OptimizerNames,
    PreTrainedConfig,
    __version__,
    _is_peft_model,
    check_torch_load_is_safe,
    clear_device_cache,
    get_fsdp_ckpt_kwargs,
    get_scheduler,
    is_sagemaker_mp_enabled,
    is_torch_xla_available,
    load_fsdp_model,
    load_sharded_checkpoint,
    logger,
    reissue_pt_warnings,
    save_fsdp_model,
    save_fsdp_optimizer,
)

from faultbench.faults.registry import Manifest, fault
from faultbench.model.data import IGNORE_INDEX

# transformers and accelerate define these only where torch_xla / SageMaker MP are installed; the copied bodies
# use them only behind those checks, as the originals do
xm = smp = smp_forward_backward = DeepSpeedSchedulerWrapper = None

_TRAINER = "transformers.trainer.Trainer"
_ACCUM = {"recipe": "accum"}  # HF: 4 micro-batches per optimizer step


# ============================================================ ref: collate ====================================

@fault(
    "blind4_naive_packing",
    seam="model.data.collate",
    title="Right-padded batches are packed: short documents are concatenated into one row with no boundary",
    subsystem="collate",
    also_acceptable=("data", "mask"),
    trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="To cut padding waste, collate packs consecutive documents of a right-padded batch into rows no "
    "longer than the batch's longest document (the generation path, left padding, is left alone). The packing "
    "is the naive one: the attention mask is 1 over the whole row, positions run on across the boundary and the "
    "labels are the row's ids, so every document after the first attends to the documents before it in its "
    "row, starts at a non-zero position, and its BOS becomes a target predicted from the previous document's "
    "EOS. The rows, the number of targets per batch and the evaluated loss all change; nothing crashes.",
    fix="Do not pack in collate; or pack with per-document position ids, a block-diagonal (document) mask and "
    "ignore_index on each document's first label.",
    references=(
        "huggingface/trl#784: 'Packing does not adjust attention masks?' (packed samples attend to each other)",
        "huggingface/transformers#25452: 'Packing without cross-contamination'",
        "MeetKai/functionary#265: naive packing gives a different loss than packing without cross-contamination",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.02}),
)
def collate_naive_packing(docs, pad_id, pad_side="right", ignore_index=IGNORE_INDEX):
    """Consecutive documents packed into shared rows with one all-ones mask and running positions."""
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
    if pad_side == "right":
        # pack short documents together so fewer pad columns are computed
        limit = max(len(d) for d in docs)
        rows, current = [], []
        for ids in docs:
            if current and len(current) + len(ids) > limit:
                rows.append(current)
                current = []
            current = current + list(ids)
        rows.append(current)
        docs = rows
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
        labels[row, start + 1 : start + n] = tokens[1:]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),  # noqa: F821 (model.data's)
        "labels": labels,
    }


# ============================================================ ref: mask =======================================

@fault(
    "blind4_decode_mask_not_offset",
    seam="model.attention.build_attention_mask",
    title="Query positions of the mask counted from 0 instead of from the cache length: cached decode sees only "
    "the first key",
    subsystem="mask",
    also_acceptable=("position", "model"),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="build_attention_mask numbers the queries 0..query_len-1, as if the keys started with them. "
    "Without a cache the two are the same, so training, left padding included, is unchanged; in cached decode "
    "the one new query is numbered 0 and the causal test key_pos <= query_pos lets it attend to the first "
    "column only (a left pad, or the prompt's first token). Generation silently runs on the wrong context and "
    "disagrees with an uncached forward of the same tokens.",
    fix="Anchor the query positions at the end of the key axis: arange(key_len - query_len, key_len).",
    references=(
        "tinygrad/tinygrad#15949: 'ONNX Attention is_causal mask ignores past_key/past_value length' (mask "
        "anchored to the start of the K axis; silently wrong after the first cached step)",
        "lucidrains/x-transformers#187: 'Bugs in generation with cache' (top-left causal alignment masks the cache)",
        "onnx/onnx#8054: offset-aware causal masking for KV-cache decode",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "cached_logit_gap", "faulty_min": 1e-2, "clean_max": 1e-4}),
)
def build_attention_mask_no_offset(attention_mask, query_len, dtype):
    """The queries are numbered from 0, not from the number of cached tokens."""
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


# ============================================================ ref: position ===================================

@fault(
    "blind4_rope_after_cache_append",
    seam="model.attention.CausalSelfAttention.forward",
    title="Keys cached before RoPE and rotated after the cache append: every cached key gets the new token's angle",
    subsystem="position",
    also_acceptable=("model",),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="The keys are written to the KV cache unrotated and RoPE is applied to the whole key sequence the "
    "cache returns, with the rotary angles of the tokens of this call. In training and in the prefill the call "
    "holds every token, so nothing changes; in each cached decode step the angles are those of the one new "
    "token, so all cached keys are rotated to its position, the query-key angle no longer depends on the "
    "distance and decode loses every position cue while uncached scoring keeps them.",
    fix="Rotate the keys with their own positions before they enter the cache (apply_rope, then cache.update).",
    references=(
        "tenstorrent/tt-forge-onnx#422: 'Problems with KV cache padding': K appended to the cache, then rotary "
        "applied to every row with the wrong position index",
        "MemTensor/MemOS#2315: cached keys carry the phase of the position they were rotated at; moving or "
        "re-rotating them breaks relative distances",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "cached_logit_gap", "faulty_min": 5e-3, "clean_max": 1e-4}),
)
def attention_forward_rope_after_cache(self, x, rope, attn_mask, cache=None, layer_idx=0):
    """Keys are rotated after the cache append, all with the current call's angles."""
    B, T, C = x.shape
    q, k, v = self.qkv(x).split(C, dim=2)  # (B, T, C) each
    q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
    k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    q = apply_rope(q, *rope)  # noqa: F821 (model.attention's)
    if cache is not None:
        k, v = cache.update(layer_idx, k, v)  # (B, nh, T_past + T, hs), stored as projected
    k = apply_rope(k, *rope)  # noqa: F821
    y = attend(q, k, v, attn_mask, self.dropout if self.training else 0.0)  # noqa: F821
    y = y.transpose(1, 2).reshape(B, T, C)
    return self.resid_dropout(self.proj(y))


# ============================================================ ref: model ======================================

@fault(
    "blind4_heads_merged_without_transpose",
    seam="model.attention.CausalSelfAttention.forward",
    title="Attention heads merged with a reshape of (B, nh, T, hs) without the transpose: tokens get other "
    "positions' outputs",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="After attention, y has shape (B, nh, T, hs) and is reshaped straight to (B, T, C). Row-major "
    "memory is head-major, so 'token' t of the result is a block of consecutive positions of one head, not the "
    "n_head outputs of token t. The shapes agree, so nothing fails; each position now mixes other positions' "
    "attention outputs, later ones included (causality leaks through the merge), and the model fits what it "
    "can of the scrambled layout. A one-token decode step is unaffected (T = 1), prefill is not.",
    fix="y.transpose(1, 2).reshape(B, T, C) (or .contiguous().view after the transpose).",
    references=(
        "jsbaan/transformer-from-scratch#6: 'Fix several bugs, one critical' (missing permute before a reshape in "
        "multi-head attention scrambles token representations; a training test still passed)",
        "649453932/Chinese-Text-Classification-Pytorch#10: view() after attention puts values in the wrong order",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.02}),
)
def attention_forward_no_transpose(self, x, rope, attn_mask, cache=None, layer_idx=0):
    """The heads are merged by a reshape that skips the transpose back to (B, T, nh, hs)."""
    B, T, C = x.shape
    q, k, v = self.qkv(x).split(C, dim=2)  # (B, T, C) each
    q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
    k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    q = apply_rope(q, *rope)  # noqa: F821 (model.attention's)
    k = apply_rope(k, *rope)  # noqa: F821
    if cache is not None:
        k, v = cache.update(layer_idx, k, v)  # (B, nh, T_past + T, hs)
    y = attend(q, k, v, attn_mask, self.dropout if self.training else 0.0)  # noqa: F821 (B, nh, T, hs)
    y = y.contiguous().view(B, T, C)
    return self.resid_dropout(self.proj(y))


# ============================================================ ref: precision ==================================

@fault(
    "blind4_loss_in_half_precision",
    seam="model.loss.lm_loss",
    title="Cross-entropy computed on the autocast logits without upcasting: bf16 log-softmax and a bf16 sum",
    subsystem="precision",
    also_acceptable=("loss",),
    trigger="amp-only",
    symptoms=("silent-quality", "eval-metric"),
    explanation="lm_loss drops the .float() on the logits. Under bf16 the model returns bf16 logits and the loss "
    "runs outside autocast, so log-softmax, the per-token losses and the summed reduction are all bf16: the sum "
    "of about a thousand token losses is rounded to bf16's spacing (16 or 32 at that magnitude) before the "
    "division, the logged and evaluated losses are quantized and the gradient of every logit carries bf16 "
    "rounding. fp32 runs are untouched.",
    fix="shifted_logits = logits[:, :-1].float() (compute the cross-entropy in float32).",
    references=(
        "Modalities/modalities#464: 'fix(loss): compute causal-LM cross-entropy in float32' (bf16 logits, nothing "
        "promotes them; loss quantized to the bf16 grid)",
        "huggingface/transformers#34147: 'Only cast logits to float when computing loss'",
        "google-deepmind/optax#1020: precision bug in softmax_cross_entropy with bfloat16 logits",
    ),
    manifest=Manifest(check="metric_differs", steps=30, variant={"train": {"precision": "bf16"}},
                      params={"min_gap": 0.002}),
)
def lm_loss_no_upcast(logits, labels, num_targets=None, ignore_index=IGNORE_INDEX):
    """The cross-entropy runs in the logits' dtype."""
    shifted_logits = logits[:, :-1]  # (B, T-1, V)
    shifted_labels = labels[:, 1:]  # (B, T-1)
    total = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
        ignore_index=ignore_index, reduction="sum",
    )
    if num_targets is None:
        num_targets = count_targets(labels, ignore_index)  # noqa: F821 (model.loss's)
    return total / max(num_targets, 1)


# ============================================================ ref: loss =======================================

@fault(
    "blind4_loss_mean_per_sequence",
    seam="model.loss.lm_loss",
    title="Loss averaged per document, then over documents: every document weighs the same, whatever its length",
    subsystem="loss",
    trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="lm_loss takes the token mean of each row and then the mean over rows (a 'sequence mean') and "
    "ignores num_targets. A token of a 3-token document now weighs as much as ten tokens of a 30-token one: "
    "the objective is no longer the corpus cross-entropy, the rare long documents are under-trained, the "
    "logged loss is a macro average that depends on how documents were batched, and evaluate() reports it "
    "too. Under accumulation each micro-batch's mean is also added k times over the window.",
    fix="Sum the token losses over the whole batch and divide by the (window's) number of targets.",
    references=(
        "PrimeIntellect-ai/prime-rl#102: 'fix normalized loss per sample and not per token'",
        "NovaSky-AI/SkyRL#133: token_mean vs sequence_mean loss reduction (per-sequence mean, then batch mean)",
        "OpenNMT/OpenNMT-tf#570: 'Problem in loss normalization' (per-sequence vs per-token averaging)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.02}),
)
def lm_loss_sequence_mean(logits, labels, num_targets=None, ignore_index=IGNORE_INDEX):
    """Each row's token mean, averaged over the rows."""
    shifted_logits = logits[:, :-1].float()
    shifted_labels = labels[:, 1:]
    per_token = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
        ignore_index=ignore_index, reduction="none",
    ).view(shifted_labels.shape)
    mask = shifted_labels != ignore_index
    per_row = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
    return per_row.mean()


# ============================================================ ref: optimizer ==================================

@fault(
    "blind4_clip_exhausted_generator",
    seam="model.train.clip_gradients",
    title="Gradient norm logged from model.parameters(), then clip_grad_norm_ given the same exhausted generator",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="clip_gradients keeps params = model.parameters() (a generator), iterates it to compute the norm "
    "it logs, and passes the same generator to clip_grad_norm_, which then sees no parameters and clips "
    "nothing. The logged pre-clip norm is right, so the logs look healthy, but no step is ever clipped: the "
    "large early updates go through at full size.",
    fix="Materialize the parameters once (params = [p for p in model.parameters() if p.grad is not None]) and "
    "let clip_grad_norm_ return the norm it computed.",
    references=(
        "pytorch/pytorch#148259: 'Raise a warning when clip_grad_norm_ receives an exhausted generator' (no "
        "clipping occurs, silently)",
        "pytorch/torchtitan#1258: 'fix: clip_grad_norm_ general usage' (grads silently left unchanged for a "
        "generator)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, variant={"train": {"grad_clip": 0.25}},
                      params={"min_gap": 0.01}),
)
def clip_gradients_exhausted(model, optimizer, scaler, max_norm):
    """The norm is computed from the generator, which is then empty for the clipping call."""
    scaler.unscale_(optimizer)
    params = model.parameters()
    grads = [p.grad.detach() for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    return float(norm)


@fault(
    "blind4_tied_weight_stepped_twice",
    seam="model.optim.configure_optimizer",
    title="Parameters collected per module: the tied embedding/head matrix is in its group twice and stepped twice",
    subsystem="optimizer",
    also_acceptable=("model",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="configure_optimizer walks model.modules() and each module's own parameters, so the matrix shared "
    "by wte and lm_head is collected once per module. Both copies land in the no-decay group; torch only warns "
    "about duplicate parameters in a group, and AdamW then updates that matrix twice per step (its moments and "
    "step count advance twice). The embedding/head learns at double speed with a skewed bias correction while "
    "every other tensor learns normally.",
    fix="Collect model.parameters() (it yields a shared parameter once) or deduplicate by id.",
    references=(
        "pytorch/pytorch#40967: a parameter listed twice in one group is silently updated twice",
        "volcengine/veGiantModel#6: 'optimizer contains a parameter group with duplicate parameters' (tied "
        "embedding in the weight-decay groups)",
        "deepspeedai/DeepSpeed#195: 'detect redundant tensors in param group' (tied parameters)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.01}),
)
def configure_optimizer_per_module(model, cfg):
    """Each module's parameters in turn: a tied matrix is collected by both its modules."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if not param.requires_grad:
                continue
            (decay if param.dim() >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=cfg.lr, betas=cfg.betas,
                                       eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


# ============================================================ ref: checkpoint =================================

@fault(
    "blind4_resume_assign_detaches_optimizer",
    seam="model.checkpoint.load_checkpoint",
    title="Weights loaded with load_state_dict(assign=True) after the optimizer exists: the optimizer updates "
    "orphaned tensors",
    subsystem="checkpoint",
    also_acceptable=("optimizer",),
    trigger="on-resume",
    symptoms=("stall", "silent-quality"),
    explanation="load_checkpoint loads the weights with assign=True (to avoid a copy). The model's parameters "
    "become new tensors, but the optimizer built before the load still holds the old ones: after the resume "
    "the gradients land on the new parameters while AdamW steps the old ones, which get no gradient. The "
    "resumed model never changes again (and its gradients are never cleared), the optimizer state that was "
    "restored drives nothing, and the loss flattens right after the resume.",
    fix="Copy into the existing parameters (the default assign=False), or build the optimizer after an assign load.",
    references=(
        "pytorch/tutorials#2522: with assign=True the optimizer must be initialized after the module is loaded "
        "(it holds references to the old parameters)",
        "pytorch/pytorch#121158: load_state_dict docs: if assign is True the optimizer must be created after the "
        "call",
    ),
    manifest=Manifest(check="extra_at_least", scenario="resume", steps=24,
                      params={"key": "resume_loss_diff", "faulty_min": 0.02, "clean_max": 1e-6}),
)
def load_checkpoint_assign(run, directory):
    """The state dict's tensors replace the parameters the optimizer was built on."""
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
    run.model.load_state_dict(state["model"], assign=True)  # no copy: take the loaded tensors as they are
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.step = state["step"]
    run.history = [StepRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in state["history"]]  # noqa: F821
    restore_rng_state(state["rng"][run.rank])  # noqa: F821


# ============================================================ ref: distributed ================================

@fault(
    "blind4_comm_hook_without_allreduce",
    seam="model.distributed.average_gradients_hook",
    title="The DDP communication hook returns the local bucket without all-reducing it: replicas train apart",
    subsystem="distributed",
    trigger="multi-rank",
    symptoms=("desync", "silent-quality"),
    explanation="average_gradients_hook hands DDP a completed future of the bucket as it is (the all-reduce was "
    "taken out, as in torch's noop_hook used for communication-headroom runs). DDP believes the gradients are "
    "reduced, so nothing warns: each rank steps on the gradient of its own shard only, the replicas drift "
    "apart from the first step, and a checkpoint saved from rank 0 holds one replica trained on half the data.",
    fix="All-reduce the bucket (divided by the world size) and return the future of the reduced tensor.",
    references=(
        "jingyaogong/minimind#854: forward bypassed DDP, so backward performed no all-reduce; every rank stepped "
        "on local gradients and the replicas silently diverged",
        "bytetriper/RAE#40: 'Potential bug in DDP grad allreduce' (grads never all-reduced)",
        "pytorch/pytorch#42399: with a communication hook DDP does no reduction of its own; the hook must",
    ),
    manifest=Manifest(check="extra_at_least", scenario="ddp", steps=10,
                      params={"key": "rank_param_diff", "faulty_min": 1e-4, "clean_max": 1e-7}),
)
def average_gradients_noop(process_group, bucket):
    """The bucket is returned as this rank computed it: no communication."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# ============================================================ ref: eval =======================================

@fault(
    "blind4_eval_mean_of_batch_means",
    seam="model.evaluate.evaluate",
    title="The validation loss is the mean of the batches' means, not the token mean",
    subsystem="eval",
    trigger="eval-only",
    symptoms=("eval-metric",),
    explanation="evaluate() adds each batch's token-mean loss and divides by the number of batches. Batches with "
    "few tokens (short documents, the short last batch) weigh as much as full ones, so the reported loss "
    "depends on eval_batch_size and on how the documents fall into batches, and it is no longer comparable "
    "with the corpus floor or with the training loss. Training is untouched.",
    fix="Weight each batch by its number of targets: total += loss * n, count += n.",
    references=(
        "huggingface/transformers#39241: '[Trainer] Eval loss depends on batch size'",
        "huggingface/transformers#24839: eval_loss of the same data differs with the batch size (macro average)",
        "karpathy/llm.c#710: 'Different batch_size results in different evaluation loss'",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 5e-4}),
)
def evaluate_mean_of_batch_means(model, docs, pad_id, batch_size, precision="fp32", pad_side="right"):
    """Every batch counts once, whatever its number of tokens."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for i in range(0, len(docs), batch_size):
            batch = {k: v.to(device) for k, v in collate(docs[i : i + batch_size], pad_id, pad_side).items()}  # noqa: F821
            with autocast_context(precision, device.type):  # noqa: F821
                logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            n = count_targets(batch["labels"])  # noqa: F821
            total += lm_loss(logits, batch["labels"], n).item()  # noqa: F821
            count += 1
    finally:
        model.train(was_training)
    return total / count


# ============================================================ hf: data ========================================

@fault(
    "blind4_hf_microbatch_reused",
    target="hf", seam=f"{_TRAINER}.get_batch_samples",
    title="The accumulation window reuses its first micro-batch: one batch is trained k times per step",
    subsystem="data",
    also_acceptable=("optimizer",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="get_batch_samples fetches a batch only when it has none yet (inputs = inputs if inputs else "
    "next(iterator)), so every micro-batch of the window is the first one again. Each optimizer step sees one "
    "micro-batch k times instead of k different ones, the data loader advances one batch per step, the "
    "effective batch is k times smaller and nothing errors; num_items_in_batch counts the repeats, so the "
    "loss scale looks right.",
    fix="Fetch a new batch from the epoch iterator for every micro-batch of the window.",
    references=(
        "baaivision/URSA#10: 'run_model reuses the same inputs across accum_steps instead of fetching a new "
        "batch each step'",
        "michaelnny/InstructLLaMA#6: 'Wrong implementation of gradient accumulation' (always the same data)",
    ),
    manifest=Manifest(check="extra_at_least", steps=8, variant=_ACCUM,
                      params={"key": "repeated_batches", "faulty_min": 0.5, "clean_max": 0.0}),
)
def get_batch_samples_reused(self, epoch_iterator, num_batches, device):
    """A batch is fetched only while none is held: the window repeats its first micro-batch."""
    batch_samples = []
    inputs = None
    for _ in range(num_batches):
        try:
            inputs = inputs if inputs else next(epoch_iterator)
        except StopIteration:
            break
        batch_samples.append(inputs)

    num_items_in_batch = self._get_num_items_in_batch(batch_samples, device)
    return batch_samples, num_items_in_batch


# ============================================================ hf: collate =====================================

@fault(
    "blind4_hf_pad_id_zero_falsy",
    target="hf", seam="transformers.data.data_collator.DataCollatorForLanguageModeling.torch_call",
    title="Pad id chosen with 'pad_token_id or eos_token_id': pad id 0 is falsy, so EOS labels are masked and pads "
    "are targets",
    subsystem="collate",
    also_acceptable=("data", "loss"),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The collator picks the id to mask as tokenizer.pad_token_id or tokenizer.eos_token_id (for "
    "tokenizers without a pad token). This tokenizer's pad id is 0, which is falsy, so the fallback wins: "
    "every EOS label becomes -100 and the pad positions keep their id as a label. The model is trained to "
    "predict padding after each short document and never to end one; the loss looks ordinary.",
    fix="Test for None explicitly: pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id "
    "(and mask by the attention mask rather than by id).",
    references=(
        "NVIDIA-NeMo/Automodel#3704: 'correct attention mask for left-padded and pad-id-0 tokenizers' (`pad or "
        "eos` with pad id 0 picks eos)",
        "huggingface/transformers#6213: '[DataCollatorForLanguageModeling] fix labels' (which pad id the causal-LM "
        "collator masks, and when)",
    ),
    manifest=Manifest(check="extra_at_most", steps=4,
                      params={"key": "eos_target_fraction", "faulty_max": 0.0, "clean_min": 0.99}),
)
def torch_call_pad_or_eos(self, examples):
    """The id masked in the labels is `pad_token_id or eos_token_id`."""
    # Handle dict or lists with proper padding and conversion to tensor.

    if self.seed is not None and self.generator is None:
        # If we have a seed, we need to create a generator object. Subsequent calls to this function will use the
        # same generator.
        # If no seed supplied, we will use the global RNG
        self.create_rng()

    if isinstance(examples[0], Mapping):
        batch = pad_without_fast_tokenizer_warning(
            self.tokenizer, examples, return_tensors="pt", pad_to_multiple_of=self.pad_to_multiple_of
        )
    else:
        batch = {
            "input_ids": _torch_collate_batch(examples, self.tokenizer, pad_to_multiple_of=self.pad_to_multiple_of)
        }

    # If special token mask has been preprocessed, pop it from the dict.
    special_tokens_mask = batch.pop("special_tokens_mask", None)
    offset_mapping = batch.pop("offset_mapping", None)
    if self.mlm:
        batch["input_ids"], batch["labels"] = self.torch_mask_tokens(
            batch["input_ids"], special_tokens_mask=special_tokens_mask, offset_mapping=offset_mapping
        )
    else:
        labels = batch["input_ids"].clone()
        # tokenizers without a pad token pad with EOS
        pad_id = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id
        if pad_id is not None:
            labels[labels == pad_id] = -100
        batch["labels"] = labels
    return batch


# ============================================================ hf: model =======================================

@fault(
    "blind4_hf_rmsnorm_offset_convention",
    target="hf", seam="transformers.models.llama.modeling_llama.LlamaRMSNorm.forward",
    title="RMSNorm applies Gemma's (1 + weight) gain to Llama's weights initialized at 1: every norm doubles",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="LlamaRMSNorm.forward multiplies by (1 + weight), the convention of norms that store their gain "
    "as an offset from one (Gemma, Qwen3-Next), while Llama initializes and trains the weight as the gain "
    "itself (ones). Every norm starts at gain 2, the attention and MLP inputs and the final hidden state are "
    "twice as large as the model was built for, the logits start twice as sharp and the norm weights learn "
    "around an offset. It trains and decodes, to a different model.",
    fix="Multiply by self.weight (or store the gain as an offset and initialize it at zero, consistently).",
    references=(
        "linkedin/Liger-Kernel#74: '[bug fix] Gemma needs RMSNorm with 1.0 offset' (Llama-style norm applied to "
        "Gemma)",
        "huggingface/transformers#40796: '[RMSNorm] Fix rms norm init for models that center around 1' "
        "(1 + 1 = 2, doubling effect)",
        "pytorch/executorch#19901: 'Fix Gemma RMSNorm +1 offset missing on --checkpoint path'",
    ),
    manifest=Manifest(check="metric_differs", steps=16, params={"min_gap": 0.01}),
)
def rmsnorm_forward_offset(self, hidden_states):
    """The gain is taken as an offset from one."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (1.0 + self.weight) * hidden_states.to(input_dtype)


# ============================================================ hf: optimizer ===================================

@fault(
    "blind4_hf_warmup_steps_as_ratio",
    target="hf", seam=f"{_TRAINER}.create_scheduler",
    title="warmup_steps multiplied by the number of training steps as if it were a ratio: the warmup never ends",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="create_scheduler computes the warmup as ceil(num_training_steps * args.warmup_steps), the "
    "formula for a warmup ratio (warmup_ratio was folded into warmup_steps, where a value below 1 means a "
    "ratio), applied to a step count of 8. The warmup lasts 16 x 8 = 128 steps of a 16-step run, so the "
    "learning rate climbs to one eighth of its peak and training ends there; the cosine decay never starts.",
    fix="Use args.get_warmup_steps(num_training_steps): a count >= 1 is steps, only a value below 1 is a ratio.",
    references=(
        "huggingface/transformers#41326: 'Deprecate warmup_ratio' (warmup_steps now also takes a float ratio)",
        "huggingface/trl#4983: 'Replace warmup_ratio with warmup_steps' (a value below 1 is interpreted as a "
        "ratio)",
    ),
    manifest=Manifest(check="lr_ratio", steps=16, params={"step": 4, "min_ratio": 0.01, "max_ratio": 0.2}),
)
def create_scheduler_warmup_ratio(self, num_training_steps, optimizer=None):
    """The warmup count is scaled by the run length."""
    if self.lr_scheduler is None:
        if optimizer is None:
            if is_sagemaker_mp_enabled() and smp.state.cfg.fp16:
                # If fp16 is enabled, we unwrap the optimizer
                optimizer = self.optimizer.optimizer
            else:
                optimizer = self.optimizer
        self.lr_scheduler = get_scheduler(
            self.args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=math.ceil(num_training_steps * self.args.warmup_steps),
            num_training_steps=num_training_steps,
            scheduler_specific_kwargs=self.args.lr_scheduler_kwargs,
        )
        self._created_lr_scheduler = True
    return self.lr_scheduler


@fault(
    "blind4_hf_zero_grad_each_microbatch",
    target="hf", seam=f"{_TRAINER}.training_step",
    title="optimizer.zero_grad() at the start of every micro-batch: accelerate clears on the sync one, so only "
    "the last micro-batch's gradient is used",
    subsystem="optimizer",
    also_acceptable=("loss",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="training_step clears the gradients before each forward ('no stale grads'). Accelerate's "
    "optimizer wrapper ignores zero_grad on the micro-batches that do not sync and honours it on the window's "
    "last one, so the gradients of the first k-1 micro-batches are wiped right before the last backward. Each "
    "update is the gradient of one micro-batch, still divided by the whole window's token count: k times "
    "smaller and k times noisier. Without accumulation nothing changes.",
    fix="Clear the gradients after the optimizer step (Trainer's loop already does), never inside the window.",
    references=(
        "starVLA/starVLA#395: 'Gradient accumulation only uses the last microbatch when using Accelerate "
        "accumulation' (zero_grad at the start of accumulate takes effect on the sync micro-batch)",
        "QwenLM/Qwen3-TTS#326: 'Parameters are updated before gradient accumulation is complete'",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, variant=_ACCUM, params={"min_ratio": 0.05, "max_ratio": 0.7}),
)
def training_step_zero_grad_first(self, model, inputs, num_items_in_batch=None):
    """Gradients are cleared before every micro-batch."""
    # Prepare buffers for context parallelism

    cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)

    # Context manager is no-op if CP isn't enabled
    with cp_context():
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        self.optimizer.zero_grad()  # start every micro-batch from clean gradients

        inputs = self._prepare_inputs(inputs)
        if is_sagemaker_mp_enabled():
            loss_mb = smp_forward_backward(model, inputs, self.args.gradient_accumulation_steps)
            return loss_mb.reduce_mean().detach().to(self.args.device)

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


# ============================================================ hf: checkpoint ==================================

@fault(
    "blind4_hf_optimizer_state_saved_bf16",
    target="hf", seam=f"{_TRAINER}._save_optimizer_and_scheduler",
    title="The optimizer state is written in bf16 to halve the checkpoint: the resumed AdamW runs on rounded "
    "moments",
    subsystem="checkpoint",
    also_acceptable=("precision", "optimizer"),
    trigger="on-resume",
    symptoms=("divergence",),
    explanation="_save_optimizer_and_scheduler casts every floating tensor of the optimizer state (exp_avg, "
    "exp_avg_sq, the step counters) to bfloat16 before torch.save, to halve optimizer.pt. Loading casts them "
    "back to the parameters' float32, so the resume succeeds, but the first and second moments have lost "
    "their low 16 bits: every update after the resume differs from the uninterrupted run's and the resumed "
    "run drifts away from it (step counts above 256 would also round).",
    fix="Save the optimizer state at full precision (model weights may be stored in a lower dtype, the moments not).",
    references=(
        "vllm-project/speculators#899: 'Save and load optimizer state at full precision in checkpoints' "
        "(optimizer state converted to bf16; resumed runs visibly deviate)",
        "TensorAuto/OpenTau#184: 'checkpoint resume silently casts bf16 Adam state to fp32 (lossy)'",
    ),
    manifest=Manifest(check="extra_at_least", scenario="resume", steps=16,
                      params={"key": "resume_param_gap", "faulty_min": 1e-6, "clean_max": 1e-7}),
)
def save_optimizer_and_scheduler_bf16(self, output_dir):
    """The optimizer's floating state is saved in bfloat16."""
    if is_torch_xla_available():
        xm.rendezvous("saving_optimizer_states")
        if self.is_fsdp_xla_v1_enabled:
            optm = {
                "optimizer": self.optimizer.state_dict(),
                "shard_metadata": self.model.get_shard_metadata(),
            }
            xm.save(
                optm,
                os.path.join(
                    output_dir, f"rank{self.args.process_index}-of-{self.args.world_size}-{OPTIMIZER_NAME}"
                ),
                master_only=False,
            )
        else:
            xm.save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_NAME))
        with warnings.catch_warnings(record=True) as caught_warnings:
            xm.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught_warnings)
    elif is_sagemaker_mp_enabled():
        opt_state_dict = self.optimizer.local_state_dict(gather_if_shard=False)
        smp.barrier()
        if smp.rdp_rank() == 0 or smp.state.cfg.shard_optimizer_state:
            smp.save(
                opt_state_dict,
                os.path.join(output_dir, OPTIMIZER_NAME),
                partial=True,
                v3=smp.state.cfg.shard_optimizer_state,
            )
    elif self.is_deepspeed_enabled:
        # under zero3 model file itself doesn't get saved since it's bogus! Unless deepspeed
        # config `stage3_gather_16bit_weights_on_model_save` is True
        accept_exclude_frozen_parameters = "exclude_frozen_parameters" in set(
            inspect.signature(self.model_wrapped.save_checkpoint).parameters.keys()
        )
        if accept_exclude_frozen_parameters and _is_peft_model(self.model):
            self.model_wrapped.save_checkpoint(output_dir, exclude_frozen_parameters=True)
        else:
            self.model_wrapped.save_checkpoint(output_dir)
    elif self.is_fsdp_enabled:
        # save fsdp specific ckpt for resuming from ckpt
        save_fsdp_model(
            self.accelerator.state.fsdp_plugin, self.accelerator, self.model, output_dir, **get_fsdp_ckpt_kwargs()
        )
        save_fsdp_optimizer(
            self.accelerator.state.fsdp_plugin, self.accelerator, self.optimizer, self.model, output_dir
        )
    elif self.args.should_save:
        optimizer_state = self.optimizer.state_dict()
        # half the size on disk: the moments are stored in bfloat16
        optimizer_state["state"] = {
            index: {name: value.to(torch.bfloat16) if torch.is_tensor(value) and value.is_floating_point() else value
                    for name, value in param_state.items()}
            for index, param_state in optimizer_state["state"].items()
        }
        torch.save(optimizer_state, os.path.join(output_dir, OPTIMIZER_NAME))

    # Save SCHEDULER & SCALER
    is_deepspeed_custom_scheduler = self.is_deepspeed_enabled and not isinstance(
        self.lr_scheduler, DeepSpeedSchedulerWrapper
    )
    if (
        self.args.should_save
        and (not self.is_deepspeed_enabled or is_deepspeed_custom_scheduler)
        and not is_torch_xla_available()
    ):
        with warnings.catch_warnings(record=True) as caught_warnings:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        reissue_pt_warnings(caught_warnings)


# ============================================================ hf: distributed =================================

@fault(
    "blind4_hf_gather_skips_cpu_ranks",
    target="hf", seam="accelerate.utils.operations.gather",
    title="gather's dispatch list lacks MULTI_CPU: on CPU ranks it returns the local tensor, so the token count "
    "is never summed over ranks",
    subsystem="distributed",
    also_acceptable=("loss",),
    trigger="multi-rank",
    symptoms=("silent-quality", "eval-metric"),
    explanation="gather dispatches on the distributed type and lists the accelerator types (GPU, NPU, XPU) but "
    "not MULTI_CPU, whose ranks fall through to 'return tensor' with no collective and no error. Trainer "
    "gathers num_items_in_batch across ranks and then multiplies each rank's loss by the number of processes "
    "(average_tokens_across_devices): with the local count the loss and every gradient are twice what they "
    "should be on 2 ranks, clipping acts on doubled norms, and the logged train loss (and the eval loss, "
    "gathered the same way) is each rank's own.",
    fix="Dispatch every torch.distributed type (TORCH_DISTRIBUTED_OPERATION_TYPES, MULTI_CPU included) to the "
    "all-gather.",
    references=(
        "huggingface/accelerate#516: 'FSDP use case not considered in Accelerator.gather()' (a distributed type "
        "missing from gather's dispatch: the input tensor comes back ungathered)",
        "huggingface/transformers#34242: token averaging across DDP ranks (num_items_in_batch must be summed over "
        "devices)",
        "huggingface/transformers#37474: training_step mis-normalizes the token-mean loss across devices",
    ),
    manifest=Manifest(check="loss_above", scenario="ddp", steps=6, params={"min_gap": 1.0}),
)
def gather_without_cpu(tensor):
    """Only the accelerator distributed types are gathered; the others get their input back."""
    if PartialState().distributed_type == DistributedType.XLA:
        return _tpu_gather(tensor)  # noqa: F821 (accelerate.utils.operations')
    elif PartialState().distributed_type in (DistributedType.MULTI_GPU, DistributedType.MULTI_NPU,
                                             DistributedType.MULTI_XPU):
        return _gpu_gather(tensor)  # noqa: F821 (accelerate.utils.operations')
    else:
        return tensor


@fault(
    "blind4_hf_resume_keys_prefix_stripped",
    target="hf", seam=f"{_TRAINER}._load_from_checkpoint",
    title="Resume strips the base-model prefix from the checkpoint's keys, then loads with strict=False: the "
    "weights are silently not loaded",
    subsystem="checkpoint",
    trigger="on-resume",
    symptoms=("divergence", "silent-quality"),
    explanation="_load_from_checkpoint removes the 'model.' prefix from every key (meant to accept checkpoints "
    "of the bare base model, but backwards: such checkpoints lack the prefix, the full model's keys carry it). "
    "Trainer loads with strict=False, so the mismatch is only a logged warning about missing and unexpected "
    "keys: the resumed model keeps its fresh initialization everywhere but the LM head, while the optimizer, "
    "the schedule, the step counter and the data position are restored. The loss jumps back up after the "
    "resume and the run continues as if nothing happened.",
    fix="Load with the keys as saved (or add the prefix when a base-model checkpoint is detected) and fail on "
    "missing keys instead of warning.",
    references=(
        "pytorch/examples#1029: 'nn.module load_state_dict strict=False can silently load a corrupted model' "
        "(keys with an extra prefix; the model runs without error but is not the checkpoint)",
        "huggingface/transformers#29128: 'There were missing keys in the checkpoint model loaded' when resuming "
        "from a Trainer checkpoint",
        "pytorch/pytorch#141256: feedback for load_state_dict(strict=False): silent weight-loading failures",
    ),
    manifest=Manifest(check="extra_at_least", scenario="resume", steps=16,
                      params={"key": "resume_loss_gap", "faulty_min": 0.05, "clean_max": 1e-6}),
)
def load_from_checkpoint_prefix_stripped(self, resume_from_checkpoint, model=None):
    """The base-model prefix is stripped from the checkpoint keys before a non-strict load."""
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

            # accept checkpoints of the bare base model too: keys are matched without the base-model prefix
            prefix = f"{model.base_model_prefix}."
            state_dict = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state_dict.items()}

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


# ============================================================ hf: mask ========================================

@fault(
    "blind4_hf_sdpa_mask_query_offset_dropped",
    target="hf", seam="transformers.masking_utils.sdpa_mask",
    title="sdpa_mask numbers the queries from 0, ignoring q_offset: cached decode of a padded batch sees only "
    "the first keys",
    subsystem="mask",
    also_acceptable=("position",),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="The materialized mask builds its query indices as arange(q_length) without adding q_offset "
    "(the cache position). Training and prefill have q_offset 0 and are unchanged, and an unpadded decode "
    "step skips the mask (SDPA handles it); but whenever the mask is materialized in cached decode, a "
    "left-padded batch in generate() for example, the new token's query is placed at position 0 of the key "
    "axis and may attend to the first key only. Generation goes off the rails with no error, and eager "
    "attention, which builds its mask from this one, is affected the same way.",
    fix="q_arange = torch.arange(q_length) + q_offset, as for the keys.",
    references=(
        "lucidrains/x-transformers#187: 'Bugs in generation with cache' (top-left aligned causal mask with a "
        "cache masks out the cached keys)",
        "onnx/onnx#8054: causal masking must be offset-aware for KV-cache decode",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=16,
                      params={"key": "cached_logit_gap", "faulty_min": 0.05, "clean_max": 1e-4}),
)
def sdpa_mask_no_query_offset(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=causal_mask_function,
    attention_mask=None,
    local_size=None,
    allow_is_causal_skip=True,
    allow_is_bidirectional_skip=False,
    use_vmap=False,
    device="cpu",
    **kwargs,
):
    """The query indices are not offset by the cache position."""
    # Potentially pad the 2D mask
    padding_mask = prepare_padding_mask(attention_mask, kv_length, kv_offset)  # noqa: F821 (masking_utils')

    # Under specific conditions, we can avoid materializing the mask
    #   1. Causal masks can rely on the `is_causal` argument
    #   2. Bidirectional do not need any further processing (no bias)
    if allow_is_causal_skip and _ignore_causal_mask_sdpa(  # noqa: F821
        padding_mask, q_length, kv_length, q_offset, kv_offset, local_size
    ):
        return None
    if allow_is_bidirectional_skip and _ignore_bidirectional_mask_sdpa(padding_mask, kv_length, local_size):  # noqa: F821
        return None

    # Potentially add the padding 2D mask
    if padding_mask is not None:
        mask_function = and_masks(mask_function, padding_mask_function(padding_mask))  # noqa: F821

    batch_arange = torch.arange(batch_size, device=device)
    head_arange = torch.arange(1, device=device)
    q_arange = torch.arange(q_length, device=device)
    kv_arange = torch.arange(kv_length, device=device) + kv_offset

    # Actual mask creation
    # Option 1: Fast non-vmap mask creation (default)
    if not use_vmap:
        # Apply mask function element-wise through broadcasting
        attention_mask = mask_function(*_non_vmap_expansion_sdpa(batch_arange, head_arange, q_arange, kv_arange))  # noqa: F821
        # Expand the mask to match batch size and query length if they weren't used in the mask function
        attention_mask = attention_mask.expand(batch_size, -1, q_length, kv_length)

    # Option 2: Vmap mask creation (custom patterns)
    else:
        # This creates the 4D mask easily. Note that we need this context manager as vmap cannot handle slicing a
        # tensor from scalar tensor (it internally calls `.item()` which vmap does not allow, but this context works
        # around it. We don't need to add an offset to the mask_function either, as we vmap directly the correct
        # indices for k and kv indices
        with TransformGetItemToIndex():  # noqa: F821
            attention_mask = _vmap_expansion_sdpa(mask_function)(batch_arange, head_arange, q_arange, kv_arange)  # noqa: F821

    return attention_mask
