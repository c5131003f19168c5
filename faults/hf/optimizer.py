"""HF faults in the `optimizer` subsystem: Trainer's AdamW groups and LR, its cosine schedule, and the step loop
(zero_grad, when the scheduler steps)."""

import contextlib
import functools
from collections import defaultdict

import torch
from torch import nn
from transformers.trainer import (
    DistributedType,
    GreedyLR,
    get_parameter_names,
    get_scheduler,
    has_mixed_dtensor,
    is_fsdp_managed_module,
    is_optimizer_factory,
    is_sagemaker_mp_enabled,
    is_torch_xla_available,
    logger,
    skip_first_batches,
)

from faultbench.faults.registry import Manifest, fault

# transformers.trainer imports these only where SageMaker MP / torch_xla are installed; the copied bodies use them
# only behind those checks, as the originals do
smp = xm = None

_ACCUM = {"recipe": "accum"}  # 4 micro-batches per optimizer step


@fault(
    "hf_missing_zero_grad", target="hf", seam="transformers.trainer.Trainer._run_epoch",
    title="Gradients never cleared: the step loop lost model.zero_grad()",
    subsystem="optimizer", trigger="always", symptoms=("silent-quality",),
    explanation="Trainer._run_epoch clips, steps the optimizer and the scheduler after each accumulation window "
    "but no longer calls model.zero_grad(), so every backward adds to the gradients of all earlier steps. Each "
    "update follows the stale sum plus the fresh gradient. Clipping rescales that sum in place every step, so "
    "here it does not blow up: the run behaves like an undamped extra momentum, the pre-clip gradient norm stays "
    "~1.5x the clean one instead of falling as the loss does, and the update lags the data (without clipping "
    "the sum grows without bound).",
    fix="Call model.zero_grad() (or optimizer.zero_grad()) after every optimizer step, inside the sync-step branch.",
    references=(
        "PyTorch docs, torch.optim 'Taking an optimization step': gradients accumulate in .grad until "
        "optimizer.zero_grad() clears them",
        "huggingface/accelerate docs, 'Gradient accumulation': zero_grad after each optimizer step",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=8, params={"min_ratio": 1.3, "max_ratio": 10.0, "step": 7}),
)
def run_epoch_no_zero_grad(self, model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                           ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                           steps_trained_in_current_epoch):
    """The gradients of every step stay in .grad and add up: zero_grad is never called."""

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
            do_sync_step = (step + 1) % self.args.gradient_accumulation_steps == 0 or (step + 1) == steps_in_epoch
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
    "hf_sched_step_per_microbatch", target="hf", seam="transformers.trainer.Trainer._run_epoch",
    title="LR scheduler stepped on every micro-batch, not on every optimizer step",
    subsystem="optimizer", trigger="always", symptoms=("silent-quality",),
    explanation="Trainer._run_epoch calls lr_scheduler.step() after every micro-batch instead of inside the "
    "sync-step branch. With gradient accumulation k the schedule runs k times too fast: warmup ends after "
    "warmup/k optimizer steps (the first steps already take a large LR) and the cosine decays to zero at 1/k "
    "of the run, which then trains on at LR ~0. Without accumulation nothing shows.",
    fix="Step the scheduler once per optimizer step: only when the gradients were synced and the step was "
    "not skipped.",
    references=(
        "huggingface/accelerate#999: Fix scheduler incorrect steps when gradient accumulation enabled",
        "huggingface/accelerate#963: the report it fixes (scheduler stepped on accumulation micro-batches)",
    ),
    manifest=Manifest(check="lr_ratio", steps=8, variant=_ACCUM, params={"min_ratio": 5.0, "max_ratio": 9.0,
                                                                         "step": 1}),
)
def run_epoch_scheduler_per_microbatch(self, model, epoch, train_dataloader, steps_in_epoch,
                                       num_update_steps_per_epoch, trial, ignore_keys_for_eval, start_time,
                                       resume_from_checkpoint, epochs_trained, steps_trained_in_current_epoch):
    """The scheduler steps after every micro-batch, accumulation or not."""

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
            do_sync_step = (step + 1) % self.args.gradient_accumulation_steps == 0 or (step + 1) == steps_in_epoch
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

            if not self.accelerator.optimizer_step_was_skipped:
                # Delay optimizer scheduling until metrics are generated
                if not isinstance(self.lr_scheduler, (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)):
                    self.lr_scheduler.step()

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
    "hf_wd_on_norm_weights", target="hf", seam="transformers.trainer.Trainer.get_decay_parameter_names",
    title="No-decay names match nothing: RMSNorm gains get weight decay",
    subsystem="optimizer", trigger="always", symptoms=("silent-quality",),
    explanation="get_decay_parameter_names excludes parameters by layer type (nn.LayerNorm, as "
    "ALL_LAYERNORM_LAYERS did) and by the name 'bias' only. Llama's LlamaRMSNorm is not an nn.LayerNorm and has no bias, so "
    "every norm gain (input_layernorm, post_attention_layernorm, the final norm) lands in the decayed group and "
    "is pulled towards 0 by AdamW's decoupled weight decay: the normalized activations shrink, which the model "
    "must fight with its other weights (worse, on long runs, with a large weight decay).",
    fix="Exclude norms by name as well: forbidden patterns 'bias', 'layernorm', 'rmsnorm', '(^|.)norm($|.)', "
    "'_norm($|.)'.",
    references=(
        "huggingface/transformers#35927: layernorm_decay_fix",
        "huggingface/transformers#42754: Excluding weight decay not working properly on most LMs",
    ),
    manifest=Manifest(check="extra_at_least", steps=2, params={"key": "decayed_params", "faulty_min": 21,
                                                               "clean_max": 16}),
)
def decay_parameter_names_by_type_only(self, model: torch.nn.Module) -> list[str]:
    """Norms are excluded by type (nn.LayerNorm) and the name 'bias' only: RMSNorm gains are decayed."""
    decay_parameters = get_parameter_names(model, [nn.LayerNorm])
    decay_parameters = [name for name in decay_parameters if "bias" not in name]
    return decay_parameters


