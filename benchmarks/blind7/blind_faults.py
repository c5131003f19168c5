"""Blind set 7: faults written from real bug threads by someone who never read the detectors.

Loaded as a plugin (``make bench-blind BLIND=blind7``). Each fault is the buggy body of one seam of the reference
(``model/``) or of the HF target (functions of transformers 5.23.0 and accelerate 1.15.0), with a manifest that proves
it shows; ``pytest tests/faults/test_manifest.py --fault-plugin benchmarks/blind7/blind_faults.py`` runs the proofs.
The names imported below are those the seams' own modules define: a fault's body runs spliced into its seam's module.
"""

# the HF faults copy transformers' and accelerate's function bodies as they are (long lines, bare warnings.warn)
# ruff: noqa: E501, B028

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MethodType

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate.accelerator import (
    AcceleratedOptimizer,
    DynamoBackend,
    FP8BackendType,
    apply_fp8_autowrap,
    compile_regions,
    convert_outputs_to_fp32,
    ensure_weights_retied,
    get_mixed_precision_context_manager,
    get_model_tp_size,
    is_bitsandbytes_multi_backend_available,
    is_compiled_module,
    is_xpu_available,
    model_has_dtensor,
)
from torch import nn
from transformers.data.data_collator import _torch_collate_batch, pad_without_fast_tokenizer_warning
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.trainer import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    CONFIG_NAME,
    FSDP_MODEL_NAME,
    MIN_PEFT_VERSION,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    DistributedType,
    PreTrainedConfig,
    __version__,
    _is_peft_model,
    check_torch_load_is_safe,
    get_fsdp_ckpt_kwargs,
    is_sagemaker_mp_enabled,
    load_fsdp_model,
    load_sharded_checkpoint,
    logger,
)

from faultbench.faults.registry import Manifest, fault
from faultbench.model.attention import build_attention_mask
from faultbench.model.checkpoint import (
    FORMAT,
    CheckpointError,
    _config_mismatch,
    _gather_rng_states,
    _sha256,
    read_meta,
    restore_rng_state,
)
from faultbench.model.data import IGNORE_INDEX
from faultbench.model.distributed import global_target_count, grad_sync_context, is_distributed, mean_over_ranks
from faultbench.model.gpt import _compute_dtype
from faultbench.model.loss import count_targets
from faultbench.model.rope import position_ids_from_mask, rope_at
from faultbench.model.train import StepRecord, clip_gradients, forward_loss, optimizer_step

_LLAMA = "transformers.models.llama.modeling_llama"
_TRAINER = "transformers.trainer.Trainer"
# defined by transformers and accelerate only where torch_xla or SageMaker are installed, used only behind those checks
xm = xmp = smp = None
# a resume halfway through 12 steps: the resumed run must retrace the uninterrupted one exactly
_RESUME = dict(scenario="resume", steps=12, check="extra_at_least")


# ============================================================================================================
# The reference (model/)
# ============================================================================================================

@fault(
    "epoch_order_from_global_numpy_rng",
    seam="model.sampler.ResumableSampler.next_indices",
    title="The epoch's shuffle is drawn from NumPy's global generator: the order depends on the process, not on "
    '(seed, epoch)',
    subsystem="data",
    also_acceptable=('checkpoint', 'distributed'),
    trigger="on-resume",
    symptoms=('silent-quality',),
    explanation='ResumableSampler.next_indices reshuffles at the start of every epoch with np.random.permutation, '
    "NumPy's process-wide generator, instead of the generator seeded by (seed, epoch) that _permutation uses. The "
    'order now depends on whatever state the global generator is in when the epoch starts. run.py seeds it per '
    'rank, so the ranks of a data-parallel run draw different permutations and their shards of a global batch '
    "overlap (some documents twice a step, others never); and a run resumed mid-epoch rebuilds the epoch's order "
    'from (seed, epoch) in load_state_dict while the uninterrupted run used the global draw, so after the resume '
    "it trains on other batches than the run it continues. Nothing crashes and the sampler's state_dict looks "
    'right.',
    fix="Derive every epoch's order from a generator seeded by (seed, epoch) alone (self._permutation(epoch), as "
    "set_epoch does), never from np.random's global state.",
    references=(
        "TensorAuto/OpenTau#501: 'EpisodeAwareSampler draws its shuffle from the global RNG, which is "
        "rank-dependent'",
        "huggingface/accelerate#2574: 'Cant guarantee the reproducibility when using DataLoader shuffle' (the "
        'order after load_state and skip_first_batches)',
    ),
    manifest=Manifest(**_RESUME, params={"key": "resume_loss_diff", "faulty_min": 0.01, "clean_max": 0.0}),
)
def next_indices_global_shuffle(self) -> list[int]:
    """Each epoch's order is drawn from NumPy's global generator when the epoch starts."""
    if self.position == self.batches_per_epoch:
        self.set_epoch(self.epoch + 1)
    if self.position == 0:
        self._order = np.random.permutation(self.num_items)
    per_rank = self.global_batch // self.world_size
    start = self.position * self.global_batch + self.rank * per_rank
    self.position += 1
    return self._order[start : start + per_rank].tolist()


