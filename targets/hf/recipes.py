"""The HF target's clean matrix: small recipes named like the reference's where the variant applies.

Not here: ``fp16`` (accelerate 1.15 accepts ``fp16=True`` on CPU but runs it with neither autocast nor
a GradScaler: ``Accelerator.native_amp`` is False off-GPU, so the run is fp32 under another name) and
``zero`` (Trainer shards optimizer state only through DeepSpeed/FSDP, not installed).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from faultbench.model.config import DataConfig, get_preset
from faultbench.model.corpus import SMALL_EPOCH, train_doc_count
from faultbench.targets.hf.modeling import ModelSpec


@dataclass(frozen=True)
class Recipe:
    """One clean variant: what the ``TrainingArguments``, the tokenizer and the model config get."""

    name: str
    steps: int = 16
    batch_size: int = 16  # documents per optimizer step, over every rank and micro-batch
    accum: int = 1  # gradient_accumulation_steps
    world_size: int = 1
    precision: str = "fp32"  # "fp32" | "bf16"
    padding_side: str = "right"
    resume_at: int | None = None  # save at this step, then resume a fresh Trainer from the checkpoint
    lr: float = 3e-3
    warmup_steps: int = 8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataConfig = field(default_factory=lambda: get_preset("tiny").data)

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be 'fp32' or 'bf16' on CPU, got {self.precision!r}")
        if self.batch_size % (self.accum * self.world_size):
            raise ValueError(f"batch_size={self.batch_size} must be divisible by accum x world_size")
        if self.resume_at is not None and not 0 < self.resume_at < self.steps:
            raise ValueError(f"resume_at must be in (0, steps={self.steps}), got {self.resume_at}")

    @property
    def micro_batch_size(self) -> int:
        """per_device_train_batch_size: documents per forward on one rank."""
        return self.batch_size // (self.accum * self.world_size)

    @property
    def crosses_epoch(self) -> bool:
        """Whether the run takes more optimizer steps than one epoch of its training split holds (the sampler then
        reshuffles: ``set_epoch``); the epoch's last, short batch is a step of its own (Trainer keeps it)."""
        return self.steps > -(-train_doc_count(self.data) // self.batch_size)


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("fp32"),
    Recipe("bf16", precision="bf16"),
    Recipe("left_pad", padding_side="left"),
    Recipe("accum", accum=4),
    Recipe("resume", resume_at=8, model=ModelSpec(attention_dropout=0.1)),  # dropout: the RNG state matters
    Recipe("eager", model=ModelSpec(attn_implementation="eager")),  # the eager attention and mask path
    Recipe("ddp", accum=2, world_size=2),
    # what real runs combine, and where bugs of the combination live: bf16 autocast, left padding, the eager
    # attention and its additive mask, accumulation, attention dropout, a resume mid-run and, as in the
    # reference's combined recipe, the small corpus: its 143 training documents make an epoch of 9 steps (the
    # last one short), so the sampler reshuffles after the resume
    Recipe("combined", steps=12, accum=2, precision="bf16", padding_side="left", resume_at=6,
           model=ModelSpec(attention_dropout=0.1, attn_implementation="eager"),
           data=replace(get_preset("tiny").data, **SMALL_EPOCH)),
)}


def scenario_recipe(variant: dict, steps: int, world_size: int = 1) -> Recipe:
    """The ``fp32`` recipe (or ``variant["recipe"]``) with ``variant``'s fields, ``steps`` and ``world_size``."""
    fields = dict(variant)
    base = RECIPES[fields.pop("recipe", "fp32")]
    model, data = fields.pop("model", {}), fields.pop("data", {})
    recipe = replace(base, steps=steps, warmup_steps=min(base.warmup_steps, steps), world_size=world_size,
                     model=replace(base.model, **model), data=replace(base.data, **data), **fields)
    if world_size > 1 and recipe.accum == 1:  # the DDP recipe's shape: accumulation under no_sync too
        recipe = replace(recipe, accum=2)
    return recipe
