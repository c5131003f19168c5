"""Faults of the HF target in the `checkpoint` subsystem: what ``resume_from_checkpoint`` restores, and where."""

from __future__ import annotations

import glob
import os
import random
import warnings

import numpy as np
import torch
from transformers.trainer import (
    OPTIMIZER_NAME,
    OPTIMIZER_NAME_BIN,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    ExportableState,
    TrainerState,
    check_torch_load_is_safe,
    compare_trainer_and_checkpoint_args,
    get_fsdp_ckpt_kwargs,
    is_sagemaker_mp_enabled,
    is_torch_hpu_available,
    is_torch_mlu_available,
    is_torch_musa_available,
    is_torch_npu_available,
    is_torch_xla_available,
    load_fsdp_optimizer,
    logger,
    reissue_pt_warnings,
    safe_globals,
    set_rng_state_for_device,
)
from transformers.training_args import ParallelMode

from faultbench.faults.registry import Manifest, fault

_TRAINER = "transformers.trainer.Trainer"
# defined by transformers only where torch_xla / SageMaker / DeepSpeed are installed, and used only behind those checks
xm = smp = DeepSpeedSchedulerWrapper = None
# resume halfway through the resume recipe (attention dropout 0.1): the resumed run must retrace the uninterrupted one
_RESUME = dict(scenario="resume", steps=16, check="extra_at_least")


@fault(
    "hf_resume_rng_not_restored",
    target="hf", seam=f"{_TRAINER}._load_rng_state",
    title="Resume restores the python and numpy RNG states but not torch's CPU generator",
    subsystem="checkpoint", trigger="on-resume", symptoms=("divergence",),
    explanation="_load_rng_state reads rng_state.pth and restores random, numpy and the accelerator generators, "
    "but the line restoring torch's CPU generator is missing. On a CPU (or for anything drawn on the CPU "
    "generator) the resumed Trainer keeps the state a fresh process reached after set_seed and model "
    "building: the attention-dropout masks of every resumed step differ from the uninterrupted run's, so the "
    "losses after the resume are not the ones the checkpoint promised and the final weights differ.",
    fix="Restore every generator the checkpoint saved: torch.random.set_rng_state(checkpoint_rng_state['cpu']) "
    "next to the python/numpy/cuda states.",
    references=(
        "huggingface/transformers#11582: 'Reproducible checkpoint' (RNG states saved and restored on resume)",
        "huggingface/transformers#17032: '[Trainer]: Resume training with save_strategy=\"epoch\" does not load "
        "RNG state'",
    ),
    manifest=Manifest(**_RESUME, variant={"recipe": "resume"},
                      params={"key": "resume_loss_gap", "faulty_min": 1e-3, "clean_max": 0.0}),
)
def load_rng_state_without_torch(self, checkpoint: str | None) -> None:
    """The python and numpy states are restored, torch's CPU generator (dropout, sampling) is not."""
    # Load RNG states from `checkpoint`
    if checkpoint is None:
        return

    if self.args.world_size > 1:
        process_index = self.args.process_index
        rng_file = os.path.join(checkpoint, f"rng_state_{process_index}.pth")
        if not os.path.isfile(rng_file):
            logger.info(
                f"Didn't find an RNG file for process {process_index}, if you are resuming a training that "
                "wasn't launched in a distributed fashion, reproducibility is not guaranteed."
            )
            return
    else:
        rng_file = os.path.join(checkpoint, "rng_state.pth")
        if not os.path.isfile(rng_file):
            logger.info(
                "Didn't find an RNG file, if you are resuming a training that was launched in a distributed "
                "fashion, reproducibility is not guaranteed."
            )
            return

    with safe_globals():
        check_torch_load_is_safe()
        checkpoint_rng_state = torch.load(rng_file, weights_only=True)
    random.setstate(checkpoint_rng_state["python"])
    np.random.set_state(checkpoint_rng_state["numpy"])
    if is_torch_xla_available():
        xm.set_rng_state(checkpoint_rng_state["xla"])

    is_distributed = self.args.parallel_mode == ParallelMode.DISTRIBUTED
    if torch.cuda.is_available():
        set_rng_state_for_device("CUDA", torch.cuda, checkpoint_rng_state, is_distributed)
    if is_torch_npu_available():
        set_rng_state_for_device("NPU", torch.npu, checkpoint_rng_state, is_distributed)
    if is_torch_hpu_available():
        set_rng_state_for_device("HPU", torch.hpu, checkpoint_rng_state, is_distributed)
    if is_torch_mlu_available():
        set_rng_state_for_device("MLU", torch.mlu, checkpoint_rng_state, is_distributed)
    if is_torch_musa_available():
        set_rng_state_for_device("MUSA", torch.musa, checkpoint_rng_state, is_distributed)