@fault(
    "decode_mask_rows_ignore_cache_length",
    seam="model.attention.build_attention_mask",
    title='Attention mask rows numbered from 0 during cached decoding: each new token sees only the first key',
    subsystem="mask",
    also_acceptable=('model',),
    trigger="eval-only",
    symptoms=('silent-quality',),
    explanation='build_attention_mask numbers the query rows 0..T_q-1 instead of starting them after the keys '
    'already in the KV cache (key_len - query_len). Without a cache (training, evaluation, any full forward) T_q '
    '== T_k and nothing changes. In generate() each decoded token is a single query row treated as position 0: '
    'the causal test key_pos <= query_pos lets it attend to the first key only (a pad, on a left-padded row). '
    'Every token generated after the prompt is predicted from the first token alone, so cached decoding disagrees '
    'with a full forward of the same tokens and greedy outputs degrade, while the train and val losses stay '
    'exactly clean.',
    fix='Offset the query rows by the cached length: query_pos = torch.arange(key_len - query_len, key_len).',
    references=(
        "meta-llama/llama#899: 'Incorrect attention mask breaks key-value caching'",
        "meta-llama/llama#900: 'Fix key-value caching for seqlen != 1 (Issue #899)' (the mask must be (seq_len, "
        'cache_len + seq_len) and mask j > cache_len + i)',
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=16,
                      params={"key": "cached_logit_gap", "faulty_min": 0.05, "clean_max": 1e-4}),
)
def build_attention_mask_rows_from_zero(attention_mask, query_len, dtype):
    """The query rows of the mask are numbered from 0, not from the number of keys already in the cache."""
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
    "position_ids_start_at_one",
    seam="model.rope.position_ids_from_mask",
    title="Positions counted from 1 (the mask's cumsum without the -1): a full-length sequence indexes past the "
    'RoPE table',
    subsystem="position",
    also_acceptable=('collate',),
    trigger="rare-batch",
    symptoms=('crash-index',),
    explanation="position_ids_from_mask returns attention_mask.cumsum(-1) without subtracting 1, so a row's first "
    'real token gets position 1. RoPE is relative: a uniform shift changes no attention score and the loss curve '
    'matches the clean run. But a document that fills all seq_len = max_positions slots (about 1% of the '
    'documents are truncated to exactly 64 tokens) now asks for position 64 of a 64-row table, and rope_at raises '
    'IndexError on the rare batch that holds one, in training, evaluation or decoding alike.',
    fix='Subtract one: positions = attention_mask.long().cumsum(-1) - 1, then clamp the left pads to 0.',
    references=(
        "huggingface/transformers#11242: 'position_ids generated from Roberta' (cumsum gives [1, ..., 512] and an "
        'index error in the position embedding)',
        "PrimeIntellect-ai/prime-rl#1545: review note 'Position IDs use 1-indexed instead of 0-indexed "
        "convention' (torch.arange(1, seq_len + 1))",
    ),
    manifest=Manifest(check="crash", steps=40, variant={"train": {"world_size": 1}},
                      params={"types": ["IndexError", "RuntimeError"]}),
)
def position_ids_one_based(attention_mask, past_len=0):
    """Positions count the real tokens up to and including each token: they start at 1."""
    positions = attention_mask.long().cumsum(-1)  # (B, T_total)
    return positions.clamp_(min=0)[:, past_len:]


@fault(
    "tied_embedding_scaled_by_sqrt_width",
    seam="model.gpt.GPT.forward",
    title='Token embeddings multiplied by sqrt(n_embd) although the LM head shares the matrix: the residual '
    'stream starts 8x too large',
    subsystem="model",
    trigger="always",
    symptoms=('silent-quality',),
    explanation="GPT.forward scales the token embeddings by sqrt(n_embd), the embedding factor of 'Attention Is "
    "All You Need', added to a model whose embedding matrix is tied to the LM head and initialized with std 0.02 "
    "for the head's sake. The blocks then add their small outputs to a residual stream 8 times larger than "
    "designed, so attention and MLP barely move the representation, and the shared matrix's gradient is dominated "
    "by the embedding path. The model trains, but the loss stays well above the clean run's for the same steps; "
    'nothing crashes and every shape is right.',
    fix='Drop the factor (the init already sets the embedding scale), or, if a scaled embedding is wanted, untie '
    'the head or put the inverse factor on the head side.',
    references=(
        "ml-explore/mlx-examples#591: 'T5: Fix scaling when embeddings are tied'",
        "jadore801120/attention-is-all-you-need-pytorch#138: 'shared embedding factor bug' (where the "
        'sqrt(d_model) factor goes when the embedding and the output projection share weights)',
    ),
    manifest=Manifest(check="loss_above", steps=60, params={"min_gap": 0.1, "metric": "val"}),
)
def gpt_forward_scaled_embeddings(self, input_ids, attention_mask=None, position_ids=None, cache=None):
    """Token embeddings are multiplied by sqrt(n_embd) before the blocks, although the head shares the matrix."""
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
    x = self.drop(self.wte(input_ids) * self.config.n_embd**0.5)  # (B, T, C)
    attn_mask = build_attention_mask(attention_mask, T, _compute_dtype(x))  # None: plain causal
    rope = rope_at(self.rope_cos, self.rope_sin, position_ids)
    for i, block in enumerate(self.blocks):
        x = block(x, rope, attn_mask, cache, i)
    return self.lm_head(self.ln_f(x))  # (B, T, vocab)


@fault(
    "label_smoothing_in_shared_loss",
    seam="model.loss.lm_loss",
    title='Label smoothing switched on inside lm_loss, which evaluation shares: the reported val loss is a '
    'smoothed cross-entropy',
    subsystem="loss",
    also_acceptable=('eval',),
    trigger="always",
    symptoms=('eval-metric', 'silent-quality'),
    explanation='lm_loss passes label_smoothing=0.1 to F.cross_entropy, added as a training regularizer in the '
    'one loss function that the training step and evaluate() both call. Training now fits targets with 10% of '
    'their mass spread over the whole vocabulary, and the validation loss is the smoothed cross-entropy too: it '
    "adds 0.1 x the mean -log p over all tokens of the vocabulary, so the val loss sits far above the clean run's "
    "and far above the corpus's loss floor, by much more than the model's real error. Perplexities computed from "
    'it are meaningless.',
    fix='Keep lm_loss a plain token-mean cross-entropy; apply smoothing (if wanted) in the training step only and '
    'evaluate with label_smoothing=0.',
    references=(
        "pytorch/pytorch#129050: 'Add comment for label_smoothing parameter in torch.nn.CrossEntropyLoss' (one "
        'criterion reused for validation distorts its targets)',
        "OpenNMT/OpenNMT-py#462: 'Add model regularization via label smoothing.' (validation perplexity 52 -> "
        "128: 'PPL looks weird because technically it's exp(h(q, p))')",
    ),
    manifest=Manifest(check="loss_above", steps=30, params={"min_gap": 0.3, "metric": "val"}),
)
def lm_loss_label_smoothed(logits, labels, num_targets=None, ignore_index=IGNORE_INDEX):
    """Label smoothing is switched on inside the one loss function that training and evaluation share."""
    shifted_logits = logits[:, :-1].float()  # (B, T-1, V): fp32 for a stable log-softmax
    shifted_labels = labels[:, 1:]  # (B, T-1)
    total = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
        ignore_index=ignore_index, reduction="sum", label_smoothing=0.1,
    )
    if num_targets is None:
        num_targets = count_targets(labels, ignore_index)
    return total / max(num_targets, 1)


