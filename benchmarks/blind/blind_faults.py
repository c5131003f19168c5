"""A blind set of faults, modeled on real bug threads, written without reading the detectors.

`faultbench bench --target all --plugin benchmarks/blind/blind_faults.py --only-plugin-faults --out results/blind`
scores the suite on these alone (see README.md next to this file for the rules under which they were written).
Every fault id starts with ``blind_``; the first part of the file breaks the reference stack (``model/``), the
second part transformers' Llama under ``Trainer`` (``target="hf"``).
"""

import contextlib
import math
import os
import random

import numpy as np
import torch
import torch.nn.functional as F

from faultbench.faults.registry import Manifest, fault
from faultbench.model.data import IGNORE_INDEX

# ================================================================================================================
# The reference stack (model/)
# ================================================================================================================


@fault(
    "blind_attn_heads_merged_without_transpose",
    seam="model.attention.CausalSelfAttention.forward",
    title="Attention heads merged with a reshape and no transpose: each token's output mixes other positions",
    subsystem="model",
    also_acceptable=("mask",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="After attention, y is (B, n_head, T, head_dim); forward reshapes it straight to (B, T, C) without "
    "first moving the head axis next to the channels. Row-major memory then hands token t the outputs of "
    "n_head consecutive positions of one head, so early tokens receive the attention outputs of later positions: "
    "information flows backwards in time, training 'works' and the loss even drops, but the model is not causal "
    "any more. Cached decoding (one query at a time) merges correctly, so generation disagrees with the forward "
    "that training optimized.",
    fix="y.transpose(1, 2).reshape(B, T, C) (or .contiguous().view): bring the head axis next to head_dim first.",
    references=(
        "https://github.com/jsbaan/transformer-from-scratch/pull/6 (missing permute before the reshape in "
        "multi-head attention scrambles token representations; the copy task still trained)",
        "https://github.com/ajhalthor/Transformer-Neural-Network/issues/1",
    ),
    manifest=Manifest(check="loss_below", steps=60, params={"min_gap": 0.1, "metric": "val"}),
)
def attention_forward_merge_without_transpose(self, x, rope, attn_mask, cache=None, layer_idx: int = 0):
    """Heads merged by a bare reshape."""
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
    "blind_decode_mask_ignores_cache_offset",
    seam="model.attention.build_attention_mask",
    title="Mask rows placed at query positions 0..T_q-1 even after a KV cache: a decoded token sees only the first key",
    subsystem="mask",
    also_acceptable=("position", "model"),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="build_attention_mask numbers the queries 0..query_len-1 instead of key_len-query_len..key_len-1. "
    "Without a cache the two are the same (training and evaluation are untouched), but in cached decoding the single "
    "new query is treated as position 0: it may attend only to key 0 (and 'itself', which is key 0 again), so "
    "every generated token is computed from the first column of the cache, a BOS or a left pad, and greedy decoding "
    "goes wrong while the full forward of the same tokens is fine.",
    fix="query_pos = arange(key_len - query_len, key_len): offset the queries by the cached length.",
    references=(
        "https://github.com/hyprstream/hyprstream/pull/1521 (causal mask built as tril on [q_len, kv_len], correct "
        "only when kv_len == q_len: with a cache the prompt history is masked out)",
        "https://github.com/huggingface/transformers/issues/23197 (mask and past_key_values lengths in cached "
        "decoding)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=30,
                      params={"key": "cached_logit_gap", "faulty_min": 1e-2, "clean_max": 1e-4}),
)
def build_attention_mask_no_offset(attention_mask, query_len: int, dtype):
    """Queries numbered from 0 whatever the cache holds."""
    batch, key_len = attention_mask.shape
    if query_len == key_len and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        return None
    device = attention_mask.device
    query_pos = torch.arange(query_len, device=device)[:, None]  # (T_q, 1)
    key_pos = torch.arange(key_len, device=device)[None, :]  # (1, T_k)
    allowed = (key_pos <= query_pos) & attention_mask.bool()[:, None, :]
    allowed |= key_pos == query_pos
    mask = torch.zeros(batch, 1, query_len, key_len, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


@fault(
    "blind_truncation_keeps_document_end",
    seam="model.data.truncate",
    title="Over-long documents truncated from the left: they keep their EOS but lose their BOS and beginning",
    subsystem="data",
    trigger="rare-batch",
    symptoms=("silent-quality",),
    explanation="truncate keeps the last max_len tokens (ids[-max_len:], the usual 'keep the most recent context' "
    "idiom) instead of the first max_len - 1 plus EOS. The rare over-long documents (about 1%) now start in the "
    "middle of a sentence with no BOS: their first token is an arbitrary word that collate treats as the "
    "unpredicted start, the model sees documents that do not begin the way every other document does, and their "
    "real beginnings are never trained on. Short documents are untouched, so the loss barely moves.",
    fix="Keep the beginning of the document: ids[: max_len - 1] + [eos] (or truncate on the right in the tokenizer).",
    references=(
        "https://github.com/huggingface/transformers/issues/4476 (overflowing from the left: "
        "tokenizer.encode(input)[-block_size:])",
        "https://github.com/meta-pytorch/torchtune/pull/2419 (truncation sides: which end of the tokens a "
        "truncation keeps, and the special token it must preserve)",
        "https://github.com/facebookresearch/esm/issues/157 (truncation that drops a boundary token)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 1e-3}),
)
def truncate_left(ids, max_len: int, eos_id: int):
    """The end of the document is kept."""
    if len(ids) <= max_len:
        return ids
    return ids[-max_len:]


@fault(
    "blind_collate_packs_documents",
    seam="model.data.collate",
    title="collate packs several documents per row to save padding, with one causal mask over the whole row",
    subsystem="collate",
    also_acceptable=("mask", "data"),
    trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="To waste less padding, collate concatenates consecutive documents into rows no longer than the "
    "batch's longest document. The attention mask is 1 over the whole packed row and positions run on across "
    "documents, so every document after the first attends to the unrelated documents before it (cross-document "
    "contamination), and the BOS of each later document becomes a target predicted from the previous EOS: an "
    "easy token that lowers the reported train and validation losses without the model being any better.",
    fix="Pack with a block-diagonal mask and per-document positions (or do not pack); never score a packed "
    "document's BOS.",
    references=(
        "https://github.com/huggingface/trl/issues/784 (packing does not adjust attention masks: packed samples "
        "attend to each other)",
        "https://github.com/huggingface/transformers/issues/25452 (packing without cross-contamination)",
        "https://github.com/mosaicml/llm-foundry/issues/1464",
    ),
    manifest=Manifest(check="loss_below", steps=30, params={"min_gap": 0.05, "metric": "val"}),
)
def collate_packed(docs, pad_id: int, pad_side: str = "right", ignore_index: int = IGNORE_INDEX) -> dict:
    """Documents packed into shared rows."""
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
    if pad_side == "right":  # training and evaluation batches: pack them, nothing is wasted on pads
        capacity, rows = max(len(d) for d in docs), []
        for ids in docs:
            if rows and len(rows[-1]) + len(ids) <= capacity:
                rows[-1] = rows[-1] + list(ids)
            else:
                rows.append(list(ids))
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
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask), "labels": labels}  # noqa: F821 (model.data's)