@fault(
    "hf_resume_scheduler_not_restored",
    target="hf", seam=f"{_TRAINER}._load_optimizer_and_scheduler",
    title="Resume loads the optimizer state but not the LR scheduler's: the warmup starts over",
    subsystem="checkpoint", also_acceptable=("optimizer",), trigger="on-resume", symptoms=("divergence",),
    explanation="_load_optimizer_and_scheduler loads optimizer.pt but never scheduler.pt. The resumed "
    "LambdaLR stays at step 0: the first resumed step runs at the restored param-group LR, then the schedule "
    "restarts its warmup from zero and the cosine decay is shifted by the resume step. The LR curve has a "
    "cliff at the resume and the resumed losses leave the uninterrupted run's.",
    fix="Load the scheduler with the optimizer: self.lr_scheduler.load_state_dict(torch.load(scheduler.pt)).",
    references=(
        "huggingface/transformers#11582: 'Reproducible checkpoint' (resume must retrace the uninterrupted run)",
        "PyTorch tutorial 'Saving and Loading a General Checkpoint for Inference and/or Resuming Training': "
        "save and restore every stateful object",
    ),
    manifest=Manifest(**_RESUME, variant={"recipe": "resume"},
                      params={"key": "resume_loss_gap", "faulty_min": 1e-3, "clean_max": 0.0}),
)
def load_optimizer_without_scheduler(self, checkpoint: str | None) -> None:
    """The optimizer state is loaded; the LR scheduler keeps its fresh state (step 0)."""
    if checkpoint is None:
        return

    if self.is_deepspeed_enabled:
        # deepspeed loads optimizer/lr_scheduler together with the model in deepspeed_init
        if not isinstance(self.lr_scheduler, DeepSpeedSchedulerWrapper):
            with warnings.catch_warnings(record=True) as caught_warnings:
                check_torch_load_is_safe()
                self.lr_scheduler.load_state_dict(
                    torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
                )
            reissue_pt_warnings(caught_warnings)
        return

    checkpoint_file_exists = (
        glob.glob(os.path.join(checkpoint, OPTIMIZER_NAME) + "_*")
        if is_sagemaker_mp_enabled()
        else (
            os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME))
            or os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME_BIN))
            or (
                os.path.isdir(checkpoint)
                and any(
                    OPTIMIZER_NAME_BIN.split(".")[0] in folder_name
                    for folder_name in os.listdir(checkpoint)
                    if os.path.isdir(os.path.join(checkpoint, folder_name))
                )
            )
        )
    )
    checkpoint_file_exists = (
        glob.glob(os.path.join(checkpoint, f"rank*-of-{self.args.world_size}-{OPTIMIZER_NAME}"))
        if self.is_fsdp_xla_v1_enabled
        else checkpoint_file_exists
    )
    if checkpoint_file_exists and os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
        # Load in optimizer and scheduler states
        if is_torch_xla_available():
            # On TPU we have to take some extra precautions to properly load the states on the right device.
            if self.is_fsdp_xla_v1_enabled:
                check_torch_load_is_safe()
                optimizer_state = torch.load(
                    os.path.join(
                        checkpoint, f"rank{self.args.process_index}-of-{self.args.world_size}-{OPTIMIZER_NAME}"
                    ),
                    map_location="cpu",
                    weights_only=True,
                )
                # We only need `optimizer` when resuming from checkpoint
                optimizer_state = optimizer_state["optimizer"]
            else:
                check_torch_load_is_safe()
                optimizer_state = torch.load(
                    os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True
                )
            with warnings.catch_warnings(record=True) as caught_warnings:
                check_torch_load_is_safe()
                lr_scheduler_state = torch.load(
                    os.path.join(checkpoint, SCHEDULER_NAME), map_location="cpu", weights_only=True
                )
            reissue_pt_warnings(caught_warnings)

            xm.send_cpu_data_to_device(optimizer_state, self.args.device)
            xm.send_cpu_data_to_device(lr_scheduler_state, self.args.device)

            self.optimizer.load_state_dict(optimizer_state)
            self.lr_scheduler.load_state_dict(lr_scheduler_state)
        else:
            if is_sagemaker_mp_enabled():

                def opt_load_hook(mod, opt):
                    opt.load_state_dict(smp.load(os.path.join(checkpoint, OPTIMIZER_NAME), partial=True))

                self.model_wrapped.register_post_step_hook(opt_load_hook)
            else:
                # We use the CPU when training on one GPU to avoid OOM for GPU RAM when training big models.
                # In distributed training however, we load directly on each GPU and risk the GPU OOM as it's more
                # likely to get OOM on CPU (since we load num_gpu times the optimizer state
                # An indexed CPU device (e.g. "cpu:0") can't be restored by torch - use plain "cpu".
                map_location = (
                    self.args.device if self.args.world_size > 1 and self.args.device.type != "cpu" else "cpu"
                )
                if self.is_fsdp_enabled:
                    load_fsdp_optimizer(
                        self.accelerator.state.fsdp_plugin,
                        self.accelerator,
                        self.optimizer,
                        self.model,
                        checkpoint,
                        **get_fsdp_ckpt_kwargs(),
                    )
                else:
                    check_torch_load_is_safe()
                    self.optimizer.load_state_dict(
                        torch.load(
                            os.path.join(checkpoint, OPTIMIZER_NAME), map_location=map_location, weights_only=True
                        )
                    )