@fault(
    "clip_inside_accumulation_loop",
    seam="model.train.train_step",
    title='Gradients unscaled and clipped after every micro-batch: partial sums get clipped, and fp16 raises on '
    'the second unscale',
    subsystem="optimizer",
    also_acceptable=('precision',),
    trigger="amp-only",
    symptoms=('crash-state', 'silent-quality'),
    explanation="train_step calls clip_gradients inside the accumulation loop, right after each micro-batch's "
    'backward, instead of once after the window. With fp16 the GradScaler refuses a second unscale_ of the same '
    "optimizer before update(): the window's second micro-batch raises RuntimeError ('unscale_() has already been "
    "called on this optimizer since the last update()') at the first step. Without a scaler nothing raises: each "
    "partial sum of the window's gradients is clipped to max_norm before the next micro-batch adds to it, so the "
    "step's gradient is a distorted mix (early micro-batches shrunk, the last one not) and the logged grad norm "
    'is that of the last partial sum.',
    fix='Accumulate every micro-batch first, then unscale and clip once per optimizer step (with accelerate: only '
    'when accelerator.sync_gradients).',
    references=(
        "huggingface/accelerate#641: 'Gradient accumulation doesn't work with Accelerate's clip_grad_norm_'",
        "tenstorrent/tt-metal#17568: '[tt-train] grad sync and clipping should happen only during stepping in the "
        "presence of grad accumulation'",
    ),
    manifest=Manifest(check="crash", steps=6, variant={"train": {"precision": "fp16", "accum": 2}},
                      params={"types": ["RuntimeError"]}),
)
def train_step_clip_per_micro_batch(run, micro_batches):
    """Gradients are unscaled and clipped after every micro-batch's backward, not once per window."""
    start = time.perf_counter()
    tcfg = run.config.train
    lr, scale = run.optimizer.param_groups[0]["lr"], run.scaler.get_scale()
    local_targets = sum(count_targets(b["labels"]) for b in micro_batches)
    per_rank_targets = global_target_count(local_targets, tcfg.device) / run.world_size
    loss = 0.0
    for i, batch in enumerate(micro_batches):
        with grad_sync_context(run.train_model, sync=i == len(micro_batches) - 1):
            micro_loss = forward_loss(run.train_model, batch, per_rank_targets, tcfg.precision)
            run.scaler.scale(micro_loss).backward()
        loss += micro_loss.item()
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
    "optimizer_stepped_around_scaler",
    seam="model.train.optimizer_step",
    title='optimizer.step() called directly instead of scaler.step(optimizer): an overflowed fp16 step is '
    'applied, not skipped',
    subsystem="precision",
    also_acceptable=('optimizer',),
    trigger="amp-only",
    symptoms=('nan',),
    explanation='optimizer_step steps the optimizer itself, then calls scaler.update(). The gradients were '
    "already unscaled by clip_gradients, so ordinary steps are identical to the clean run's; but when the loss "
    'scale is too high and a gradient overflows, scaler.step would have skipped the update (and update() halves '
    'the scale): here AdamW applies the inf/NaN gradients and every weight becomes NaN. The run looks fine until '
    'the first overflow, then its loss is NaN for good; with a high initial scale that happens at the first step.',
    fix='Step through the scaler: scaler.step(optimizer); scaler.update() (it skips the optimizer step whenever '
    'it found infs or NaNs).',
    references=(
        "IAHispano/Applio#860: 'optimizer step bugfix' (optim.step() called directly while using GradScaler "
        'bypasses its scaling and skipping)',
        "pytorch/pytorch#67590: 'Add OptState.UPDATED to torch.cuda.amp.GradScaler' (GradScaler skips "
        'optimizer.step() when it finds infs/NaNs)',
    ),
    manifest=Manifest(check="nan", steps=6, variant={"train": {"precision": "fp16", "init_scale": 2.0**24}},
                      params={"by_step": 3}),
)
def optimizer_step_bypasses_scaler(optimizer, scaler, scheduler) -> bool:
    """The optimizer is stepped directly: the scaler never gets to skip a step whose gradients overflowed."""
    scale_before = scaler.get_scale()
    optimizer.step()
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return scaler.get_scale() < scale_before


@fault(
    "resume_rebuilds_model_behind_optimizer",
    seam="model.checkpoint.load_checkpoint",
    title='Resume loads the weights into a freshly built model: the restored optimizer still holds the old '
    "model's parameters",
    subsystem="checkpoint",
    also_acceptable=('optimizer',),
    trigger="on-resume",
    symptoms=('stall',),
    explanation='load_checkpoint builds a new GPT from the config, loads the saved weights into it and makes it '
    'run.model (and run.train_model), then restores the optimizer state into the optimizer built with the run, '
    "whose param_groups point at the previous model's parameters. After the resume every backward fills the new "
    "model's gradients while AdamW steps tensors nothing uses any more (their .grad is None, so it changes "
    'nothing): the resumed model never moves, the loss stays flat at its checkpoint level while the LR schedule '
    "goes on, and the optimizer's state_dict looks perfectly restored.",
    fix="Load the state into the run's own model in place (run.model.load_state_dict), or rebuild the optimizer "
    "on the new model's parameters before loading its state.",
    references=(
        "NVIDIA/Megatron-LM#174: 'Optimizer will hold unloaded model weights when model weights but not optimizer "
        "states are loaded from a checkpoint.'",
        "pytorch/tutorials#1430: 'Problem of SAVING AND LOADING A GENERAL CHECKPOINT IN PYTORCH' (the optimizer "
        "is built on another module's parameters than the model loaded)",
    ),
    manifest=Manifest(**_RESUME, params={"key": "resume_loss_diff", "faulty_min": 0.05, "clean_max": 0.0}),
)
def load_checkpoint_rebuilds_model(run, directory) -> None:
    """The weights are loaded into a freshly built model that replaces run.model; the optimizer keeps the old one's
    parameters."""
    from .distributed import wrap_model
    from .gpt import GPT

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
    model = GPT(run.config.model).to(run.config.train.device)
    model.load_state_dict(state["model"])
    run.model = model
    run.train_model = wrap_model(model, run.config.train.device)
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.step = state["step"]
    run.history = [StepRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in state["history"]]
    restore_rng_state(state["rng"][run.rank])