@fault(
    "blind_loss_mean_per_sequence",
    seam="model.loss.lm_loss",
    title="Loss averaged per sequence, then over the batch: short documents' tokens weigh more",
    subsystem="loss",
    also_acceptable=("eval",),
    trigger="always",
    symptoms=("silent-quality", "eval-metric"),
    explanation="lm_loss takes each row's mean cross-entropy over its own targets and then the mean over rows "
    "(scaled by the micro-batch's share of the window's targets so accumulation still adds up). A token of a "
    "3-token document now weighs as much as ten tokens of a 30-token one: the objective is no longer the corpus "
    "cross-entropy, the reported train and validation losses are per-document averages that cannot be compared "
    "with the per-token floor, and the gradient over-fits the starts of documents.",
    fix="Sum the token losses over the whole batch and divide by the number of targets (a token mean).",
    references=(
        "https://github.com/huggingface/transformers/issues/34510 (per-sample vs flattened token mean: the two "
        "weight short samples differently)",
        "https://github.com/imoneoi/openchat/issues/182 (per-sequence loss made the model worse at longer "
        "responses)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, params={"min_gap": 0.05}),
)
def lm_loss_per_sequence(logits, labels, num_targets=None, ignore_index: int = IGNORE_INDEX):
    """Mean over rows of each row's token mean."""
    shifted_logits = logits[:, :-1].float()
    shifted_labels = labels[:, 1:]
    per_token = F.cross_entropy(shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
                                ignore_index=ignore_index, reduction="none").view(shifted_labels.shape)
    counts = (shifted_labels != ignore_index).sum(1)
    per_row = per_token.sum(1) / counts.clamp(min=1)
    local = count_targets(labels, ignore_index)  # noqa: F821 (model.loss's)
    if num_targets is None:
        num_targets = local
    return per_row.mean() * (local / max(num_targets, 1))


@fault(
    "blind_grad_norm_reported_after_clip",
    seam="model.train.clip_gradients",
    title="The logged gradient norm is measured after clipping: it never exceeds max_norm",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="clip_gradients clips the gradients, then recomputes their norm for the log. Training is exactly "
    "the clean run, but the norm the step record reports is the clipped one (min(norm, max_norm)): a run whose "
    "clipping fires on every step looks perfectly tame, spikes and divergence are invisible in the grad-norm "
    "curve, and anything that decides from the reported norm is misled.",
    fix="Report the value clip_grad_norm_ returns (the total norm before clipping).",
    references=(
        "https://github.com/radixark/miles/pull/2132 (grad_norm documented as 'after clipping': whoever trusts it "
        "never notices that clipping fires every step)",
        "https://github.com/verl-project/verl/issues/2282 (grad_norm above the clip value is expected: it is the "
        "pre-clip norm)",
        "https://github.com/pytorch/pytorch/issues/1032 (clip_grad_norm should return the total norm, to log it)",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, params={"min_ratio": 0.0, "max_ratio": 0.6}),
)
def clip_gradients_post_norm(model, optimizer, scaler, max_norm: float) -> float:
    """Norm measured after the clip."""
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    grads = [p.grad.detach().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0


@fault(
    "blind_checkpoint_weights_saved_in_bf16",
    seam="model.checkpoint.save_checkpoint",
    title="Checkpoints store the weights in bf16 to halve their size: every resume continues from rounded weights",
    subsystem="checkpoint",
    also_acceptable=("precision",),
    trigger="on-resume",
    symptoms=("silent-quality",),
    explanation="save_checkpoint writes model.state_dict() cast to bfloat16 (a 'half-size checkpoint'), while the "
    "optimizer state, schedule, sampler and RNG are saved exactly. load_state_dict copies the bf16 values back "
    "into the fp32 parameters without complaint, so the resumed run starts from weights rounded to 8 mantissa "
    "bits (a relative error up to 0.4%) that no longer match the AdamW moments saved with them: the resumed run "
    "silently departs from the uninterrupted one, and each further save/resume cycle rounds again.",
    fix="Save the fp32 master weights (a reduced-precision copy is for inference exports, never for resuming).",
    references=(
        "https://github.com/NVIDIA/apex/pull/42 (resuming must restore the fp32 master params, not the fp16 model "
        "weights: 'save and restore the fp32 master params directly')",
        "https://github.com/facebookresearch/fairseq/pull/424 (fix resuming from FP16 checkpoints)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="resume", steps=12,
                      params={"key": "resume_loss_diff", "faulty_min": 1e-4, "clean_max": 0.0}),
)
def save_checkpoint_bf16_weights(run, directory):
    """The model's weights are written in bfloat16."""
    directory = Path(directory)  # noqa: F821
    if hasattr(run.optimizer, "consolidate_state_dict"):
        run.optimizer.consolidate_state_dict(to=0)
    rng_states = _gather_rng_states(run)  # noqa: F821
    if run.rank == 0:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")  # noqa: F821
        shutil.rmtree(tmp, ignore_errors=True)  # noqa: F821
        tmp.mkdir()
        state = {
            "model": {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                      for k, v in run.model.state_dict().items()},  # half the bytes on disk
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
            "format": FORMAT,  # noqa: F821
            "step": run.step,
            "world_size": run.world_size,
            "sha256": _sha256(tmp / "state.pt"),  # noqa: F821
            "config": run.config.to_dict(),
            "tokenizer_sha256": run.tokenizer.sha256,
            "torch_version": torch.__version__,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))  # noqa: F821
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}")  # noqa: F821
        if directory.exists():
            directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)  # noqa: F821
    if run.world_size > 1:
        dist.barrier()  # noqa: F821
    return directory


