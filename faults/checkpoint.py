"""Faults in the `checkpoint` subsystem."""

import random
from pathlib import Path

import numpy as np
import torch

from faultbench.faults.registry import Manifest, fault
from faultbench.model.checkpoint import FORMAT, CheckpointError, _config_mismatch, _sha256, read_meta, restore_rng_state
from faultbench.model.train import StepRecord

# a resume halfway through 12 steps: the resumed run must retrace the uninterrupted one exactly
_RESUME = dict(scenario="resume", steps=12, check="extra_at_least")


@fault(
    "optimizer_state_not_restored",
    seam="model.checkpoint.load_checkpoint",
    title="Resume restores the weights but not the optimizer: Adam restarts from empty moments",
    subsystem="checkpoint",
    also_acceptable=("optimizer",),
    trigger="on-resume",
    symptoms=("divergence",),
    explanation="load_checkpoint loads the model, scheduler, scaler and sampler but leaves the freshly built "
    "AdamW as it is: step count 0, zero first and second moments, and the param groups' learning rate of "
    "step 0. The first resumed updates are bias-corrected from a single gradient (a full-size, "
    "unsmoothed step) so the loss jumps right after the resume and the run never retraces the "
    "uninterrupted one.",
    fix="Restore the optimizer too: run.optimizer.load_state_dict(state['optimizer']) (the checkpoint "
    "already holds it).",
    references=(
        "PyTorch tutorial 'Saving and Loading a General Checkpoint for Inference and/or Resuming Training': "
        "save and load optimizer.state_dict() as well as the model's",
        "HF transformers Trainer: checkpoints hold optimizer.pt and scheduler.pt next to the weights, and "
        "resume_from_checkpoint restores both",
    ),
    manifest=Manifest(**_RESUME, params={"key": "resume_loss_diff", "faulty_min": 0.02, "clean_max": 0.0}),
)
def load_checkpoint_without_optimizer(run, directory) -> None:
    """The optimizer's state (moments, step counts, learning rate) is never loaded."""
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
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.step = state["step"]
    run.history = [StepRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in state["history"]]
    restore_rng_state(state["rng"][run.rank])


@fault(
    "scheduler_state_not_restored",
    seam="model.checkpoint.load_checkpoint",
    title="Resume does not restore the LR scheduler: the warmup starts over",
    subsystem="checkpoint",
    also_acceptable=("optimizer",),
    trigger="on-resume",
    symptoms=("divergence",),
    explanation="load_checkpoint restores everything but the LambdaLR, whose step counter stays at 0. The "
    "first resumed step still uses the restored param-group learning rate, then the schedule restarts: the "
    "LR drops back to the start of the warmup and the cosine decay is shifted by the resume step, so "
    "the logged LR curve has a cliff at the resume and the loss stops following the uninterrupted run.",
    fix="Restore the scheduler as well: run.scheduler.load_state_dict(state['scheduler']).",
    references=(
        "PyTorch docs, torch.optim.lr_scheduler.LRScheduler.state_dict / load_state_dict: the schedule's "
        "position is the scheduler's own state, not the optimizer's",
        "pytorch/vision PR #1806 (detection reference script): resume loads model, optimizer AND lr_scheduler "
        "state",
    ),
    manifest=Manifest(**_RESUME, params={"key": "resume_loss_diff", "faulty_min": 0.02, "clean_max": 0.0}),
)
def load_checkpoint_without_scheduler(run, directory) -> None:
    """The LR scheduler's state is never loaded: its step counter restarts at 0."""
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
    run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.step = state["step"]
    run.history = [StepRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in state["history"]]
    restore_rng_state(state["rng"][run.rank])