@fault(
    "checkpoint_bf16_cast_in_place",
    seam="model.checkpoint.save_checkpoint",
    title='Checkpoint weights cast with Module.bfloat16() to halve the file: the saved weights are rounded, the '
    'live model converted',
    subsystem="checkpoint",
    also_acceptable=('precision',),
    trigger="on-resume",
    symptoms=('silent-quality',),
    explanation='save_checkpoint stores run.model.bfloat16().state_dict() to make checkpoints half the size. '
    'Module.bfloat16() converts the module in place: the run that saved now holds bf16 weights (any training '
    'continuing on it runs AdamW on bf16 parameters), and the checkpoint holds weights rounded to an 8-bit '
    'mantissa. A resumed run loads them into its fp32 parameters (load_state_dict casts silently) next to '
    "full-precision Adam moments, so it restarts from weights that differ from the saved run's by up to 2^-9 "
    'relative, and its losses and weights no longer retrace the uninterrupted run.',
    fix='Save the full-precision state dict; cast a copy for an export if needed, and never call .half() or '
    '.bfloat16() on the module being trained.',
    references=(
        "ultralytics/ultralytics#14418: 'Fix model.save() method to FP16' (adds deepcopy so .half() does not "
        'convert the model being trained)',
        "j-adamczyk/MLOps_course_AGH#14: 'Fixed .half() to edit original model' (a deepcopy before .half())",
    ),
    manifest=Manifest(**_RESUME, params={"key": "resume_loss_diff", "faulty_min": 1e-4, "clean_max": 0.0}),
)
def save_checkpoint_half_in_place(run, directory) -> Path:
    """The weights are stored in bf16 to halve the checkpoint, with Module.bfloat16(), which converts the live model."""
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
            "model": run.model.bfloat16().state_dict(),  # 16-bit weights on disk: half the size
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
    "target_count_not_reduced_across_ranks",
    seam="model.distributed.global_target_count",
    title="The step's target count is never summed over the ranks: each rank divides by its own count over the "
    'world size',
    subsystem="distributed",
    also_acceptable=('loss',),
    trigger="multi-rank",
    symptoms=('silent-quality',),
    explanation="global_target_count returns this rank's count without the all_reduce. train_step still divides "
    "it by the world size, as if it were global, so every rank's loss is its summed cross-entropy over (its own "
    'count / world_size): world_size times its token mean. DDP then averages world_size-times-too-large gradients '
    '(a mean of per-rank means, weighting a token by how few its rank holds), the pre-clip grad norm and the '
    'logged loss are world_size times the true ones, clipping fires far more often, and on 2 ranks the train loss '
    'reads twice the val loss. On one process it is exact.',
    fix='Sum the local target count over the ranks (dist.all_reduce) before normalizing.',
    references=(
        "pytorch/torchtitan#2206: 'Fix loss computation by handling valid token imbalance in train loop' "
        '(normalize by the valid tokens summed across DP ranks)',
        "PrimeIntellect-ai/prime-rl#2562: 'fix(rl): normalize loss by global token count across dp_cp' (a "
        'per-rank denominator upweights ranks with fewer loss tokens)',
    ),
    manifest=Manifest(check="loss_above", scenario="ddp", steps=6, params={"min_gap": 1.0, "metric": "train"}),
)
def global_target_count_local(local_count: int, device: str = "cpu") -> int:
    """The step's target count is never summed over the ranks."""
    if not is_distributed():
        return local_count
    total = torch.tensor([local_count], dtype=torch.long, device=device)
    return int(total)


# ============================================================================================================
# The HF target (transformers 5.23.0, accelerate 1.15.0)
# ============================================================================================================

@fault(
    "hf_accum_window_repeats_one_batch",
    target="hf", seam=f"{_TRAINER}.get_batch_samples",
    title='get_batch_samples fetches one micro-batch and appends it gradient_accumulation_steps times: a window '
    'trains on one batch',
    subsystem="data",
    trigger="always",
    symptoms=('silent-quality',),
    explanation='Trainer.get_batch_samples calls next(epoch_iterator) once, before its loop, and appends that '
    'batch num_batches times. With gradient accumulation every optimizer step averages accum copies of one '
    'micro-batch: the effective batch is 1/accum of the configured one (noisier steps), num_items_in_batch counts '
    'the copies so the loss scale looks right, and an epoch lasts accum times more optimizer steps because one '
    'batch per window is consumed. Without accumulation nothing changes; the logged loss and LR are plausible.',
    fix='Fetch a new batch on every iteration of the loop (batch_samples.append(next(epoch_iterator)), stopping '
    'at StopIteration).',
    references=(
        "baaivision/URSA#10: '[Potential Bug] run_model reuses the same inputs across accum_steps instead of "
        "fetching a new batch each step'",
        "michaelnny/InstructLLaMA#6: 'Wrong implementation of gradient accumulation' "
        '(itertools.islice(train_loader, gradient_accum_steps) always uses the same data)',
    ),
    manifest=Manifest(check="extra_at_least", steps=8, variant={"recipe": "accum"},
                      params={"key": "repeated_batches", "faulty_min": 0.5, "clean_max": 0.0}),
)
def get_batch_samples_fetch_once(self, epoch_iterator, num_batches, device):
    """The window's micro-batch is fetched once, before the loop, and appended num_batches times."""
    batch_samples = []

    try:
        batch = next(epoch_iterator)
    except StopIteration:
        batch = None
    for _ in range(num_batches):
        if batch is None:
            break
        batch_samples.append(batch)

    num_items_in_batch = self._get_num_items_in_batch(batch_samples, device)
    return batch_samples, num_items_in_batch