@fault(
    "hf_resume_skip_ignores_accumulation",
    target="hf", seam=f"{_TRAINER}._init_training_state",
    title="Resume skips global_step batches instead of global_step x gradient_accumulation_steps",
    subsystem="checkpoint", also_acceptable=("data",), trigger="on-resume", symptoms=("silent-quality",),
    explanation="On resume the number of batches already consumed in the current epoch is global_step "
    "(optimizer updates) modulo the updates per epoch; with gradient accumulation each update consumed "
    "gradient_accumulation_steps micro-batches, and the multiplication is missing. The resumed run skips "
    "only 1/accum of the data it has seen and retrains on it: the resumed losses are those of batches the "
    "model already learned from, and the run never covers the rest of the epoch in order.",
    fix="steps_trained_in_current_epoch *= self.args.gradient_accumulation_steps before skip_first_batches.",
    references=(
        "huggingface/transformers#8624: 'Fixes the training resuming with gradient accumulation'",
        "huggingface/transformers#5605: 'Here maybe a bug, when we load staged checkpoint'",
    ),
    manifest=Manifest(**_RESUME, variant={"recipe": "resume", "accum": 4},
                      params={"key": "resume_loss_gap", "faulty_min": 1e-3, "clean_max": 0.0}),
)
def init_training_state_skip_in_updates(
    self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
) -> tuple[int, int]:
    """The batches to skip are counted in optimizer updates, not micro-batches (no x accumulation)."""
    self.state = TrainerState(
        stateful_callbacks=[
            cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)
        ]
    )
    self.state.is_hyper_param_search = trial is not None
    self.state.train_batch_size = self._train_batch_size
    self.state.compute_steps(self.args, max_steps)

    epochs_trained = 0
    steps_trained_in_current_epoch = 0

    if resume_from_checkpoint is not None and os.path.isfile(
        os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)
    ):
        self.state = TrainerState.load_from_json(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME))
        if self.state.best_model_checkpoint is not None and not os.path.isdir(self.state.best_model_checkpoint):
            logger.warning(
                f"The best checkpoint {self.state.best_model_checkpoint} recorded in the resumed state does not "
                "exist anymore. Ignoring it for this run."
            )
            self.state.best_model_checkpoint = None
        compare_trainer_and_checkpoint_args(self.args, self.state)
        self._load_callback_state()
        epochs_trained = int(self.state.global_step // num_update_steps_per_epoch)
        if not self.args.ignore_data_skip:
            steps_trained_in_current_epoch = self.state.global_step % num_update_steps_per_epoch

    self.state.init_training_references(self, max_steps, num_train_epochs, trial)

    return epochs_trained, steps_trained_in_current_epoch


@fault(
    "hf_resume_optimizer_not_restored",
    target="hf", seam=f"{_TRAINER}._load_optimizer_and_scheduler",
    title="Resume restores the LR scheduler but not the optimizer: AdamW restarts from empty moments",
    subsystem="checkpoint", also_acceptable=("optimizer",), trigger="on-resume", symptoms=("divergence",),
    explanation="_load_optimizer_and_scheduler finds optimizer.pt and scheduler.pt and loads the scheduler, but the "
    "plain (non-FSDP) branch that loads the optimizer state runs only when world_size > 1 (the guard of its "
    "multi-device map_location, widened to the whole branch): a single-process resume keeps the fresh optimizer. "
    "The resumed AdamW has step 0 and zero first "
    "and second moments: its first updates are bias-corrected from a single gradient, a full-size unsmoothed step "
    "at the restored learning rate, so the loss jumps right after the resume and the resumed run never retraces "
    "the uninterrupted one.",
    fix="Load the optimizer state on every non-FSDP run (else:, not elif world_size > 1); only map_location depends "
    "on the number of processes.",
    references=(
        "Lightning-AI/pytorch-lightning#2613: 'Trainer(resume_from_checkpoint=...) does not load optimizer state'",
        "huggingface/transformers#33336: 'Training Resumes with Increased Loss Despite Checkpoint Loading'",
    ),
    manifest=Manifest(**_RESUME, variant={"recipe": "resume"},
                      params={"key": "resume_loss_gap", "faulty_min": 1e-3, "clean_max": 0.0}),
)
def load_scheduler_without_optimizer(self, checkpoint: str | None) -> None:
    """The scheduler state is loaded; the optimizer (Adam moments, step counts) keeps its fresh state."""
    if checkpoint is None:
        return

    if self.is_deepspeed_enabled:
        # deepspeed loads optimizer/lr_scheduler together with the model in deepspeed_init
        if not isinstance(self.lr_scheduler, DeepSpeedSchedulerWrapper):
            with warnings.catch_warnings(record=True) as caught_warnings:
                check_torch_load_is_safe()
                self.lr_scheduler.load_state_dict(
                    torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
                )
            reissue_pt_warnings(caught_warnings)
        return

    checkpoint_file_exists = (
        glob.glob(os.path.join(checkpoint, OPTIMIZER_NAME) + "_*")
        if is_sagemaker_mp_enabled()
        else (
            os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME))
            or os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME_BIN))
            or (
                os.path.isdir(checkpoint)
                and any(
                    OPTIMIZER_NAME_BIN.split(".")[0] in folder_name
                    for folder_name in os.listdir(checkpoint)
                    if os.path.isdir(os.path.join(checkpoint, folder_name))
                )
            )
        )
    )
    checkpoint_file_exists = (
        glob.glob(os.path.join(checkpoint, f"rank*-of-{self.args.world_size}-{OPTIMIZER_NAME}"))
        if self.is_fsdp_xla_v1_enabled
        else checkpoint_file_exists
    )
    if checkpoint_file_exists and os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
        # Load in optimizer and scheduler states
        if is_torch_xla_available():
            # On TPU we have to take some extra precautions to properly load the states on the right device.
            if self.is_fsdp_xla_v1_enabled:
                check_torch_load_is_safe()
                optimizer_state = torch.load(
                    os.path.join(
                        checkpoint, f"rank{self.args.process_index}-of-{self.args.world_size}-{OPTIMIZER_NAME}"
                    ),
                    map_location="cpu",
                    weights_only=True,
                )
                # We only need `optimizer` when resuming from checkpoint
                optimizer_state = optimizer_state["optimizer"]
            else:
                check_torch_load_is_safe()
                optimizer_state = torch.load(
                    os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True
                )
            with warnings.catch_warnings(record=True) as caught_warnings:
                check_torch_load_is_safe()
                lr_scheduler_state = torch.load(
                    os.path.join(checkpoint, SCHEDULER_NAME), map_location="cpu", weights_only=True
                )
            reissue_pt_warnings(caught_warnings)

            xm.send_cpu_data_to_device(optimizer_state, self.args.device)
            xm.send_cpu_data_to_device(lr_scheduler_state, self.args.device)

            self.optimizer.load_state_dict(optimizer_state)
            self.lr_scheduler.load_state_dict(lr_scheduler_state)
        else:
            if is_sagemaker_mp_enabled():

                def opt_load_hook(mod, opt):
                    opt.load_state_dict(smp.load(os.path.join(checkpoint, OPTIMIZER_NAME), partial=True))

                self.model_wrapped.register_post_step_hook(opt_load_hook)
            else:
                # We use the CPU when training on one GPU to avoid OOM for GPU RAM when training big models.
                # In distributed training however, we load directly on each GPU and risk the GPU OOM as it's more
                # likely to get OOM on CPU (since we load num_gpu times the optimizer state
                # An indexed CPU device (e.g. "cpu:0") can't be restored by torch - use plain "cpu".
                map_location = (
                    self.args.device if self.args.world_size > 1 and self.args.device.type != "cpu" else "cpu"
                )
                if self.is_fsdp_enabled:
                    load_fsdp_optimizer(
                        self.accelerator.state.fsdp_plugin,
                        self.accelerator,
                        self.optimizer,
                        self.model,
                        checkpoint,
                        **get_fsdp_ckpt_kwargs(),
                    )
                elif self.args.world_size > 1:
                    check_torch_load_is_safe()
                    self.optimizer.load_state_dict(
                        torch.load(
                            os.path.join(checkpoint, OPTIMIZER_NAME), map_location=map_location, weights_only=True
                        )
                    )
            with warnings.catch_warnings(record=True) as caught_warnings:
                check_torch_load_is_safe()
                self.lr_scheduler.load_state_dict(
                    torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
                )
            reissue_pt_warnings(caught_warnings)
