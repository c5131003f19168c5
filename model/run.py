"""A run: every component of one training job, built from a ``RunConfig`` with deterministic seeding."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import RunConfig
from .data import Corpus, load_corpus
from .distributed import rank_seed, world_size, wrap_model
from .gpt import GPT
from .optim import configure_optimizer, make_scheduler
from .precision import make_grad_scaler
from .sampler import ResumableSampler
from .tokenizer import Tokenizer


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
    train_model: torch.nn.Module  # what the training step calls: the DDP wrapper, or the model itself
    rank: int = 0
    world_size: int = 1
    step: int = 0  # optimizer steps taken
    history: list = field(default_factory=list)  # StepRecord per step

    @property
    def tokenizer(self) -> Tokenizer:
        return self.corpus.tokenizer


def build_run(cfg: RunConfig, rank: int = 0) -> Run:
    """Corpus, tokenizer, model, optimizer, schedule, scaler and sampler of a fresh run.

    With ``cfg.train.world_size > 1`` the process group must already be initialized: the model is
    DDP-wrapped and the sampler hands this rank its shard of every global batch.
    """
    size = cfg.train.world_size
    if size > 1 and world_size() != size:
        raise ValueError(
            f"config asks for world_size={size} but this process is in a group of {world_size()}; "
            "start every rank in an initialized process group (e.g. with torchrun)"
        )
    corpus = load_corpus(cfg.data)
    if corpus.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {corpus.tokenizer.vocab_size} tokens but the model embeds only "
            f"{cfg.model.vocab_size}; raise model.vocab_size"
        )
    seed_everything(cfg.seed)  # the same initial weights on every rank
    model = GPT(cfg.model).to(cfg.train.device)
    train_model = wrap_model(model, cfg.train.device)
    optimizer = configure_optimizer(model, cfg.train)
    device_type = torch.device(cfg.train.device).type
    run = Run(
        config=cfg,
        corpus=corpus,
        model=model,
        optimizer=optimizer,
        scheduler=make_scheduler(optimizer, cfg.train),
        scaler=make_grad_scaler(cfg.train.precision, device_type, cfg.train.init_scale),
        sampler=ResumableSampler(len(corpus.train), cfg.train.batch_size, cfg.seed, rank, size),
        train_model=train_model,
        rank=rank,
        world_size=size,
    )
    seed_everything(rank_seed(cfg.seed, rank))  # rank-local randomness (dropout) differs across ranks
    return run