@fault(
    "hf_huge_lr", target="hf", seam="transformers.trainer.Trainer.create_optimizer",
    title="Linear scaling rule applied to an LR already tuned for the global batch: LR x16",
    subsystem="optimizer", trigger="always", symptoms=("silent-quality",),
    explanation="create_optimizer multiplies TrainingArguments.learning_rate by the sequences per optimizer step "
    "(per-device batch x accumulation x world size = 16) before building AdamW, as if it were a per-sequence LR "
    "(the 'linear scaling rule'); but learning_rate is the LR of the whole step. Every step, warmup and decay "
    "included, runs at 16x the intended LR (128x at a batch of 128). This tiny model survives it: its loss "
    "spikes after warmup (pre-clip gradient norm x4 at step 4) and recovers; real models diverge.",
    fix="Pass args.learning_rate unchanged: scale it only when the configured value is explicitly per sample.",
    references=(
        "Goyal et al. 2017, 'Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour' (the linear scaling "
        "rule: scale the LR of a base batch by k for a k-times larger batch, once)",
        "Google, 'Deep Learning Tuning Playbook': the learning rate is tuned for a batch size; changing one "
        "without the other changes the run",
    ),
    manifest=Manifest(check="lr_ratio", steps=2, params={"min_ratio": 12.0, "max_ratio": 20.0, "step": 1}),
)
def create_optimizer_batch_scaled_lr(self, model=None) -> torch.optim.Optimizer:
    """The LR is multiplied by the sequences per optimizer step before AdamW is built."""
    opt_model = self.model if model is None else model

    if self.optimizer is None:
        decay_parameters = self.get_decay_parameter_names(opt_model)
        optimizer_grouped_parameters = [
            {
                "params": [
                    p for n, p in opt_model.named_parameters() if (n in decay_parameters and p.requires_grad)
                ],
                "weight_decay": self.args.weight_decay,
            },
            {
                "params": [
                    p for n, p in opt_model.named_parameters() if (n not in decay_parameters and p.requires_grad)
                ],
                "weight_decay": 0.0,
            },
        ]
        if has_mixed_dtensor(p for group in optimizer_grouped_parameters for p in group["params"]):
            # Parameters on different device meshes (expert parallelism, alone or with FSDP2 on a 2-D
            # mesh) cannot share one fused/foreach kernel call: give each mesh its own param group.
            from torch.distributed.tensor import DTensor

            split_groups = []
            for group in optimizer_grouped_parameters:
                by_mesh = defaultdict(list)
                for p in group["params"]:
                    by_mesh[p.device_mesh if isinstance(p, DTensor) else None].append(p)
                split_groups.extend({**group, "params": params} for params in by_mesh.values())
            optimizer_grouped_parameters = split_groups

        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)

        # Check if this is a factory (for complex optimizers like Muon, Dion)
        # Factories are instantiated first, then called with (opt_model, **kwargs)
        if is_optimizer_factory(optimizer_cls):
            self.optimizer = optimizer_cls()(opt_model, **optimizer_kwargs)
        else:
            # Standard optimizer class instantiation
            # Overwrite `params` in case it's created by `get_optimizer_cls_and_kwargs`
            # e.g. for GaLore optimizer.
            if "params" in optimizer_kwargs:
                optimizer_grouped_parameters = optimizer_kwargs.pop("params")

            # Overwrite `model` in case it's created by `get_optimizer_cls_and_kwargs`
            # e.g. for LOMO optimizer.
            if "model" in optimizer_kwargs:
                optimizer_grouped_parameters = optimizer_kwargs.pop("model")

            # For layer-wise dummy optimizers we overwrite optimizer_grouped_parameters with `optimizer_dict`
            # to avoid arguments conflicts.
            if "optimizer_dict" in optimizer_kwargs:
                optimizer_grouped_parameters = optimizer_kwargs.pop("optimizer_dict")

            # linear scaling rule: the LR grows with the sequences per optimizer step
            optimizer_kwargs["lr"] *= self.args.train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size
            self.optimizer = optimizer_cls(optimizer_grouped_parameters, **optimizer_kwargs)

        if "bitsandbytes" in str(optimizer_cls) and optimizer_kwargs.get("optim_bits", None) == 8:
            import bitsandbytes

            manager = bitsandbytes.optim.GlobalOptimManager.get_instance()

            skipped = 0
            for module in opt_model.modules():
                if isinstance(module, nn.Embedding):
                    skipped += sum({p.data_ptr(): p.numel() for p in module.parameters()}.values())
                    logger.info(f"skipped {module}: {skipped / 2**20}M params")
                    manager.register_module_override(module, "weight", {"optim_bits": 32})
                    logger.debug(f"bitsandbytes: will optimize {module} in fp32")
            logger.info(f"skipped: {skipped / 2**20}M params")

    if is_sagemaker_mp_enabled():
        self.optimizer = smp.DistributedOptimizer(self.optimizer)

    return self.optimizer


