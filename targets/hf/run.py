"""A run of the HF target: the tokenizer, the seeded model and a ``Trainer`` configured from a recipe.

``build_run`` is everything an HF user writes before ``trainer.train()``; ``HFRun`` exposes the live
components under the names the reference's run uses (model, train_model, optimizer, scheduler, scaler,
tokenizer, config, history, rank, world_size, step), which is what a detector's ``ctx.run`` holds.
The optimizer and scheduler exist once ``trainer.train()`` has begun (Trainer creates them there).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DataCollatorForLanguageModeling, PrinterCallback, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

from faultbench.targets.hf.data import TextDataset, Texts, load_texts, wrap_tokenizer
from faultbench.targets.hf.distributed import rank_environment, set_environment
from faultbench.targets.hf.modeling import build_model
from faultbench.targets.hf.recipes import Recipe

EVAL_DOCS = 128  # validation documents of a case's end-of-run evaluation (one batch: an exact token mean)

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()  # Trainer's per-run info lines cost time and say nothing a record lacks
logging.getLogger("accelerate").setLevel(logging.ERROR)


class StepTrainer(Trainer):
    """``Trainer`` that hands each optimizer step's micro-batches to ``on_batches`` before the step."""

    on_batches = None  # callable(list of micro-batch dicts) or None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.on_batches is not None and samples:
            self.on_batches(samples)
        return samples, num_items


@dataclass
class HFRun:
    config: Recipe
    seed: int
    texts: Texts
    tokenizer: object  # PreTrainedTokenizerFast
    model: torch.nn.Module  # the LlamaForCausalLM (unwrapped)
    trainer: StepTrainer
    rank: int = 0
    world_size: int = 1
    history: list = field(default_factory=list)  # model.train.StepRecord per optimizer step

    @property
    def optimizer(self):
        return self.trainer.optimizer  # accelerate's AcceleratedOptimizer around torch's AdamW

    @property
    def scheduler(self):
        return self.trainer.lr_scheduler

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """accelerate's GradScaler, or a disabled one (scale 1.0) where it uses none (every CPU run)."""
        return self.trainer.accelerator.scaler or _NO_SCALER

    @property
    def train_model(self) -> torch.nn.Module:
        return self.trainer.model_wrapped  # the DDP wrapper under DDP

    @property
    def step(self) -> int:
        return self.trainer.state.global_step

    @property
    def loss_floor(self) -> float:
        return self.texts.loss_floor

    # the general facts a detector's context reads (``detectors.api.FACTS``)
    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def precision(self) -> str:
        return self.config.precision

    @property
    def pad_side(self) -> str:
        return self.tokenizer.padding_side

    @property
    def accum(self) -> int:
        return self.config.accum

    @property
    def device(self) -> str:
        return str(self.model.device)

    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_token_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def unk_id(self) -> int:
        return self.tokenizer.unk_token_id

    @property
    def seq_len(self) -> int:
        return self.tokenizer.model_max_length

    @property
    def weight_decay(self) -> float:
        return self.trainer.args.weight_decay

    @property
    def head_dim(self) -> int:
        return self.model.config.head_dim

    @property
    def max_positions(self) -> int:
        return self.model.config.max_position_embeddings

    @property
    def steps(self) -> int:
        return self.trainer.args.max_steps

    def lr_schedule(self, step: int) -> float:
        """The LR ``TrainingArguments`` declare for optimizer step ``step`` (0-based), by the documented semantics of
        ``lr_scheduler_type="cosine"``: linear warmup from 0 over ``warmup_steps``, then a half cosine to 0 at
        ``max_steps``."""
        args = self.trainer.args
        if step < args.warmup_steps:
            return args.learning_rate * step / max(1, args.warmup_steps)
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return args.learning_rate * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    @property
    def grad_clip(self) -> float:
        return self.trainer.args.max_grad_norm

    @property
    def lr(self) -> float:
        return self.trainer.args.learning_rate

    @property
    def betas(self) -> tuple[float, float]:
        return self.trainer.args.adam_beta1, self.trainer.args.adam_beta2

    @property
    def eps(self) -> float:
        return self.trainer.args.adam_epsilon

    @functools.cached_property
    def train_docs(self) -> list[list[int]]:
        """The first ``FACT_DOCS`` training documents as the dataset tokenizes them."""
        return _tokenized(self.trainer.train_dataset)

    @functools.cached_property
    def val_docs(self) -> list[list[int]]:
        return _tokenized(self.trainer.eval_dataset)


FACT_DOCS = 2000  # documents a detector reads of a split (tokenizing them all would cost seconds)


def _tokenized(dataset) -> list[list[int]]:
    return [dataset[i]["input_ids"] for i in range(min(len(dataset), FACT_DOCS))]


_NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)


def training_arguments(recipe: Recipe, seed: int, output_dir: Path) -> TrainingArguments:
    """The recipe as ``TrainingArguments``: AdamW with Trainer's no-decay groups, cosine with warmup,
    clipping, logging every step (the step records), no saving unless the case asks for a checkpoint."""
    return TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, seed=seed, max_steps=recipe.steps,
        per_device_train_batch_size=recipe.micro_batch_size, gradient_accumulation_steps=recipe.accum,
        per_device_eval_batch_size=EVAL_DOCS, learning_rate=recipe.lr, warmup_steps=recipe.warmup_steps,
        lr_scheduler_type="cosine", weight_decay=recipe.weight_decay, max_grad_norm=recipe.max_grad_norm,
        bf16=recipe.precision == "bf16", logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", dataloader_num_workers=0, disable_tqdm=True, ddp_backend="gloo" if recipe.world_size > 1
        else None, ddp_find_unused_parameters=False, log_level="error",
    )


def build_run(recipe: Recipe, seed: int, output_dir: str | Path, rank: int = 0) -> HFRun:
    """Tokenizer, datasets, seeded model (the same on every rank) and a Trainer writing to ``output_dir``.

    With ``recipe.world_size > 1`` this process must be one rank of an initialized process group.
    """
    set_environment(rank_environment(recipe.world_size))
    texts = load_texts(recipe.data)
    tokenizer = wrap_tokenizer(texts.tokenizer_json, recipe.data.seq_len, recipe.padding_side)
    model = build_model(recipe.model, tokenizer, seed)
    trainer = StepTrainer(
        model=model, args=training_arguments(recipe, seed, Path(output_dir)),
        train_dataset=TextDataset(texts.train, tokenizer), eval_dataset=TextDataset(texts.val[:EVAL_DOCS], tokenizer),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)  # the logs reach the step records; printing them costs time
    return HFRun(recipe, seed, texts, tokenizer, model, trainer, rank, recipe.world_size)


def evaluate(run: HFRun) -> float:
    """Mean next-token cross-entropy (nats per predicted token) on the first ``EVAL_DOCS`` val documents."""
    return float(run.trainer.evaluate()["eval_loss"])
