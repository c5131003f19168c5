"""The seams of the HF target: real functions and methods of transformers, accelerate and this
target's own thin glue, each with the one subsystem it belongs to.

A seam's qualified name is ``module.function`` or ``module.Class.method`` of where the code lives
(``transformers.trainer.Trainer.compute_loss``), so a diagnosis names the file a user would open.
Some seams run only on one path: ``modeling_llama.repeat_kv`` and ``eager_attention_forward`` under
``attn_implementation="eager"``, the sdpa twins under ``"sdpa"`` (the default), the RNG/checkpoint
seams only in the resume recipe, the generation seams only in ``generate``.
"""

from __future__ import annotations

import importlib
import inspect
import os

from faultbench.model.seams import Seam, live_module
from faultbench.model.seams import resolve as resolve_name  # the lookup is the same; only the vocabulary differs

_LLAMA = "transformers.models.llama.modeling_llama"
_TRAINER = "transformers.trainer.Trainer"
_ACCEL = "accelerate.accelerator.Accelerator"
_MASKS = "transformers.masking_utils"

SEAMS: dict[str, str] = {
    # data: corpus, tokenizer, sampler, truncation
    "targets.hf.data.wrap_tokenizer": "data",
    "targets.hf.data.TextDataset.__getitem__": "data",
    "transformers.tokenization_utils_base.PreTrainedTokenizerBase.__call__": "data",
    f"{_TRAINER}._get_train_sampler": "data",
    f"{_TRAINER}.get_train_dataloader": "data",
    f"{_TRAINER}.get_batch_samples": "data",
    # collate: padding, attention_mask, labels
    "transformers.data.data_collator.DataCollatorForLanguageModeling.torch_call": "collate",
    "transformers.data.data_collator.pad_without_fast_tokenizer_warning": "collate",
    "transformers.tokenization_utils_base.PreTrainedTokenizerBase.pad": "collate",
    "transformers.tokenization_utils_base.PreTrainedTokenizerBase._pad": "collate",
    # mask: causal, padding and additive masks
    f"{_MASKS}.causal_mask_function": "mask",
    f"{_MASKS}.padding_mask_function": "mask",
    f"{_MASKS}.and_masks": "mask",
    f"{_MASKS}.prepare_padding_mask": "mask",
    f"{_MASKS}._ignore_causal_mask_sdpa": "mask",
    f"{_MASKS}.sdpa_mask": "mask",
    f"{_MASKS}.eager_mask": "mask",
    f"{_MASKS}.create_causal_mask": "mask",
    # position: position ids, RoPE, cache offsets
    f"{_LLAMA}.rotate_half": "position",
    f"{_LLAMA}.apply_rotary_pos_emb": "position",
    f"{_LLAMA}.LlamaRotaryEmbedding.compute_default_rope_parameters": "position",
    f"{_LLAMA}.LlamaRotaryEmbedding.forward": "position",
    "transformers.generation.utils.GenerationMixin._prepare_position_ids_for_generation": "position",
    "transformers.generation.utils.GenerationMixin._update_model_kwargs_for_generation": "position",
    # model: forward, init, attention math, KV cache
    f"{_LLAMA}.LlamaRMSNorm.forward": "model",
    f"{_LLAMA}.LlamaMLP.forward": "model",
    f"{_LLAMA}.repeat_kv": "model",
    f"{_LLAMA}.eager_attention_forward": "model",
    "transformers.integrations.sdpa_attention.repeat_kv": "model",
    "transformers.integrations.sdpa_attention.sdpa_attention_forward": "model",
    f"{_LLAMA}.LlamaAttention.forward": "model",
    f"{_LLAMA}.LlamaDecoderLayer.forward": "model",
    f"{_LLAMA}.LlamaModel.forward": "model",
    f"{_LLAMA}.LlamaForCausalLM.forward": "model",
    "transformers.modeling_utils.PreTrainedModel._init_weights": "model",
    "transformers.cache_utils.DynamicLayer.update": "model",
    "targets.hf.modeling.build_model": "model",
    # loss: shift, ignore_index, reduction, accumulation normalization
    "transformers.loss.loss_utils.fixed_cross_entropy": "loss",
    "transformers.loss.loss_utils.ForCausalLMLoss": "loss",
    f"{_TRAINER}.compute_loss": "loss",
    f"{_TRAINER}._get_num_items_in_batch": "loss",
    f"{_TRAINER}.create_accelerator_and_postprocess": "loss",  # its accumulation plugin: who divides the loss
    # optimizer: AdamW groups, LR schedule, clipping, zero_grad, step order
    f"{_TRAINER}.get_decay_parameter_names": "optimizer",
    f"{_TRAINER}.create_optimizer": "optimizer",
    f"{_TRAINER}.create_scheduler": "optimizer",
    "transformers.optimization._get_cosine_schedule_with_warmup_lr_lambda": "optimizer",
    f"{_TRAINER}._clip_grad_norm": "optimizer",
    f"{_ACCEL}.clip_grad_norm_": "optimizer",
    f"{_TRAINER}.training_step": "optimizer",
    f"{_TRAINER}._run_epoch": "optimizer",  # the step loop: sync steps, clip, step, scheduler step, zero_grad
    "accelerate.optimizer.AcceleratedOptimizer.step": "optimizer",
    # precision: autocast, GradScaler, dtypes
    f"{_TRAINER}.autocast_smart_context_manager": "precision",
    "accelerate.utils.modeling.get_mixed_precision_context_manager": "precision",
    f"{_ACCEL}.backward": "precision",
    f"{_ACCEL}.unscale_gradients": "precision",
    f"{_TRAINER}._move_model_to_device": "precision",  # the one place Trainer moves (and could cast) the weights
    # checkpoint: save/resume state
    f"{_TRAINER}._save_checkpoint": "checkpoint",
    f"{_TRAINER}._save_rng_state": "checkpoint",
    f"{_TRAINER}._load_rng_state": "checkpoint",
    f"{_TRAINER}._save_optimizer_and_scheduler": "checkpoint",
    f"{_TRAINER}._load_optimizer_and_scheduler": "checkpoint",
    f"{_TRAINER}._load_from_checkpoint": "checkpoint",
    f"{_TRAINER}._init_training_state": "checkpoint",
    "accelerate.data_loader.skip_first_batches": "checkpoint",
    # distributed: DDP, per-rank seeding, gradient sync
    "targets.hf.distributed.rank_environment": "distributed",
    f"{_ACCEL}.prepare_model": "distributed",
    f"{_ACCEL}.no_sync": "distributed",
    "accelerate.data_loader.BatchSamplerShard.__iter__": "distributed",
    "accelerate.data_loader.SeedableRandomSampler.set_epoch": "distributed",
    "accelerate.utils.operations.gather": "distributed",
    "transformers.trainer_utils.set_seed": "distributed",
    # eval: eval loop, metrics, splits
    "targets.hf.data.split_texts": "eval",
    f"{_TRAINER}.evaluate": "eval",
    f"{_TRAINER}.evaluation_loop": "eval",
    f"{_TRAINER}.prediction_step": "eval",
    f"{_TRAINER}.get_eval_dataloader": "eval",
}


def resolve(name: str):
    """The function (or class) a seam name designates, as it is now (raises ``ValueError`` if unknown)."""
    try:
        return resolve_name(name)
    except ValueError:
        raise ValueError(f"{name!r} does not name a function of the HF target") from None


def seams() -> list[Seam]:
    """Every seam with its subsystem and its definition's file:line, in table order."""
    out = []
    for name, subsystem in SEAMS.items():
        fn = inspect.unwrap(resolve(name))
        _, line = inspect.getsourcelines(fn)
        path = inspect.getsourcefile(fn)
        # relative to the folder holding the top-level package: site-packages, or the repository root
        root = os.path.dirname(os.path.dirname(importlib.import_module(live_module(name.split(".")[0])).__file__))
        out.append(Seam(name, subsystem, os.path.relpath(path, root), line))
    return out