@fault(
    "hf_collator_labels_alias_input_ids",
    target="hf", seam="transformers.data.data_collator.DataCollatorForLanguageModeling.torch_call",
    title='Causal-LM collator takes labels = input_ids without a copy: masking the pad labels writes -100 into '
    'the inputs',
    subsystem="collate",
    also_acceptable=('data',),
    trigger="always",
    symptoms=('crash-index',),
    explanation="DataCollatorForLanguageModeling.torch_call (mlm=False) sets labels = batch['input_ids'] and then "
    'labels[labels == pad_token_id] = -100. Without .clone() both names are one tensor, so every pad in input_ids '
    "becomes -100 too, and the embedding lookup of the first padded batch raises IndexError ('index out of range "
    "in self'). A batch whose documents all have the same length has no pad and passes, which makes the crash "
    'look data-dependent.',
    fix="Copy before masking: labels = batch['input_ids'].clone().",
    references=(
        "huggingface/transformers#8619: 'DataCollatorForLanguageModeling modifies input_ids via labels variable'",
        "huggingface/transformers#4718: 'Replace pad_token with -100 for LM loss calculation' (the labels must be "
        'a copy: .clone().detach())',
    ),
    manifest=Manifest(check="crash", steps=4, params={"types": ["IndexError", "RuntimeError"]}),
)
def torch_call_labels_alias_inputs(self, examples):
    """The labels are the input_ids tensor itself, not a copy: masking the pad labels writes -100 into the inputs."""
    if self.seed is not None and self.generator is None:
        self.create_rng()

    if isinstance(examples[0], Mapping):
        batch = pad_without_fast_tokenizer_warning(
            self.tokenizer, examples, return_tensors="pt", pad_to_multiple_of=self.pad_to_multiple_of
        )
    else:
        batch = {
            "input_ids": _torch_collate_batch(examples, self.tokenizer, pad_to_multiple_of=self.pad_to_multiple_of)
        }

    special_tokens_mask = batch.pop("special_tokens_mask", None)
    offset_mapping = batch.pop("offset_mapping", None)
    if self.mlm:
        batch["input_ids"], batch["labels"] = self.torch_mask_tokens(
            batch["input_ids"], special_tokens_mask=special_tokens_mask, offset_mapping=offset_mapping
        )
    else:
        labels = batch["input_ids"]
        if self.tokenizer.pad_token_id is not None:
            labels[labels == self.tokenizer.pad_token_id] = -100
        batch["labels"] = labels
    return batch