@fault(
    "sampler_state_not_restored",
    seam="model.checkpoint.load_checkpoint",
    title="Resume does not restore the sampler: the data order restarts from the epoch's first batch",
    subsystem="checkpoint",
    also_acceptable=("data",),
    trigger="on-resume",
    symptoms=("silent-quality",),
    explanation="load_checkpoint restores the weights, optimizer, schedule and RNGs but not the sampler's "
    "(epoch, position), so the resumed run draws the epoch's batches from the start again: the batches "
    "seen just before the checkpoint are replayed and the rest of the epoch is seen later or never. "
    "Seeding the RNGs exactly does not help, since the order is the sampler's state. Losses after the "
    "resume differ from the uninterrupted run (the replayed batches were just trained on).",
    fix="Restore the sampler too: run.sampler.load_state_dict(state['sampler']), i.e. the epoch's "
    "permutation seed and the number of batches already consumed.",
    references=(
        "huggingface/transformers PR #8878 'Better support for resuming training': the data order was not "
        "advanced on resume, so resumed runs did not reproduce uninterrupted ones",
        "HF TrainingArguments.ignore_data_skip: by default a resume skips the batches already seen to reach "
        "the same data position",
    ),
    manifest=Manifest(**_RESUME, params={"key": "resume_loss_diff", "faulty_min": 0.02, "clean_max": 0.0}),
)
def load_checkpoint_without_sampler(run, directory) -> None:
    """The sampler's epoch and position are never loaded: the data order restarts."""
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
    run.step = state["step"]
    run.history = [StepRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in state["history"]]
    restore_rng_state(state["rng"][run.rank])


@fault(
    "step_off_by_one_on_resume",
    seam="model.checkpoint.load_checkpoint",
    title="Resumed step counter is one ahead: one optimizer step is silently skipped",
    subsystem="checkpoint",
    trigger="on-resume",
    symptoms=("silent-quality",),
    explanation="The checkpoint stores the number of steps taken, but load_checkpoint treats it as the "
    "index of the last finished step and resumes from the next one (step + 1). The loop then stops one "
    "step early: the resumed run takes steps - 1 optimizer steps, its step indices and logs are shifted "
    "by one against the schedule's own counter, and the final model (and its eval loss) differs from "
    "the uninterrupted run although every logged loss before the end matches.",
    fix="Resume from exactly the stored count: run.step = state['step'] (it already counts finished steps).",
    references=(
        "pytorch/examples imagenet/main.py saves 'epoch': epoch + 1 and resumes with start_epoch = "
        "checkpoint['epoch']; adding 1 again on load skips an epoch",
        "pytorch/vision PR #1806: the detection script saves 'epoch': epoch and resumes at checkpoint['epoch'] "
        "+ 1 (the other convention; mixing the two is the classic off-by-one)",
    ),
    manifest=Manifest(**_RESUME, params={"key": "resume_val_diff", "faulty_min": 0.002, "clean_max": 0.0}),
)
def load_checkpoint_next_step(run, directory) -> None:
    """Sets run.step to the stored step count + 1, so the resumed run skips one step."""
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
    run.step = state["step"] + 1  # resume after the last completed step
    run.history = [StepRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in state["history"]]
    restore_rng_state(state["rng"][run.rank])


@fault(
    "cpu_rng_restored_only_with_cuda",
    seam="model.checkpoint.restore_rng_state",
    title="torch's CPU RNG is restored only when a CUDA state is present: dropout masks change on resume",
    subsystem="checkpoint",
    trigger="on-resume",
    symptoms=("silent-quality",),
    explanation="restore_rng_state sets torch's CPU generator inside the `if 'cuda' in state` branch, so on "
    "a machine without CUDA the resumed run keeps the generator as build_run seeded it. With dropout on, "
    "every mask after the resume differs from the uninterrupted run: resuming is not reproducible, "
    "though GPU runs (where it was tested) are.",
    fix="Restore torch.set_rng_state(state['torch']) unconditionally; only the CUDA states depend on a GPU.",
    references=(
        "PyTorch docs: torch.set_rng_state sets the CPU generator only, torch.cuda.set_rng_state_all the CUDA "
        "ones: both must be restored",
        "HF transformers Trainer _save_rng_state / _load_rng_state: python, numpy, cpu and cuda states are "
        "saved and restored separately",
    ),
    manifest=Manifest(**_RESUME, variant={"model": {"dropout": 0.1}},
                      params={"key": "resume_loss_diff", "faulty_min": 0.001, "clean_max": 0.0}),
)
def restore_rng_state_cuda_only(state: dict) -> None:
    """torch's CPU generator is restored only inside the CUDA branch."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    if "cuda" in state:
        torch.set_rng_state(state["torch"])
        torch.cuda.set_rng_state_all(state["cuda"])
