"""The reference's components by role (``detectors.api.ROLES``): what the white-box detectors probe."""

from __future__ import annotations

import functools

from faultbench.detectors.api import Role

# the reference's seams already have the roles' normalized calls (they are where the conventions come from)
ROLES = {
    "documents": Role("model.data.load_corpus"),
    "batches": Role("model.train.next_micro_batches"),
    "encode": Role("model.tokenizer.Tokenizer.encode", lambda run, encode: functools.partial(encode, run.tokenizer)),
    "truncate": Role("model.data.truncate"),
    "collate": Role("model.data.collate"),
    "forward": Role("model.gpt.GPT.forward", lambda run, forward: run.model),  # the module: its hooks run too
    "loss": Role("model.loss.lm_loss"),
    "count_targets": Role("model.loss.count_targets"),
    "position_ids": Role("model.rope.position_ids_from_mask"),
    "mask_builder": Role("model.attention.build_attention_mask"),
    "attend": Role("model.attention.attend"),
    "apply_rope": Role("model.rope.apply_rope", lambda run, apply: lambda q, k, cos, sin: (apply(q, cos, sin),
                                                                                           apply(k, cos, sin))),
    "init_weights": Role("model.gpt.GPT.init_weights"),
    "restore_optimizer": Role("model.checkpoint.load_checkpoint"),
    "restore_position": Role("model.checkpoint.load_checkpoint"),
    "epoch_order": Role("model.sampler.ResumableSampler.next_indices"),
    "optimizer_groups": Role("model.optim.configure_optimizer"),
    "lr_at": Role("model.optim.lr_at", lambda run, lr_at: lambda step: lr_at(step, run.config.train)),
    "make_scheduler": Role("model.optim.make_scheduler", lambda run, make: lambda opt: make(opt, run.config.train)),
    "train_step": Role("model.train.train_step"),
    "accumulation": Role("model.train.train_step"),  # it divides by the window's target count
    "optimizer_step": Role("model.train.optimizer_step"),
    "clip_gradients": Role("model.train.clip_gradients"),
    "split_of": Role("model.corpus.split_of"),
}