@fault(
    "hf_sched_wrong_num_steps", target="hf", seam="transformers.trainer.Trainer.create_scheduler",
    title="LR schedule built for the micro-batches, not the optimizer steps: the cosine never decays",
    subsystem="optimizer", trigger="always", symptoms=("silent-quality",),
    explanation="create_scheduler sizes the cosine schedule with num_training_steps x gradient_accumulation_steps "
    "(micro-batches) while the scheduler steps once per optimizer step. With accumulation k the decay is k times "
    "too slow: the run ends with the LR still near its peak instead of near 0 (and the last steps' noise is "
    "never annealed away). Without accumulation nothing shows.",
    fix="Build the schedule with the number of optimizer steps (max_steps as Trainer computes it), and step it "
    "once per optimizer step.",
    references=(
        "huggingface/transformers#24088: Do not prepare lr scheduler as it as the right number of steps (the "
        "scheduler's step count and the optimizer's must agree)",
        "huggingface/accelerate#2318: total_num_steps for scheduler",
    ),
    manifest=Manifest(check="lr_ratio", steps=16, variant=_ACCUM, params={"min_ratio": 10.0, "max_ratio": 50.0,
                                                                          "step": 15}),
)
def create_scheduler_micro_batch_steps(self, num_training_steps: int,
                                       optimizer: torch.optim.Optimizer | None = None
                                       ) -> torch.optim.lr_scheduler.LRScheduler:
    """The schedule's length counts micro-batches: accumulation k stretches the cosine k times."""
    if self.lr_scheduler is None:
        if optimizer is None:
            if is_sagemaker_mp_enabled() and smp.state.cfg.fp16:
                # If fp16 is enabled, we unwrap the optimizer
                optimizer = self.optimizer.optimizer
            else:
                optimizer = self.optimizer
        num_training_steps = num_training_steps * self.args.gradient_accumulation_steps
        self.lr_scheduler = get_scheduler(
            self.args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=self.args.get_warmup_steps(num_training_steps),
            num_training_steps=num_training_steps,
            scheduler_specific_kwargs=self.args.lr_scheduler_kwargs,
        )
        self._created_lr_scheduler = True
    return self.lr_scheduler