@fault(
    "hf_rmsnorm_over_sequence_axis",
    target="hf", seam=f"{_LLAMA}.LlamaRMSNorm.forward",
    title='LlamaRMSNorm takes the mean square over the sequence axis: every token is scaled by statistics of its '
    'whole row',
    subsystem="model",
    trigger="always",
    symptoms=('silent-quality',),
    explanation='LlamaRMSNorm.forward computes hidden_states.pow(2).mean(1, keepdim=True), dimension 1 of (batch, '
    "seq, hidden), instead of -1. Each hidden channel is normalized by its root-mean-square over the row's "
    "positions, pads and future tokens included: a token's normalized state depends on its row's length and on "
    'tokens it must not see, the per-token scale RMSNorm guarantees is gone, and one document gives different '
    'logits alone and in a padded batch. The shapes broadcast, so nothing raises; the model trains to a visibly '
    'worse loss.',
    fix='Normalize over the hidden size: variance = hidden_states.pow(2).mean(-1, keepdim=True).',
    references=(
        "bkitano/llama-from-scratch#4: 'Incorrect RMSNorm' (the RMS over (T, D) instead of D: 'Normalization "
        "should be per-token, not per-sequence')",
        "udlbook/udlbook#237: 'Potential Misstatement Regarding LayerNorm in Section 12.4' (statistics across a "
        "sequence's tokens vs per token)",
    ),
    manifest=Manifest(check="loss_above", steps=16, variant={"lr": 1e-2}, params={"min_gap": 0.08, "metric": "val"}),
)
def rms_norm_over_sequence(self, hidden_states):
    """The mean square is taken over dimension 1, the sequence, instead of the hidden size."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


@fault(
    "hf_value_states_from_k_proj",
    target="hf", seam=f"{_LLAMA}.LlamaAttention.forward",
    title='Value states computed with k_proj (a copy-paste slip): the values equal the keys and v_proj never '
    'trains',
    subsystem="model",
    trigger="always",
    symptoms=('silent-quality',),
    explanation='LlamaAttention.forward builds value_states from self.k_proj(hidden_states), copied from the line '
    'above. Under grouped-query attention k_proj and v_proj have the same shape, so nothing fails: attention '
    'returns weighted sums of the un-rotated keys, the value projections get no gradient and keep their initial '
    'weights (AdamW skips parameters without a gradient), and the model learns with a crippled attention output. '
    'The parameter count and the checkpoint look normal.',
    fix='value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2).',
    references=(
        "snu-comparch/InfiniGen#5: 'report a bug' (the value cache is written with k where v belongs: 'should be "
        "... = v')",
        "Francis-Rings/StableAnimator#111: 'One bug in line 132 of attention_processor_normalized.py' (key and "
        'value taken from the wrong projections)',
    ),
    manifest=Manifest(check="extra_at_least", steps=8,
                      params={"key": "frozen_param_fraction", "faulty_min": 0.05, "clean_max": 0.0}),
)
def llama_attention_values_from_key_projection(self, hidden_states, position_embeddings=None, attention_mask=None,
                                               past_key_values=None, **kwargs):
    """The value states are computed with k_proj (a copy-paste slip): v_proj is never used."""
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
    "hf_clip_guard_consumes_param_generator",
    target="hf", seam="accelerate.accelerator.Accelerator.clip_grad_norm_",
    title='A guard in clip_grad_norm_ iterates the parameters generator first: the embedding is left out of the '
    'norm, never clipped',
    subsystem="optimizer",
    trigger="always",
    symptoms=('silent-quality',),
    explanation="Accelerator.clip_grad_norm_ gains a guard, 'if not any(p.grad is not None for p in parameters): "
    "return 0', before list(parameters). Trainer passes model.parameters(), a generator: any() consumes it up to "
    'the first parameter with a gradient, the token embedding, so the norm is computed over, and the clipping '
    "applied to, every parameter but that one. The logged grad_norm is too small, the embedding's gradient is "
    'never clipped, and no warning or error says so.',
    fix='Materialize the iterable first (parameters = list(parameters)) and test the list.',
    references=(
        "pytorch/pytorch#148259: 'Raise a warning when torch.nn.utils.clip_grad_norm_ receives an exhausted "
        "generator'",
        "PixArt-alpha/PixArt-alpha#160: 'fix iterator for params_to_clip' (accelerator.clip_grad_norm_ got an "
        'already consumed filter() and clipped nothing)',
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, params={"min_ratio": 0.05, "max_ratio": 0.97}),
)
def clip_grad_norm_guard_consumes_generator(self, parameters, max_norm, norm_type=2):
    """A guard that skips clipping a frozen model iterates the parameters generator first: the parameter it stops on is never clipped nor counted."""
    if self.distributed_type == DistributedType.FSDP:
        self.unscale_gradients()
        parameters = [p for p in parameters]
        for model in self._models:
            if parameters == [p for p in model.parameters()]:
                if not self.is_fsdp2:
                    return model.clip_grad_norm_(max_norm, norm_type)
                else:
                    return self._clip_grad_norm_dtensor_aware(parameters, max_norm, norm_type=norm_type)
    elif self.distributed_type == DistributedType.DEEPSPEED:
        # DeepSpeed handles gradient clipping internally, but we can retrieve the gradient norm
        if self.deepspeed_engine_wrapped is not None:
            return self.deepspeed_engine_wrapped.get_global_grad_norm()
        return None
    elif self.distributed_type == DistributedType.XLA:
        # Reduce gradients first for XLA
        for acc_opt in self._optimizers:
            if not acc_opt.gradient_state.is_xla_gradients_synced:
                opt = acc_opt
                while isinstance(opt, AcceleratedOptimizer):
                    opt = opt.optimizer
                gradients = xm._fetch_gradients(opt)
                # Use xm.all_reduce to perform an in-place all-reduce. Recursive all-reduce each tensor
                # one by one in self.reduce is non-inplace.
                xm.all_reduce("sum", gradients, scale=1.0 / self.num_processes)
                # Set is_xla_gradients_synced to True to avoid all-reduce twice in the AcceleratedOptimizer step.
                acc_opt.gradient_state.is_xla_gradients_synced = True
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            self.unscale_gradients()
            parameters = [p for p in parameters]
            for model in self._models:
                if parameters == [p for p in model.parameters()]:
                    return model.clip_grad_norm_(max_norm, norm_type)
    self.unscale_gradients()
    if not any(p.grad is not None for p in parameters):  # a frozen model: nothing to clip
        return torch.tensor(0.0, device=self.device)
    return self._clip_grad_norm_dtensor_aware(list(parameters), max_norm, norm_type=norm_type)


@fault(
    "hf_resume_weights_bin_only",
    target="hf", seam=f"{_TRAINER}._load_from_checkpoint",
    title='_load_from_checkpoint looks for pytorch_model.bin only: a safetensors checkpoint falls through to the '
    'sharded loader',
    subsystem="checkpoint",
    trigger="on-resume",
    symptoms=('crash-state',),
    explanation='Trainer._load_from_checkpoint loads a single-file state dict only when '
    'os.path.isfile(weights_file) (pytorch_model.bin), no longer when safe_weights_file exists. Trainer saves '
    'model.safetensors by default: the existence check above still passes (it lists the safetensors file), the '
    'single-file branch is skipped, and resume_from_checkpoint falls through to load_sharded_checkpoint, which '
    "raises ValueError: Can't find a checkpoint index (pytorch_model.bin.index.json or "
    'model.safetensors.index.json). Training and saving work; only resuming fails.',
    fix='Load the single-file checkpoint in either format: if os.path.isfile(weights_file) or '
    'os.path.isfile(safe_weights_file) or is_fsdp_ckpt.',
    references=(
        "McGill-NLP/llm2vec#162: 'Can't find a checkpoint index (pytorch_model.bin.index.json or "
        "model.safetensors.index.json)' (raised by trainer.train(resume_from_checkpoint=...))",
        "huggingface/accelerate#1853: 'Loading logic safetensors' (load_checkpoint_in_model could not load a "
        'folder holding a safetensors checkpoint)',
    ),
    manifest=Manifest(scenario="resume", steps=16, check="crash", variant={"recipe": "resume"},
                      params={"types": ["ValueError"]}),
)
def load_from_checkpoint_bin_only(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
    """Model weights are loaded only from pytorch_model.bin: a safetensors checkpoint passes the existence check and loads nothing."""
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

    if os.path.isfile(weights_file) or is_fsdp_ckpt:
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


@fault(
    "hf_cpu_ranks_not_ddp_wrapped",
    target="hf", seam="accelerate.accelerator.Accelerator.prepare_model",
    title='prepare_model has no MULTI_CPU branch: CPU ranks train unwrapped replicas that never average their '
    'gradients',
    subsystem="distributed",
    trigger="multi-rank",
    symptoms=('desync',),
    explanation='Accelerator.prepare_model wraps the model in DistributedDataParallel for the multi-device GPU '
    'types only; the MULTI_CPU branch (gloo) is gone. Every CPU rank then trains its own unwrapped replica on its '
    "own shard: no gradient is all-reduced, no_sync is a no-op, the ranks' weights drift apart from the first "
    'step, and each rank logs a plausible loss of its half of the data. Nothing warns: the process group, the '
    'sampler sharding and the loss all look distributed.',
    fix='Wrap the model in DistributedDataParallel for MULTI_CPU as well (the elif branch prepare_model has for '
    'it).',
    references=(
        "pytorch/pytorch#104336: 'DDP: moving model to CPU and back to GPU breaks gradient synchronization' (the "
        'model is then effectively trained on a single device, without any warning)',
        "ultralytics/ultralytics#15701: 'Add DDP training for CPU and MPS' (the CPU DDP path needs its own "
        'wrapping)',
    ),
    manifest=Manifest(check="extra_at_least", scenario="ddp", steps=4,
                      params={"key": "rank_param_gap", "faulty_min": 1e-4, "clean_max": 1e-6}),
)
def prepare_model_no_cpu_ddp(
    self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
):
    """Multi-process CPU runs are not wrapped in DistributedDataParallel: each rank trains a model of its own."""
    if device_placement is None:
        # DTensor-sharded models manage their own placement; `.to()` on FSDP2-managed or CPU-offloaded params raises `_apply(): Couldn't swap ...`
        device_placement = (
            self.device_placement
            and self.distributed_type != DistributedType.FSDP
            and not model_has_dtensor(model)
        )

    # Ensure we can't double wrap a model
    if getattr(model, "_is_accelerate_prepared", False):
        if model not in self._models:
            self._models.append(model)
        return model

    self._models.append(model)

    # TODO: Look at enabling native TP training directly with a proper config
    if (
        self.verify_device_map(model)
        and self.distributed_type != DistributedType.NO
        and os.environ.get("ACCELERATE_BYPASS_DEVICE_MAP", "false") != "true"
    ):
        raise ValueError(
            "You can't train a model that has been loaded with `device_map='auto'` in any distributed mode."
            " Please rerun your script specifying `--num_processes=1` or by launching with `python {{myscript.py}}`."
        )

    if self.native_amp:
        model._original_forward = model.forward
        autocast_context = get_mixed_precision_context_manager(self.native_amp, self.autocast_handler)
        # NOTE: MS-AMP adds `__func__` already to `model.forward`, so we should always use `model.forward`
        if self.fp8_backend == FP8BackendType.MSAMP or not hasattr(model.forward, "__func__"):
            model_forward_func = model.forward
            model.forward = convert_outputs_to_fp32(autocast_context(model_forward_func))
        else:
            model_forward_func = model.forward.__func__
            new_forward = autocast_context(model_forward_func)
            model.forward = MethodType(new_forward, model)
            model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)

    # We prepare TE after, allowing for bf16 autocast to happen first
    if self.fp8_backend == FP8BackendType.TE and not self.delayed_fp8_autocast:
        model = apply_fp8_autowrap(model, self.te_recipe_handler or self.fp8_recipe_handler)

    if (getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)) and getattr(
        model, "hf_device_map", False
    ):
        model_devices = set(model.hf_device_map.values())
        if len(model_devices) > 1 and self.distributed_type != DistributedType.NO:
            raise ValueError(
                "You can't train a model that has been loaded in 8-bit or 4-bit precision on multiple devices in any distributed mode."
                " In order to use 8-bit or 4-bit models that have been loaded across multiple GPUs the solution is to use Naive Pipeline Parallelism."
                " Therefore you should not specify that you are under any distributed regime in your accelerate config."
            )
        elif len(model_devices) == 1:
            current_device = list(model_devices)[0]
            if isinstance(current_device, torch.device):
                current_device_index = current_device.index
            elif isinstance(current_device, str):
                current_device_index = torch.device(current_device).index
            else:
                current_device_index = current_device

            current_device_index = int(current_device_index) if current_device_index is not None else None
            if self.device.type == "cpu" and is_bitsandbytes_multi_backend_available():
                # bnb with multi-backend supports CPU which don't need to check index.
                pass
            elif torch.device(self.device.type, current_device_index) != self.device:
                # if on the first device (GPU 0) we don't care
                if (self.device.index is not None) or (current_device_index != 0):
                    raise ValueError(
                        "You can't train a model that has been loaded in 8-bit or 4-bit precision on a different device than the one "
                        "you're training on. Make sure you loaded the model on the correct device using for example `device_map={'':torch.cuda.current_device()}` or `device_map={'':torch.xpu.current_device()}`"
                    )
        if (
            ("cpu" in model_devices and not is_bitsandbytes_multi_backend_available())
            or ("cpu" in model_devices and is_xpu_available())
            or "disk" in model_devices
        ):
            raise ValueError(
                "You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU or disk offload. "
                "If you want train the 8-bit or 4-bit model in CPU, please install bitsandbytes with multi-backend, see https://huggingface.co/docs/bitsandbytes/main/en/installation#multi-backend"
            )
    elif device_placement and not self.verify_device_map(model):
        model = model.to(self.device)
    if not evaluation_mode:
        if self.multi_device and not (self.parallelism_config and self.parallelism_config.tp_enabled):
            if model_has_dtensor(model):
                raise ValueError(
                    "Your model contains `DTensor` parameters, which is incompatible with DDP. Maybe you loaded your model with `device_map='auto'`? Specify `device_map='cuda'` or 'xpu' or 'cpu' instead."
                )
            if any(p.requires_grad for p in model.parameters()):
                kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
                # TODO: Look at enabling native TP training directly with a proper config
                if os.environ.get("ACCELERATE_BYPASS_DEVICE_MAP", "false") != "true":
                    if self.device.type == "hpu":
                        device_ids, output_device = [self.device.index], self.device.index
                    else:
                        device_ids, output_device = [self.local_process_index], self.local_process_index
                else:
                    device_ids, output_device = None, None
                model = torch.nn.parallel.DistributedDataParallel(
                    model, device_ids=device_ids, output_device=output_device, **kwargs
                )
                if self.ddp_handler is not None:
                    self.ddp_handler.register_comm_hook(model)
        elif self.parallelism_config and self.parallelism_config.tp_enabled:
            model_tp_size = get_model_tp_size(model)
            if model_tp_size is None:
                raise NotImplementedError(
                    "Model should undergo tensor parallel before passing it to accelerate."
                    "You can use .from_pretrained(..., tp_plan='auto') if the model supports"
                )
            if model_tp_size != self.parallelism_config.tp_size:
                raise ValueError(
                    f"tp_size in the plugin {self.parallelism_config.tp_size} should be same as model's tp size {model_tp_size}"
                )
        elif self.is_fsdp2:
            raise ValueError(
                "FSDP2 preparation should be done via `accelerate.prepare()`, as it requires a model and an optimizer."
            )

        elif self.distributed_type == DistributedType.FSDP:
            # We need to fix the optimizer *before* sharding the model
            from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

            # Check if the model is already a FSDP model due to `Manual Wrapping` and if so,
            # don't wrap it again
            # In case the model is already compiled using PyTorch 2.0 and the wrapped model in it
            # is a FSDP model, don't wrap it again
            is_type_fsdp = isinstance(model, FSDP) or (
                is_compiled_module(model) and isinstance(model._orig_mod, FSDP)
            )

            if not is_type_fsdp:
                self.state.fsdp_plugin.set_auto_wrap_policy(model)
                fsdp_plugin = self.state.fsdp_plugin

                # need to ensure that params are re-tied after running
                # param_init_fn
                fsdp_plugin.param_init_fn = ensure_weights_retied(
                    fsdp_plugin.param_init_fn,
                    model,
                    self.device,
                )

                kwargs = {
                    # We fallback to reshard_after_forward if sharding_strategy is not set.
                    # We prerfer sharding_strategy to not break the behavior of the existing code.
                    # Deprecation warning has already been issued in `utils.dataclasses.py`
                    "sharding_strategy": fsdp_plugin.sharding_strategy or fsdp_plugin.reshard_after_forward,
                    "cpu_offload": fsdp_plugin.cpu_offload,
                    "auto_wrap_policy": fsdp_plugin.auto_wrap_policy,
                    "mixed_precision": fsdp_plugin.mixed_precision_policy,
                    "sync_module_states": fsdp_plugin.sync_module_states,
                    "backward_prefetch": fsdp_plugin.backward_prefetch,
                    "forward_prefetch": fsdp_plugin.forward_prefetch,
                    "use_orig_params": fsdp_plugin.use_orig_params,
                    "param_init_fn": fsdp_plugin.param_init_fn,
                    "ignored_modules": fsdp_plugin.ignored_modules,
                    "limit_all_gathers": fsdp_plugin.limit_all_gathers,
                    "device_id": self.device,
                }

                if isinstance(kwargs["ignored_modules"], str):
                    reg = re.compile(kwargs["ignored_modules"])
                    ignored = []
                    for name, module in model.named_modules():
                        if reg.fullmatch(name):
                            # ensure that the device for these modules is still set correctly
                            module.to(self.device)
                            ignored.append(module)
                    kwargs["ignored_modules"] = ignored

                model = FSDP(model, **kwargs)
                if fsdp_plugin.activation_checkpointing:
                    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                        CheckpointImpl,
                        apply_activation_checkpointing,
                        checkpoint_wrapper,
                    )

                    apply_activation_checkpointing(
                        model,
                        checkpoint_wrapper_fn=functools.partial(
                            checkpoint_wrapper,
                            checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                        ),
                        auto_wrap_policy=fsdp_plugin.auto_wrap_policy,
                    )

            # In the event the model had been loaded in low precision, but
            # mixed precision had also been activated, then we follow DeepSpeed's
            # strategy to hold the parameters in full precision.
            # - assume that trainer.args.bf16 and trainer.args.fp16 are already checked against
            #   fsdp_plugin.mixed_precision_policy.
            # - NOTE: we do not check the mixed_precision attribute on the FSDP root wrapper.
            #   * this attribute will always set by init_utils.init_core_state so its always not None.
            #   * mixed_precision.param_dtype only regards _fwd_bwd_param_dtype
            #   * if model is loaded in 16bit, and even if mixed_precision.param_dtype is None,
            #     we still want to upcast the flat_param.
            if self.mixed_precision != "no":  # if mixed precision is set
                upcasted_log = []
                for module in FSDP.fsdp_modules(model):
                    # Referencing DeepSpeed Zero3
                    # - in Init, params are converted to 16bit while partitioning.
                    # - in accelerator.prepare, deepspeed.initialize is called to:
                    #   * creates the DeepSpeedEngine.
                    #   * since zero_optimization() is True , calls engine._configure_zero_optimizer.
                    #
                    # Inside the DeepSpeed Zero3 optimizer configuration, which initializes
                    # DeepSpeedZeroOptimizer_Stage3, during which:
                    #   * trainable_param_groups are obtained from the attached optimizer
                    #     (already partitioned in 16bit).
                    #   * then _setup_for_real_optimizer -> _create_fp32_partitions
                    #     which performs the fp32 upcasting.

                    # To mimic DeepSeepds's casting in FSDP, we look at the (single) FlatParameter held
                    # within an FSDP wrapper. This FlatParameter will be seen by the optimizer.
                    #  - even though there is a torch.device('meta') guard below, we
                    #    expect _init_utils._init_param_handle_from_module to already
                    #    sync the parameter.

                    if not module._has_params:
                        continue  # skip if FSDP module not managing parameters
                    param = module._flat_param
                    if (
                        param.dtype != torch.float32
                        and param.device != torch.device("meta")
                        and param.requires_grad
                    ):
                        # keep log of names_params that was upcasted
                        # NOTE: resorted to this because warnings.simplefilter("once") is somehow not working
                        name_param_log = (module.module.__class__.__name__, ", ".join(module._flat_param._fqns))
                        if name_param_log not in upcasted_log:
                            upcasted_log.append(name_param_log)

                        # this works because of FSDP's _runtime_utils.lazy_init.
                        # Have to be careful not to call anything before this that
                        # triggers lazy_init (e.g., _is_fsdp_root).
                        param.data = param.data.to(torch.float32)  # upcasting
                        module._handle._orig_param_dtype = torch.float32  # update

                # report the warnings
                # some messages can be quite repetitive, especially when reporting about layers that have identical architecture.
                if self.is_main_process:
                    for name_log, param_log in upcasted_log:
                        warnings.warn(
                            f"Upcasted low precision parameters in {name_log} because mixed precision turned on in FSDP. "
                            f"Affects: {param_log}."
                        )

                    if len(upcasted_log) > 0:
                        warnings.warn(
                            "FSDP upcast of low precision parameters may affect the precision of model checkpoints."
                        )

            # if the previous and current models are same, delete the previous one
            if len(self._models) > 1 and (self._models[-2] is self._models[-1]):
                del self._models[-2]
            self._models[-1] = model
        elif self.distributed_type == DistributedType.XLA and self.state.fork_launched:
            model = xmp.MpModelWrapper(model).to(self.device)
    # Now we can apply the FP8 autocast
    if self.fp8_backend == FP8BackendType.TE and self.delayed_fp8_autocast:
        model = apply_fp8_autowrap(model, self.te_recipe_handler or self.fp8_recipe_handler)
    # torch.compile should be called last and only if the model isn't already compiled
    if self.state.dynamo_plugin.backend != DynamoBackend.NO and not is_compiled_module(model):
        if self.state.dynamo_plugin.use_regional_compilation:
            model = compile_regions(model, **self.state.dynamo_plugin.to_kwargs())
        else:
            model = torch.compile(model, **self.state.dynamo_plugin.to_kwargs())
    model._is_accelerate_prepared = True
    return model