@fault(
    "blind_target_count_reduced_on_a_copy",
    seam="model.distributed.global_target_count",
    title="The step's target count is all-reduced on a temporary copy: each rank normalizes by its own count",
    subsystem="distributed",
    also_acceptable=("loss",),
    trigger="multi-rank",
    symptoms=("silent-quality",),
    explanation="global_target_count all-reduces a clone of the count tensor and returns the original, so under DDP "
    "it returns the local count. Each rank then divides its summed loss by local_count / world_size: the loss "
    "every rank reports is world_size times the token mean, DDP averages gradients that are world_size times too "
    "large and weighted per rank instead of per token, and the logged loss and gradient norm double on 2 ranks "
    "while a single-process run is untouched.",
    fix="All-reduce the tensor you read back (dist.all_reduce(total); return int(total)).",
    references=(
        "https://github.com/ORNL/HydraGNN/pull/116 (the number of samples used to normalize the loss was wrong "
        "under DDP: losses differ between 1 and several ranks)",
        "https://github.com/huggingface/transformers/issues/608 (per-device means across GPUs bias the loss)",
    ),
    manifest=Manifest(check="loss_above", scenario="ddp", steps=8, params={"min_gap": 1.0}),
)
def global_target_count_on_copy(local_count: int, device: str = "cpu") -> int:
    """The all-reduce result is discarded."""
    if not is_distributed():  # noqa: F821 (model.distributed's)
        return local_count
    total = torch.tensor([local_count], dtype=torch.long, device=device)
    dist.all_reduce(total.clone())  # noqa: F821
    return int(total)


