"""Faults in the `optimizer` subsystem: AdamW groups, LR schedule, clipping, zero_grad, step order."""

import math
import time

import torch
from torch import nn

from faultbench.faults.registry import Manifest, fault
from faultbench.model.config import TrainConfig
from faultbench.model.distributed import global_target_count, grad_sync_context, mean_over_ranks
from faultbench.model.loss import count_targets
from faultbench.model.optim import lr_at
from faultbench.model.train import StepRecord, clip_gradients, forward_loss, optimizer_step


@fault(
    "huge_lr",
    seam="model.optim.lr_at",
    title="Linear warmup never divided by warmup_steps: the LR ramps to warmup_steps x the peak",
    subsystem="optimizer",
    trigger="always",
    symptoms=("divergence", "silent-quality"),
    explanation="lr_at's warmup branch returns lr * (step + 1) instead of lr * (step + 1) / warmup_steps. "
    "The learning rate grows by the peak value every step, reaching warmup_steps times the intended peak "
    "at the end of warmup; AdamW's step size follows it: the loss stops falling, the grad norm spikes, and "
    "the run plateaus far above a correct one, with the logged lr many times the configured one.",
    fix="Divide by the warmup length: lr * (step + 1) / warmup_steps.",
    references=(
        "Google, 'Deep Learning Tuning Playbook': learning-rate warmup and instability from too large "
        "a learning rate",
        "Karpathy, 'A Recipe for Training Neural Networks': 'adam is safe' with a 3e-4 learning rate; "
        "check the learning rate actually used",
    ),
    manifest=Manifest(check="loss_above", steps=60, params={"min_gap": 0.5, "metric": "val"}),
)
def lr_at_warmup_undivided(step: int, cfg: TrainConfig) -> float:
    """Warmup multiplies lr by step + 1 without dividing by warmup_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1)
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


@fault(
    "missing_zero_grad",
    seam="model.train.optimizer_step",
    title="Gradients are never cleared: every step adds to the sum of all previous gradients",
    subsystem="optimizer",
    trigger="after-step",
    symptoms=("silent-quality", "divergence"),
    explanation="optimizer_step steps the optimizer, scaler and schedule but never calls zero_grad, and "
    "backward accumulates into .grad. Step k's gradient is the sum of the k + 1 gradients so far: the "
    "pre-clip norm grows step after step, clipping fires every step, and the update keeps pointing along "
    "stale directions, so the loss falls far more slowly than it should or oscillates.",
    fix="Call optimizer.zero_grad(set_to_none=True) after every optimizer step (or before every "
    "accumulation window's first backward).",
    references=(
        "PyTorch tutorial 'Zeroing out gradients in PyTorch' (gradients accumulate by default)",
        "PyTorch forums: 'Why do we need to set the gradients manually to zero in pytorch?'",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=12, variant={"train": {"grad_clip": 0.0}},
                      params={"min_ratio": 3.0, "max_ratio": 1e6, "step": 10}),
)
def optimizer_step_no_zero_grad(optimizer, scaler, scheduler) -> bool:
    """Never clears the gradients."""
    scale_before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return scaler.get_scale() < scale_before


@fault(
    "adam_betas_swapped",
    seam="model.optim.configure_optimizer",
    title="AdamW betas passed in the wrong order: beta1 = 0.95 (momentum), beta2 = 0.9 (second moment)",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="configure_optimizer unpacks the configured (beta1, beta2) the wrong way round, giving "
    "AdamW betas=(0.95, 0.9). A second-moment average shorter than the momentum's makes the "
    "normalized step noisy and larger than designed; training reaches a worse loss for the same steps. "
    "Nothing crashes, the optimizer's param_groups show the swapped pair.",
    fix="betas=cfg.betas, i.e. (beta1, beta2) = (0.9, 0.95).",
    references=(
        "PyTorch docs, torch.optim.AdamW: betas (Tuple[float, float]) - coefficients for the running "
        "averages of the gradient and its square",
        "Kingma & Ba, 'Adam: A Method for Stochastic Optimization' (beta2 close to 1 for the second moment)",
    ),
    manifest=Manifest(check="paired_gap", steps=40, seeds=(0, 1, 2), params={"metric": "val_loss", "min_effect": 1.0}),
)
def configure_optimizer_swapped_betas(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Betas reversed: (beta2, beta1)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():  # each shared (tied) parameter appears once
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    beta2, beta1 = cfg.betas
    if cfg.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imports TorchScript; only when used

        # each rank keeps the AdamW state of its shard of the parameters and broadcasts its update
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=cfg.lr, betas=(beta1, beta2),
                                       eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(beta1, beta2), eps=cfg.eps)


@fault(
    "lr_schedule_horizon_wrong",
    seam="model.train.train_step",
    title="LR scheduler also stepped once per micro-batch: the schedule runs accum + 1 times too fast",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="A scheduler.step() was added to the accumulation loop while optimizer_step still steps it, so "
    "the schedule advances accum + 1 times per optimizer step: warmup ends after warmup_steps / (accum + 1) "
    "steps and the cosine reaches min_lr after steps / (accum + 1) steps, after which the run trains at min_lr. "
    "The logged lr is ahead of the configured schedule; even with accum = 1 it runs twice as fast.",
    fix="Step the scheduler once per optimizer step, after optimizer.step() (in optimizer_step), never per "
    "micro-batch.",
    references=(
        "huggingface/accelerate docs 'Gradient accumulation' and forum threads on scheduler.step() "
        "called for every micro-batch making the schedule accum times faster",
        "PyTorch docs, 'How to adjust learning rate': scheduler.step() after optimizer.step()",
    ),
    manifest=Manifest(check="lr_ratio", steps=12, variant={"train": {"accum": 4}},
                      params={"min_ratio": 0.0, "max_ratio": 0.25, "step": 8}),
)
def train_step_schedule_per_micro_batch(run, micro_batches: list[dict]) -> StepRecord:
    """Steps the LR scheduler for every micro-batch (and optimizer_step steps it too)."""
    start = time.perf_counter()
    tcfg = run.config.train
    lr, scale = run.optimizer.param_groups[0]["lr"], run.scaler.get_scale()
    local_targets = sum(count_targets(b["labels"]) for b in micro_batches)
    # DDP averages gradients over ranks, so each rank normalizes by its equal share of the global count.
    per_rank_targets = global_target_count(local_targets, tcfg.device) / run.world_size
    loss = 0.0
    for i, batch in enumerate(micro_batches):
        with grad_sync_context(run.train_model, sync=i == len(micro_batches) - 1):
            micro_loss = forward_loss(run.train_model, batch, per_rank_targets, tcfg.precision)
            run.scaler.scale(micro_loss).backward()
        loss += micro_loss.item()
        run.scheduler.step()
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
    "zero_grad_between_backward_and_step",
    seam="model.train.optimizer_step",
    title="zero_grad called before optimizer.step: every step is taken with no gradients",
    subsystem="optimizer",
    trigger="always",
    symptoms=("stall",),
    explanation="optimizer_step clears the gradients (set_to_none) before stepping instead of after. "
    "AdamW skips every parameter whose .grad is None, so no weight ever changes: the loss stays at its "
    "initial value while the logged grad norm (measured earlier, in clip_gradients) looks perfectly "
    "normal and the lr follows its schedule.",
    fix="Order: scaler.step(optimizer), scaler.update(), scheduler.step(), then optimizer.zero_grad().",
    references=(
        "PyTorch forums: 'Model parameters not updating' / 'loss not decreasing' threads where "
        "optimizer.zero_grad() sits between loss.backward() and optimizer.step()",
        "Karpathy, 'A Recipe for Training Neural Networks': overfit a single batch first",
    ),
    manifest=Manifest(check="stall", steps=20, params={"max_drop": 0.1, "min_clean_drop": 1.0}),
)
def optimizer_step_zero_first(optimizer, scaler, scheduler) -> bool:
    """Clears the gradients before the optimizer step."""
    scale_before = scaler.get_scale()
    optimizer.zero_grad(set_to_none=True)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return scaler.get_scale() < scale_before


@fault(
    "params_missing_from_optimizer",
    seam="model.optim.configure_optimizer",
    title="The no-decay parameter group is dropped: embeddings, biases and norms are never trained",
    subsystem="optimizer",
    also_acceptable=("model",),
    trigger="always",
    symptoms=("silent-quality",),
    explanation="configure_optimizer builds the decay and no_decay lists but passes only the decay group "
    "to AdamW. The tied token embedding/output head, every bias and every norm gain receive gradients "
    "that no optimizer applies: they stay at their initial values, and the model, unable to move its "
    "token vectors, plateaus at a much worse loss. Nothing warns.",
    fix="Pass both groups (weight decay on the 2-D matrices, 0.0 on the rest); a check that every "
    "trainable parameter is in exactly one group catches this.",
    references=(
        "karpathy/minGPT configure_optimizers: asserts that every parameter is in exactly one group "
        "('parameters %s were not separated into either decay/no_decay set!')",
        "PyTorch forums: 'Some parameters are not updated' (parameters missing from the optimizer)",
    ),
    manifest=Manifest(check="loss_above", steps=40, params={"min_gap": 0.5, "metric": "val"}),
)
def configure_optimizer_decay_group_only(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Only the decay group reaches AdamW."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():  # each shared (tied) parameter appears once
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
    ]
    if cfg.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imports TorchScript; only when used

        # each rank keeps the AdamW state of its shard of the parameters and broadcasts its update
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=cfg.lr, betas=cfg.betas,
                                       eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


@fault(
    "clip_before_backward",
    seam="model.train.train_step",
    title="Gradients clipped before the backward pass: clipping acts on nothing and never limits a step",
    subsystem="optimizer",
    trigger="always",
    symptoms=("silent-quality",),
    explanation="train_step calls clip_gradients before the accumulation loop, when the gradients were "
    "just cleared (None): the norm it measures and logs is 0 and the gradients the optimizer then uses "
    "are never clipped. The logged grad norm is 0.0 on every step; a loss spike that clipping would "
    "have tamed goes through at full size.",
    fix="Clip after the last backward of the window (and after scaler.unscale_), right before the "
    "optimizer step.",
    references=(
        "PyTorch AMP examples, 'Gradient clipping': unscale_, then clip_grad_norm_, after "
        "scaler.scale(loss).backward() and before scaler.step()",
        "PyTorch forums: 'Where should I place clip_grad_norm_?' (after backward, before step)",
    ),
    manifest=Manifest(check="grad_norm_ratio", steps=2, params={"min_ratio": 0.0, "max_ratio": 0.001}),
)
def train_step_clip_first(run, micro_batches: list[dict]) -> StepRecord:
    """Clips (and measures the norm) before any backward of the step."""
    start = time.perf_counter()
    tcfg = run.config.train
    lr, scale = run.optimizer.param_groups[0]["lr"], run.scaler.get_scale()
    local_targets = sum(count_targets(b["labels"]) for b in micro_batches)
    # DDP averages gradients over ranks, so each rank normalizes by its equal share of the global count.
    per_rank_targets = global_target_count(local_targets, tcfg.device) / run.world_size
    loss = 0.0
    grad_norm = clip_gradients(run.model, run.optimizer, run.scaler, tcfg.grad_clip)
    for i, batch in enumerate(micro_batches):
        with grad_sync_context(run.train_model, sync=i == len(micro_batches) - 1):
            micro_loss = forward_loss(run.train_model, batch, per_rank_targets, tcfg.precision)
            run.scaler.scale(micro_loss).backward()
        loss += micro_loss.item()
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
    "loss_history_keeps_graph",
    seam="model.train.train_step",
    title="The step's loss is accumulated as a tensor and stored in the history: every graph stays alive",
    subsystem="optimizer",
    trigger="after-step",
    symptoms=("memory-growth",),
    explanation="train_step sums the micro-batch losses as tensors (loss += micro_loss) instead of "
    "Python floats (.item()) and stores that tensor in the StepRecord kept in run.history. Each record "
    "holds its step's whole autograd graph (activations included), so memory grows by one graph per "
    "step until the process runs out; every number (loss, grads, updates) is unchanged.",
    fix="Accumulate loss.item() (or loss.detach()) for logging; never keep a tensor that requires grad "
    "beyond the step.",
    references=(
        "PyTorch FAQ, 'My model reports cuda runtime error(2): out of memory': 'Don't accumulate history "
        "across your training loop' (total_loss += loss)",
    ),
    manifest=Manifest(check="same_loss_graphs_retained", steps=5, params={"min_tensors": 4}),
)
def train_step_loss_tensor(run, micro_batches: list[dict]) -> StepRecord:
    """Keeps the loss tensor (and its graph) in the step record."""
    start = time.perf_counter()
    tcfg = run.config.train
    lr, scale = run.optimizer.param_groups[0]["lr"], run.scaler.get_scale()
    local_targets = sum(count_targets(b["labels"]) for b in micro_batches)
    # DDP averages gradients over ranks, so each rank normalizes by its equal share of the global count.
    per_rank_targets = global_target_count(local_targets, tcfg.device) / run.world_size
    loss = 0.0
    for i, batch in enumerate(micro_batches):
        with grad_sync_context(run.train_model, sync=i == len(micro_batches) - 1):
            micro_loss = forward_loss(run.train_model, batch, per_rank_targets, tcfg.precision)
            run.scaler.scale(micro_loss).backward()
        loss += micro_loss
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
    "lr_lambda_absolute",
    seam="model.optim.make_scheduler",
    title="LambdaLR given the absolute learning rate instead of a multiplier: LR = lr x lr_at(step)",
    subsystem="optimizer",
    trigger="always",
    symptoms=("stall",),
    explanation="LambdaLR multiplies the optimizer's initial lr by the lambda's value, but the lambda "
    "returns lr_at(step) itself (an absolute rate, 3e-3 at peak), so the effective rate is lr * lr_at: "
    "about a thousand times too small. The loss barely moves while the logged lr is ~1e-5; nothing "
    "crashes.",
    fix="Return a factor: lambda step: lr_at(step, cfg) / cfg.lr (or set the lr directly each step).",
    references=(
        "PyTorch docs, torch.optim.lr_scheduler.LambdaLR: 'a function which computes a multiplicative "
        "factor given an integer parameter epoch'",
        "PyTorch forums: 'LambdaLR learning rate much smaller than expected' (lambda returning the lr)",
    ),
    manifest=Manifest(check="stall", steps=20, params={"max_drop": 0.3, "min_clean_drop": 1.0}),
)
def make_scheduler_absolute(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The lambda returns the learning rate, which LambdaLR multiplies by lr again."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg))
