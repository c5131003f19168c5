"""The HF target's components by role (``detectors.api.ROLES``): what the white-box detectors probe.

Each role names the seam it stands for and adapts that seam's live function to the role's normalized call,
translating only conventions, never behaviour: the collator pads on the tokenizer's side (the role sets it for the
call), the model returns an output object (the role returns its logits), the loss takes the vocabulary size, and
``create_causal_mask`` returns a boolean mask under SDPA (the role adds it as 0 / the dtype's lowest value, as the
eager path does).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers.cache_utils import DynamicLayer

from faultbench.detectors.api import Role

_TRAINER = "transformers.trainer.Trainer"


@contextlib.contextmanager
def _padding_on(run, side: str, pad_id: int):
    """The run's tokenizer padding on ``side`` for the duration (the stack reads the side off the tokenizer), with
    the pad id a caller asked for checked against the one it pads with."""
    tok = run.tokenizer
    if pad_id != tok.pad_token_id:
        raise ValueError(f"the tokenizer pads with its pad id {tok.pad_token_id}, not {pad_id}")
    was, tok.padding_side = tok.padding_side, side
    try:
        yield tok
    finally:
        tok.padding_side = was


def _collate(run, torch_call):
    """The run's ``DataCollatorForLanguageModeling`` on ``docs`` padded on ``side``."""
    def collate(docs, pad_id: int, side: str) -> dict:
        with _padding_on(run, side, pad_id):
            return dict(torch_call(run.trainer.data_collator, [{"input_ids": list(d)} for d in docs]))

    return collate


def _pad(run, pad):
    """The tokenizer's padding (``pad`` -> ``_pad`` per example) on ``side``."""
    def padded(docs, pad_id: int, side: str) -> dict:
        with _padding_on(run, side, pad_id) as tok:
            return dict(tok.pad({"input_ids": [list(d) for d in docs]}, return_tensors="pt"))

    return padded