@fault(
    "blind_eval_mean_of_batch_means",
    seam="model.evaluate.evaluate",
    title="Validation loss is the mean of per-batch means: it depends on the eval batch size",
    subsystem="eval",
    trigger="eval-only",
    symptoms=("eval-metric",),
    explanation="evaluate averages each batch's token-mean loss with equal weight, so a short last batch (or a "
    "batch of short documents) counts as much as a full one. The reported validation loss moves with "
    "eval_batch_size and the order of the split and is no longer the corpus cross-entropy per token that the "
    "loss floor refers to; training is untouched.",
    fix="Accumulate the summed loss and the target count over all batches and divide once.",
    references=(
        "https://github.com/huggingface/transformers/issues/39241 ([Trainer] eval loss depends on batch size)",
        "https://github.com/huggingface/transformers/issues/24839 (eval_loss of the same data differs with the "
        "batch size: it should not be a macro-average)",
        "https://github.com/NVIDIA/Megatron-LM/pull/7207 (fix the mean-of-means evaluation loss reduction)",
    ),
    manifest=Manifest(check="metric_differs", steps=30, variant={"train": {"eval_batch_size": 7}},
                      params={"min_gap": 0.003}),
)
def evaluate_mean_of_means(model, docs, pad_id: int, batch_size: int, precision: str = "fp32",
                           pad_side: str = "right") -> float:
    """Each batch's mean weighs the same."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, batches = 0.0, 0
    try:
        for i in range(0, len(docs), batch_size):
            batch = {k: v.to(device) for k, v in collate(docs[i : i + batch_size], pad_id, pad_side).items()}  # noqa: F821
            with autocast_context(precision, device.type):  # noqa: F821
                logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            n = count_targets(batch["labels"])  # noqa: F821
            total += lm_loss(logits, batch["labels"], n).item()  # noqa: F821
            batches += 1
    finally:
        model.train(was_training)
    return total / batches


@fault(
    "blind_grad_scaler_grows_every_step",
    seam="model.precision.make_grad_scaler",
    title="GradScaler built with growth_interval=1: the loss scale doubles every step until it overflows, then again",
    subsystem="precision",
    also_acceptable=("optimizer",),
    trigger="amp-only",
    symptoms=("silent-quality",),
    explanation="make_grad_scaler passes growth_interval=1 ('so the scale recovers at once after an overflow') "
    "instead of the default 2000. The scale doubles after every successful step, so it climbs to the first value "
    "at which the scaled fp16 gradients overflow, that step is skipped and the scale halved, the next step doubles "
    "it into the overflow again: a large share of the optimizer steps is silently skipped (the weights do not "
    "move, the schedule still advances) and the run trains on a fraction of its data with a jittering scale.",
    fix="Keep a long growth interval (the default 2000 steps): grow the scale only after a long run of finite steps.",
    references=(
        "https://github.com/pytorch/pytorch/pull/98876 (GradScaler(growth_interval=1): the scale keeps growing "
        "until it overflows; fixes pytorch/pytorch#98828)",
        "https://github.com/deepspeedai/DeepSpeed/issues/931 (dynamic loss scaling: repeated OVERFLOW, skipping "
        "steps)",
    ),
    manifest=Manifest(check="skipped_steps", steps=10, variant={"train": {"precision": "fp16"}},
                      params={"faulty_min": 2, "clean_max": 0}),
)
def make_grad_scaler_growth_every_step(precision: str, device_type: str, init_scale: float = 2.0**16):
    """The scale grows after every finite step."""
    return torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=1,
                                enabled=precision == "fp16")


# ================================================================================================================
# The HF target: transformers' Llama trained by Trainer (targets/hf/); each fault is the buggy body of the
# transformers / accelerate function it names, injected where it lives
# ================================================================================================================

_LLAMA = "transformers.models.llama.modeling_llama"


@fault(
    "blind_hf_final_norm_skipped",
    target="hf", seam=f"{_LLAMA}.LlamaModel.forward",
    title="LlamaModel.forward returns the last decoder layer's output without the final RMSNorm",
    subsystem="model",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="The final `hidden_states = self.norm(hidden_states)` is gone (as in a pipeline-parallel stage "
    "that forgot to apply the norm on the last stage), so the LM head reads the un-normalized residual stream. The "
    "model still trains, since the head and the blocks adapt to the unnormalized scale, but it is another "
    "architecture than the checkpoint's config describes: model.norm.weight receives no gradient and never moves, "
    "logits scale with the residual stream's norm, and a checkpoint trained this way is wrong for every correct "
    "Llama implementation that loads it.",
    fix="Apply self.norm to the last hidden state before returning it.",
    references=(
        "https://github.com/PaddlePaddle/PaddleNLP/pull/7615 ([Llama2] fix llama final norm in pp modeling)",
        "https://github.com/vllm-project/speculators/pull/313 (hidden states taken before the final norm fed to "
        "lm_head: targets computed from un-normed states)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="train", steps=16,
                      params={"key": "frozen_param_fraction", "faulty_min": 0.03, "clean_max": 0.0}),
)
def llama_model_forward_no_final_norm(self, input_ids=None, attention_mask=None, position_ids=None,
                                      past_key_values=None, inputs_embeds=None, use_cache=None, **kwargs):
    """The final norm is never applied."""
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)

    if use_cache and past_key_values is None:
        past_key_values = DynamicCache(config=self.config)  # noqa: F821 (modeling_llama's)

    if position_ids is None:
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
        position_ids = position_ids.unsqueeze(0)

    causal_mask = create_causal_mask(  # noqa: F821
        config=self.config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        past_key_values=past_key_values,
        position_ids=position_ids,
    )

    hidden_states = inputs_embeds
    position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

    for decoder_layer in self.layers[: self.config.num_hidden_layers]:
        hidden_states = decoder_layer(
            hidden_states,
            attention_mask=causal_mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **kwargs,
        )

    return BaseModelOutputWithPast(  # noqa: F821
        last_hidden_state=hidden_states,
        past_key_values=past_key_values,
    )


@fault(
    "blind_hf_clip_consumes_parameter_generator",
    target="hf", seam="accelerate.accelerator.Accelerator.clip_grad_norm_",
    title="clip_grad_norm_ checks the gradients on the parameters generator, then clips the exhausted generator",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="Accelerator.clip_grad_norm_ first scans the parameters for ones without a gradient (to warn about "
    "frozen weights), iterating the generator Trainer passes (model.parameters()). The scan exhausts it, so the "
    "list handed to the clipping is empty: nothing is ever clipped, and the returned total norm, which Trainer logs "
    "as grad_norm, is 0.0 on every step. max_grad_norm silently does nothing and the logged gradient norm is "
    "meaningless.",
    fix="Materialize the parameters once (parameters = list(parameters)) before iterating them more than once.",
    references=(
        "https://github.com/pytorch/pytorch/issues/148259 (clip_grad_norm_ receiving an exhausted generator: "
        "no clipping occurs, silently)",
        "https://github.com/PixArt-alpha/PixArt-alpha/pull/160 (params_to_clip built with filter(): "
        "accelerator.clip_grad_norm_ always got an empty list)",
        "https://github.com/pytorch/torchtitan/pull/1258 (clip_grad_norm_ silently fails on a generator)",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, params={"min_ratio": 0.0, "max_ratio": 0.01}),
)
def clip_grad_norm_exhausted_generator(self, parameters, max_norm, norm_type=2):
    """The parameters generator is consumed by a check before the clip."""
    if self.distributed_type == DistributedType.FSDP:  # noqa: F821 (accelerate.accelerator's)
        self.unscale_gradients()
        parameters = [p for p in parameters]
        for model in self._models:
            if parameters == [p for p in model.parameters()]:
                if not self.is_fsdp2:
                    return model.clip_grad_norm_(max_norm, norm_type)
                else:
                    return self._clip_grad_norm_dtensor_aware(parameters, max_norm, norm_type=norm_type)
    elif self.distributed_type == DistributedType.DEEPSPEED:  # noqa: F821
        if self.deepspeed_engine_wrapped is not None:
            return self.deepspeed_engine_wrapped.get_global_grad_norm()
        return None
    elif self.distributed_type == DistributedType.XLA:  # noqa: F821
        for acc_opt in self._optimizers:
            if not acc_opt.gradient_state.is_xla_gradients_synced:
                opt = acc_opt
                while isinstance(opt, AcceleratedOptimizer):  # noqa: F821
                    opt = opt.optimizer
                gradients = xm._fetch_gradients(opt)  # noqa: F821
                xm.all_reduce("sum", gradients, scale=1.0 / self.num_processes)  # noqa: F821
                acc_opt.gradient_state.is_xla_gradients_synced = True
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            self.unscale_gradients()
            parameters = [p for p in parameters]
            for model in self._models:
                if parameters == [p for p in model.parameters()]:
                    return model.clip_grad_norm_(max_norm, norm_type)
    self.unscale_gradients()
    if any(p.grad is None for p in parameters):
        logger.warning("Some parameters have no gradient: they are left out of the clipping.")  # noqa: F821
    return self._clip_grad_norm_dtensor_aware(list(parameters), max_norm, norm_type=norm_type)


@fault(
    "blind_hf_resume_loads_weights_into_base_model",
    target="hf", seam="transformers.trainer.Trainer._load_from_checkpoint",
    title="Resume loads the checkpoint's weights into model.base_model with strict=False: no key matches, none load",
    subsystem="checkpoint",
    trigger="on-resume",
    symptoms=("silent-quality",),
    explanation="_load_from_checkpoint loads the saved state dict into model.base_model (meant for wrapped/adapter "
    "models) instead of the model itself. The checkpoint's keys are 'model.layers...' and 'lm_head...', the base "
    "model's are 'layers...': with strict=False every key is missing or unexpected, nothing is copied, and the "
    "warning is lost in the logs. Optimizer moments, schedule, RNG and data position are restored, so the resumed "
    "run continues from the freshly initialized weights with the trained run's AdamW state: the loss jumps back "
    "to its initial value at the resume.",
    fix="Load into the model itself, and treat missing/unexpected keys on resume as an error (strict loading).",
    references=(
        "https://github.com/pytorch/examples/issues/1029 (load_state_dict(strict=False) can silently load a "
        "corrupted model: a key prefix mismatch loads nothing, without error)",
        "https://github.com/stanford-futuredata/ColBERT/issues/43 (training resumption reverts to bert-base "
        "rather than the provided checkpoint)",
        "https://github.com/subhc/unsup-parts/pull/12 (checkpoint weight loading fails silently)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="resume", steps=16,
                      params={"key": "resume_loss_gap", "faulty_min": 0.3, "clean_max": 0.0}),
)
def load_from_checkpoint_into_base_model(self, resume_from_checkpoint, model=None):
    """The weights are loaded into the base model, whose keys do not match."""
    if model is None:
        model = self.model

    config_file = os.path.join(resume_from_checkpoint, CONFIG_NAME)  # noqa: F821 (transformers.trainer's)
    adapter_weights_file = os.path.join(resume_from_checkpoint, ADAPTER_WEIGHTS_NAME)  # noqa: F821
    adapter_safe_weights_file = os.path.join(resume_from_checkpoint, ADAPTER_SAFE_WEIGHTS_NAME)  # noqa: F821
    weights_file = os.path.join(resume_from_checkpoint, WEIGHTS_NAME)  # noqa: F821
    weights_index_file = os.path.join(resume_from_checkpoint, WEIGHTS_INDEX_NAME)  # noqa: F821
    safe_weights_file = os.path.join(resume_from_checkpoint, SAFE_WEIGHTS_NAME)  # noqa: F821
    safe_weights_index_file = os.path.join(resume_from_checkpoint, SAFE_WEIGHTS_INDEX_NAME)  # noqa: F821
    is_fsdp_ckpt = os.path.isdir(resume_from_checkpoint) and (
        any(
            FSDP_MODEL_NAME in folder_name  # noqa: F821
            for folder_name in os.listdir(resume_from_checkpoint)
            if os.path.isdir(os.path.join(resume_from_checkpoint, folder_name))
        )
        or os.path.isfile(os.path.join(resume_from_checkpoint, f"{FSDP_MODEL_NAME}.bin"))  # noqa: F821
    )
    adapter_subdirs = (
        [
            folder_name
            for folder_name in os.listdir(resume_from_checkpoint)
            if os.path.isdir(os.path.join(resume_from_checkpoint, folder_name))
            and (
                os.path.isfile(os.path.join(resume_from_checkpoint, folder_name, ADAPTER_WEIGHTS_NAME))  # noqa: F821
                or os.path.isfile(os.path.join(resume_from_checkpoint, folder_name, ADAPTER_SAFE_WEIGHTS_NAME))  # noqa: F821
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

    logger.info(f"Loading model from {resume_from_checkpoint}.")  # noqa: F821

    if os.path.isfile(config_file):
        config = PreTrainedConfig.from_json_file(config_file)  # noqa: F821
        checkpoint_version = config.transformers_version
        if checkpoint_version is not None and checkpoint_version != __version__:  # noqa: F821
            logger.warning(  # noqa: F821
                f"You are resuming training from a checkpoint trained with {checkpoint_version} of "
                f"Transformers but your current version is {__version__}. This is not recommended and could "  # noqa: F821
                "yield to errors or unwanted behaviors."
            )

    if os.path.isfile(weights_file) or os.path.isfile(safe_weights_file) or is_fsdp_ckpt:
        if is_sagemaker_mp_enabled():  # noqa: F821
            smp.resume_from_checkpoint(  # noqa: F821
                path=resume_from_checkpoint, tag=WEIGHTS_NAME, partial=False, load_optimizer=False  # noqa: F821
            )
        elif self.is_fsdp_enabled:
            load_fsdp_model(  # noqa: F821
                self.accelerator.state.fsdp_plugin,
                self.accelerator,
                model,
                resume_from_checkpoint,
                **get_fsdp_ckpt_kwargs(),  # noqa: F821
            )
        else:
            if os.path.isfile(safe_weights_file):
                state_dict = safetensors.torch.load_file(safe_weights_file, device="cpu")  # noqa: F821
            else:
                check_torch_load_is_safe()  # noqa: F821
                state_dict = torch.load(weights_file, map_location="cpu", weights_only=True)

            # wrapped models (adapters, heads on a backbone) keep their weights in the base model
            target = getattr(model, "base_model", model)
            load_result = target.load_state_dict(state_dict, False)
            del state_dict
            self._issue_warnings_after_load(load_result)

    elif _is_peft_model(model):  # noqa: F821
        if hasattr(model, "active_adapters") and hasattr(model, "load_adapter"):
            if os.path.exists(resume_from_checkpoint):
                active_adapters = model.active_adapters
                if len(active_adapters) > 1:
                    logger.warning("Multiple active adapters detected will only consider the first adapter")  # noqa: F821
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
                logger.warning(  # noqa: F821
                    "The intermediate checkpoints of PEFT may not be saved correctly, "
                    f"consider using a custom callback to save {ADAPTER_WEIGHTS_NAME} in corresponding saving folders. "  # noqa: F821
                    "Check some examples here: https://github.com/huggingface/peft/issues/96"
                )
        else:
            logger.warning(f"Could not load adapter model, make sure to have PEFT >= {MIN_PEFT_VERSION} installed")  # noqa: F821
    else:
        load_result = load_sharded_checkpoint(model, resume_from_checkpoint, strict=is_sagemaker_mp_enabled())  # noqa: F821
        if not is_sagemaker_mp_enabled():  # noqa: F821
            self._issue_warnings_after_load(load_result)


@fault(
    "blind_hf_set_seed_per_process",
    target="hf", seam="transformers.trainer_utils.set_seed",
    title="set_seed offsets the seed by the process rank: each rank's sampler shuffles with its own permutation",
    subsystem="distributed",
    also_acceptable=("data",),
    trigger="multi-rank",
    symptoms=("silent-quality",),
    explanation="set_seed adds the process rank to the seed ('so that every rank draws different dropout masks'). "
    "Trainer's seeded sampler takes its seed from torch's initial seed, so every rank now shuffles the dataset with "
    "a different permutation and then takes its own slice of it: the ranks' shards are no longer disjoint slices of "
    "one permutation, some documents are trained on by both ranks in an epoch and others never, and the run differs "
    "from the same job on one process. Nothing crashes and the replicas stay in sync.",
    fix="Seed the data order identically on every rank (the same seed, or a sampler seed independent of the rank); "
    "derive per-rank seeds only for per-rank randomness such as dropout, after the sampler is built.",
    references=(
        "https://github.com/karpathy/llm.c/issues/792 (each process uses a different data-shuffling seed, 42 + "
        "process_rank: different permutations per process and overlapping data)",
        "https://github.com/meta-pytorch/data/issues/302 (if the shuffler's seed is not the same across processes, "
        "duplicate samples within an epoch become significant)",
    ),
    manifest=Manifest(check="metric_differs", scenario="ddp", steps=16, params={"min_gap": 0.01}),
)
def set_seed_per_process(seed, deterministic=False):
    """The seed differs on every rank."""
    seed = seed + int(os.environ.get("RANK", "0"))  # different dropout masks on every rank
    random.seed(seed)
    np.random.seed(seed)
    if is_torch_available():  # noqa: F821 (trainer_utils')
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
        if deterministic:
            torch.use_deterministic_algorithms(True)
    if is_torch_mlu_available():  # noqa: F821
        torch.mlu.manual_seed_all(seed)
    if is_torch_musa_available():  # noqa: F821
        torch.musa.manual_seed_all(seed)
    if is_torch_npu_available():  # noqa: F821
        torch.npu.manual_seed_all(seed)
    if is_torch_hpu_available():  # noqa: F821
        torch.hpu.manual_seed_all(seed)
    if is_torch_xpu_available():  # noqa: F821
        torch.xpu.manual_seed_all(seed)


@fault(
    "blind_hf_generated_tokens_masked",
    target="hf", seam="transformers.generation.utils.GenerationMixin._update_model_kwargs_for_generation",
    title="generate extends the attention mask with zeros: every generated token is masked out as padding",
    subsystem="mask",
    also_acceptable=("position", "model"),
    trigger="eval-only",
    symptoms=("silent-quality",),
    explanation="_update_model_kwargs_for_generation appends new_zeros instead of new_ones to the 2-D attention "
    "mask for each generated token. The KV cache holds the generated tokens' keys, but the mask marks them as pads, "
    "so from the second new token on each decoding step attends to the prompt only (and to nothing it generated): "
    "decoding degenerates while training, evaluation and a full forward of the same text are untouched.",
    fix="Extend the mask with ones for the tokens just generated.",
    references=(
        "https://github.com/huggingface/transformers/issues/23197 (the attention mask in cached decoding must cover "
        "new + cached tokens: concatenate a 1 for each generated token)",
        "https://github.com/huggingface/transformers/issues/34835 (attention_mask and past_key_values together)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="generate", steps=16,
                      params={"key": "cached_logit_gap", "faulty_min": 1e-2, "clean_max": 1e-4}),
)
def update_model_kwargs_mask_zeros(self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1):
    """New tokens are appended to the mask as zeros."""
    for possible_cache_name in ALL_CACHE_NAMES:  # noqa: F821 (generation.utils')
        if possible_cache_name in outputs:
            if possible_cache_name in ("past_buckets_states", "mems"):
                cache_name = "past_key_values"
            else:
                cache_name = possible_cache_name
            model_kwargs[cache_name] = getattr(outputs, possible_cache_name)
            break

    if (token_type_ids := model_kwargs.get("token_type_ids")) is not None:
        model_kwargs["token_type_ids"] = torch.cat([token_type_ids, token_type_ids[:, -num_new_tokens:]], dim=-1)

    if (mm_token_type_ids := model_kwargs.get("mm_token_type_ids")) is not None:
        model_kwargs["mm_token_type_ids"] = torch.cat(
            [mm_token_type_ids, mm_token_type_ids.new_zeros((mm_token_type_ids.shape[0], num_new_tokens))], dim=-1
        )

    position_ids_key = "position_ids" if not is_encoder_decoder else "decoder_position_ids"
    if (position_ids := model_kwargs.get(position_ids_key)) is not None:
        required_dim = [1] * (position_ids.dim() - 1) + [-1]
        next_position_ids = (
            torch.arange(num_new_tokens, dtype=position_ids.dtype, device=position_ids.device).view(*required_dim)
            + position_ids[..., -1:]
            + 1
        )
        next_position_ids = torch.cat([position_ids, next_position_ids], dim=-1)
        model_kwargs[position_ids_key] = next_position_ids

    attention_mask_key = "attention_mask" if not is_encoder_decoder else "decoder_attention_mask"
    if (attention_mask := model_kwargs.get(attention_mask_key)) is not None:
        model_kwargs[attention_mask_key] = torch.cat(
            [attention_mask, attention_mask.new_zeros((attention_mask.shape[0], num_new_tokens))], dim=-1
        )

    return model_kwargs


@fault(
    "blind_hf_accumulation_window_repeats_one_batch",
    target="hf", seam="transformers.trainer.Trainer.get_batch_samples",
    title="get_batch_samples fetches one batch and repeats it for the whole accumulation window",
    subsystem="data",
    also_acceptable=("loss",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="get_batch_samples takes a single batch from the epoch iterator and returns it num_batches times "
    "(a prefetch written as a list of one fetched batch). Under gradient accumulation every optimizer step "
    "averages the gradient of the same micro-batch k times: the effective batch shrinks by k, the gradient is as "
    "noisy as one micro-batch's, an epoch lasts k times as many steps, and the logged loss and token counts look "
    "normal because num_items_in_batch is counted over the repeated batches too.",
    fix="Draw num_batches distinct batches from the iterator (next() once per micro-batch).",
    references=(
        "https://github.com/leohsuofnthu/Pytorch-IterativeFCN/issues/7 (next(iter(train_loader)) every iteration: "
        "the model is trained on the same batch over and over)",
        "https://github.com/awslabs/gluonts/pull/2628 (iterating the loader again yields the same batches)",
    ),
    manifest=Manifest(check="extra_at_least", scenario="train", steps=8, variant={"recipe": "accum"},
                      params={"key": "repeated_batches", "faulty_min": 0.5, "clean_max": 0.0}),
)
def get_batch_samples_repeated(self, epoch_iterator, num_batches, device):
    """One batch, num_batches times."""
    try:
        batch = next(epoch_iterator)
    except StopIteration:
        return [], None
    batch_samples = [batch for _ in range(num_batches)]

    num_items_in_batch = self._get_num_items_in_batch(batch_samples, device)
    return batch_samples, num_items_in_batch


@fault(
    "blind_hf_bf16_autocast_off_single_process",
    target="hf", seam="accelerate.utils.modeling.get_mixed_precision_context_manager",
    title="bf16 autocast is only entered for the distributed types listed: a single-process run trains in fp32",
    subsystem="precision",
    trigger="amp-only",
    symptoms=("silent-quality",),
    explanation="get_mixed_precision_context_manager returns torch.autocast(bfloat16) only for the multi-device "
    "distributed types and falls back to a disabled autocast otherwise, so a plain single-process run with bf16=True "
    "(DistributedType.NO) runs its forward in fp32. Nothing fails and the loss looks good; the run simply is not "
    "the bf16 run it is declared to be (its numerics, memory and speed are fp32's), and what it validates does not "
    "carry over to bf16 training.",
    fix="Enter bf16 autocast for every distributed type, DistributedType.NO included.",
    references=(
        "https://github.com/hao-ai-lab/FastVideo/issues/166 (the mixed_precision parameter doesn't seem to have "
        "any effect)",
        "https://github.com/voicepaw/so-vits-svc-fork/pull/283 (fix fp16_run not being mixed precision)",
        "https://github.com/pytorch/pytorch/issues/100565 (autocast silently disabled for an unsupported dtype)",
    ),
    manifest=Manifest(check="metric_differs", scenario="train", steps=16, variant={"precision": "bf16"},
                      params={"min_gap": 1e-5}),
)
def mixed_precision_context_multi_only(native_amp=False, autocast_kwargs=None):
    """bf16 autocast only for the multi-device types."""
    state = AcceleratorState()  # noqa: F821 (accelerate.utils.modeling's)
    if autocast_kwargs is None:
        autocast_kwargs = {}
    else:
        autocast_kwargs = autocast_kwargs.to_kwargs()
    if native_amp:
        device_type = (
            "cuda"
            if (state.distributed_type == DistributedType.XLA and is_torch_xla_available(check_is_gpu=True))  # noqa: F821
            else state.device.type
        )
        if state.mixed_precision == "fp16":
            return torch.autocast(device_type=device_type, dtype=torch.float16, **autocast_kwargs)
        elif state.mixed_precision in ["bf16", "fp8"] and state.distributed_type in [
            DistributedType.MULTI_CPU,  # noqa: F821
            DistributedType.MULTI_GPU,  # noqa: F821
            DistributedType.MULTI_MLU,  # noqa: F821
            DistributedType.MULTI_SDAA,  # noqa: F821
            DistributedType.MULTI_MUSA,  # noqa: F821
            DistributedType.MULTI_NPU,  # noqa: F821
            DistributedType.MULTI_XPU,  # noqa: F821
            DistributedType.MULTI_HPU,  # noqa: F821
            DistributedType.MULTI_NEURON,  # noqa: F821
            DistributedType.FSDP,  # noqa: F821
            DistributedType.XLA,  # noqa: F821
        ]:
            return torch.autocast(device_type=device_type, dtype=torch.bfloat16, **autocast_kwargs)
        else:  # a combination this path does not list: run it in full precision
            return torch.autocast(device_type=device_type, enabled=False, **autocast_kwargs)
    else:
        return contextlib.nullcontext()
