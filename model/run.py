"""A run: every component of one training job, built from a ``RunConfig`` with deterministic seeding."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from model.config import RunConfig
from model.data import Corpus, load_corpus
from model.gpt import GPT
from model.optim import configure_optimizer, make_scheduler
from model.precision import make_grad_scaler
from model.sampler import ResumableSampler
from model.tokenizer import Tokenizer


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (model init and dropout use torch's)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Run:
    config: RunConfig
    corpus: Corpus
    model: GPT
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: ResumableSampler
    step: int = 0  # optimizer steps taken
    history: list = field(default_factory=list)  # StepRecord per step

    @property
    def tokenizer(self) -> Tokenizer:
        return self.corpus.tokenizer


def build_run(cfg: RunConfig, rank: int = 0, world_size: int = 1) -> Run:
    """Corpus, tokenizer, model, optimizer, schedule, scaler and sampler of a fresh run."""
    corpus = load_corpus(cfg.data)
    if corpus.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {corpus.tokenizer.vocab_size} tokens but the model embeds only "
            f"{cfg.model.vocab_size}; raise model.vocab_size"
        )
    seed_everything(cfg.seed)
    model = GPT(cfg.model).to(cfg.train.device)
    optimizer = configure_optimizer(model, cfg.train)
    device_type = torch.device(cfg.train.device).type
    return Run(
        config=cfg,
        corpus=corpus,
        model=model,
        optimizer=optimizer,
        scheduler=make_scheduler(optimizer, cfg.train),
        scaler=make_grad_scaler(cfg.train.precision, device_type, cfg.train.init_scale),
        sampler=ResumableSampler(len(corpus.train), cfg.train.batch_size, cfg.seed, rank, world_size),
    )
