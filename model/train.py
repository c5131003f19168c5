"""One training step and the training loop.

A step is: for each micro-batch of the accumulation window, autocast forward and loss, scaled
backward; then unscale, clip (recording the pre-clip norm), optimizer step through the scaler,
scaler update, one scheduler step, and zero_grad. Each stage is its own function (seam).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from .data import collate
from .distributed import global_target_count, grad_sync_context, mean_over_ranks
from .loss import count_targets, lm_loss
from .precision import autocast_context


@dataclass
class StepRecord:
    step: int  # 0-based index of the optimizer step
    loss: float  # token mean over the whole accumulation window
    grad_norm: float  # global L2 norm of the unscaled gradient, before clipping
    lr: float  # learning rate this step used
    scale: float  # GradScaler scale this step used (1.0 when scaling is off)
    skipped: bool  # the scaler found inf/NaN gradients and skipped the update
    tokens: int  # real (non-pad) input tokens in the step, on this rank
    seconds: float  # wall time of the step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.inf

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def next_micro_batches(run) -> list[dict]:
    """The next global batch from the sampler, split into ``accum`` collated micro-batches."""
    cfg = run.config
    docs = [run.corpus.train[i] for i in run.sampler.next_indices()]
    size = len(docs) // cfg.train.accum
    return [
        {k: v.to(cfg.train.device) for k, v in
         collate(docs[i : i + size], run.tokenizer.pad_id, cfg.data.pad_side).items()}
        for i in range(0, len(docs), size)
    ]


def forward_loss(model, batch: dict, num_targets: float, precision: str) -> torch.Tensor:
    """Autocast forward of one micro-batch; its share of the window's token-mean loss."""
    with autocast_context(precision, batch["input_ids"].device.type):
        logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    return lm_loss(logits, batch["labels"], num_targets)


def clip_gradients(model, optimizer, scaler, max_norm: float) -> float:
    """Unscale the gradients in place, then clip them to ``max_norm`` (0: no clipping).

    Returns the global norm before clipping, of the true (unscaled) gradients.
    """
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    return float(norm)


def optimizer_step(optimizer, scaler, scheduler) -> bool:
    """Step through the scaler, update the scale, advance the schedule, clear gradients.

    Returns True when the scaler skipped the update (inf/NaN gradients; its scale then shrinks).
    """
    scale_before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return scaler.get_scale() < scale_before


def train_step(run, micro_batches: list[dict]) -> StepRecord:
    """One optimizer step over an accumulation window of micro-batches (this rank's share of it)."""
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


def train(run, until: int | None = None, on_step=None) -> list[StepRecord]:
    """Train until ``run.step == until`` (default: the configured number of steps).

    ``on_step(run, record)`` is called after every step. Returns this call's step records.
    """
    until = run.config.train.steps if until is None else until
    run.model.train()
    records = []
    while run.step < until:
        record = train_step(run, next_micro_batches(run))
        records.append(record)
        if on_step is not None:
            on_step(run, record)
    return records