def _forward(run, forward):
    """The model's logits from its class's forward: without the autocast wrapper accelerate puts on the instance
    under mixed precision (the reference's forward has none either: precision is the training step's business)."""
    def logits(input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        return forward(run.model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits

    return logits


def _loss(run, causal_lm_loss):
    def loss(logits, labels, num_targets=None) -> torch.Tensor:
        return causal_lm_loss(logits, labels, run.model.config.vocab_size, num_items_in_batch=num_targets)

    return loss


def _count_targets(run, num_items):
    """Trainer's count of the items its loss is divided by, for one micro-batch of ``labels``. On several ranks
    Trainer sums the count over them (``average_tokens_across_devices``): a probe passes the same labels on every
    rank, so the role divides by the world size."""
    def count(labels) -> int:
        counted = num_items(run.trainer, [{"labels": labels}], labels.device)
        if counted is None:
            raise ValueError("Trainer counts no items for this model (it does not take num_items_in_batch)")
        summed = run.world_size > 1 and run.trainer.args.average_tokens_across_devices
        return int(counted) // run.world_size if summed else int(counted)

    return count


def _mask_builder(run, create_causal_mask):
    """``create_causal_mask`` for the model's config and attention implementation, as an additive mask of the last
    ``query_len`` queries (a decode step's rows of the full mask)."""
    def build(attention_mask, query_len: int, dtype):
        batch, keys = attention_mask.shape
        embeds = torch.zeros(batch, keys, 1, dtype=dtype, device=attention_mask.device)
        mask = create_causal_mask(config=run.model.config, inputs_embeds=embeds, attention_mask=attention_mask,
                                  past_key_values=None)
        if mask is None:  # SDPA's is_causal path: plain causal attention
            if query_len == keys:
                return None
            mask = torch.ones(keys, keys, dtype=torch.bool, device=attention_mask.device).tril().expand(
                batch, 1, keys, keys)
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        return mask[:, :, keys - query_len:]

    return build


def _lr_at(run, cosine_lambda):
    """The cosine-with-warmup multiplier Trainer's "cosine" schedule uses, at the run's settings, times the LR."""
    def lr_at(step: int) -> float:
        return run.lr * cosine_lambda(step, num_warmup_steps=run.trainer.args.warmup_steps,
                                      num_training_steps=run.steps, num_cycles=0.5)

    return lr_at


def _make_scheduler(run, create_scheduler):
    """Trainer.create_scheduler for ``optimizer`` on a shallow copy of the trainer (it keeps the first scheduler it
    made: the copy starts without one)."""
    def make(optimizer):
        trainer = copy.copy(run.trainer)
        trainer.lr_scheduler = None
        return create_scheduler(trainer, num_training_steps=run.steps, optimizer=optimizer)

    return make


def _apply_rope(run, apply_rotary):
    """Llama's rotation with the angles laid out as it lays them out: each frequency's cos/sin on both halves."""
    def apply(q, k, cos, sin):
        return apply_rotary(q, k, torch.cat([cos, cos], -1)[:, 0], torch.cat([sin, sin], -1)[:, 0])

    return apply


def _decode(run, update_kwargs):
    """``generate``'s greedy decoding (its DynamicCache; the decode state carried from step to step is what
    ``_update_model_kwargs_for_generation`` updates: positions, cache position, mask), like the forward role without
    the autocast wrapper accelerate puts on the instance under mixed precision (put back after the call)."""
    def decode(input_ids, attention_mask, new: int):
        model = run.model
        wrapped = model.__dict__.pop("forward", None)
        try:
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=run.pad_id)
        finally:
            if wrapped is not None:
                model.forward = wrapped
        return out.sequences[:, input_ids.shape[1]:], torch.stack(out.logits, 1)

    return decode


def _kv_append(run, update):
    def fresh():
        layer = DynamicLayer()
        return lambda k, v: update(layer, k, v)

    return fresh


def _evaluate(run, evaluation_loop):
    """Trainer's evaluation loop on ``docs`` (its eval batch size: one batch of a probe's documents), as
    ``Trainer.evaluate`` runs it but without its logging and ``on_evaluate`` callbacks: a probe is no evaluation of
    the run's (a watch attached through the callback would take its loss for one)."""
    def evaluate(docs) -> float:
        loader = run.trainer.get_eval_dataloader([{"input_ids": list(d)} for d in docs])
        out = evaluation_loop(run.trainer, loader, description="faultbench probe", prediction_loss_only=True)
        return float(out.metrics["eval_loss"])

    return evaluate


def _causal_skip(run, ignore_causal_mask):
    """SDPA's decision to drop the explicit mask, for the last ``query_len`` queries of an empty cache's prefill."""
    def skip(attention_mask, query_len: int) -> bool:
        keys = attention_mask.shape[1]
        return bool(ignore_causal_mask(attention_mask.bool(), query_len, keys, keys - query_len, 0))

    return skip


_MASKS = "transformers.masking_utils"

ROLES = {
    "documents": Role("targets.hf.data.TextDataset.__getitem__"),
    # the tokenizer as wrap_tokenizer builds it: where its post-processor (the special tokens it adds) is set
    "encode": Role("targets.hf.data.wrap_tokenizer",
                   lambda run, wrap: lambda text: list(run.tokenizer(text)["input_ids"])),
    "batches": Role(f"{_TRAINER}.get_batch_samples"),
    "collate": Role("transformers.data.data_collator.DataCollatorForLanguageModeling.torch_call", _collate),
    "forward": Role("transformers.models.llama.modeling_llama.LlamaForCausalLM.forward", _forward),
    "loss": Role("transformers.loss.loss_utils.ForCausalLMLoss", _loss),
    "token_loss": Role("transformers.loss.loss_utils.fixed_cross_entropy",
                       lambda run, ce: lambda logits, targets, num_targets=None: ce(logits, targets, num_targets)),
    "pad": Role("transformers.tokenization_utils_base.PreTrainedTokenizerBase._pad", _pad),
    "count_targets": Role(f"{_TRAINER}._get_num_items_in_batch", _count_targets),
    "lr_at": Role("transformers.optimization._get_cosine_schedule_with_warmup_lr_lambda", _lr_at),
    "make_scheduler": Role(f"{_TRAINER}.create_scheduler", _make_scheduler),
    # its accelerator's gradient-accumulation plugin: whether backward divides the loss again
    "accumulation": Role(f"{_TRAINER}.create_accelerator_and_postprocess"),
    "train_step": Role(f"{_TRAINER}._run_epoch"),  # Trainer's step loop: clip, step, scheduler step, zero_grad
    "restore_position": Role(f"{_TRAINER}._init_training_state"),  # where Trainer sets the batches to skip
    "epoch_order": Role("accelerate.data_loader.SeedableRandomSampler.set_epoch"),
    "restore_optimizer": Role(f"{_TRAINER}._load_optimizer_and_scheduler"),
    "init_weights": Role("transformers.modeling_utils.PreTrainedModel._init_weights"),
    "place_model": Role(f"{_TRAINER}._move_model_to_device"),  # the one place Trainer moves (and could cast) weights
    "optimizer_groups": Role(f"{_TRAINER}.create_optimizer"),
    "decay_names": Role(f"{_TRAINER}.get_decay_parameter_names", lambda run, names: lambda model: names(
        run.trainer, model)),
    "apply_rope": Role("transformers.models.llama.modeling_llama.apply_rotary_pos_emb", _apply_rope),
    "repeat_kv": Role("transformers.models.llama.modeling_llama.repeat_kv"),  # the eager path's (sdpa has its own)
    "evaluate": Role(f"{_TRAINER}.evaluation_loop", _evaluate),
    "eval_step": Role(f"{_TRAINER}.prediction_step", lambda run, step: lambda batch: float(
        step(run.trainer, run.model, batch, prediction_loss_only=True)[0])),
    "decode": Role("transformers.generation.utils.GenerationMixin._update_model_kwargs_for_generation", _decode),
    "kv_append": Role("transformers.cache_utils.DynamicLayer.update", _kv_append),
    "mask_builder": Role(f"{_MASKS}.create_causal_mask", _mask_builder),
    "causal_mask_mod": Role(f"{_MASKS}.causal_mask_function"),
    "padding_mask_mod": Role(f"{_MASKS}.padding_mask_function"),
    "and_mask_mods": Role(f"{_MASKS}.and_masks"),
    "causal_skip": Role(f"{_MASKS}._ignore_causal_mask_sdpa", _causal_skip),
}
