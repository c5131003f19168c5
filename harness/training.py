"""Training the clean reference: one flow for a single process, a pool rank, or a torchrun rank."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from faultbench.model.checkpoint import CheckpointError, load_checkpoint, read_meta, save_checkpoint
from faultbench.model.config import RunConfig
from faultbench.model.evaluate import evaluate
from faultbench.model.run import build_run
from faultbench.model.train import train

STATE_FIELDS = ("model", "optimizer", "scheduler", "scaler", "sampler", "step", "history", "rng")


def check_resumable(directory) -> None:
    """A checkpoint folder ``load_checkpoint`` can restore a run from: its meta.json (``read_meta``'s checks) and
    a state.pt file holding every part of a training state; else ``CheckpointError`` naming what is wrong (a list,
    a dict without the model, a folder: tracebacks before, even with meta.json's sha256 updated to match)."""
    read_meta(directory)
    path = Path(directory) / "state.pt"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no state.pt file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: torch raises pickle, zip and runtime errors
        raise CheckpointError(f"{path} cannot be loaded ({type(e).__name__})") from None
    missing = [k for k in STATE_FIELDS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: not a full training state")


def train_reference(cfg: RunConfig, rank: int = 0, until: int | None = None, save=None, resume=None,
                    log=None, log_every: int = 50, with_params: bool = False) -> dict:
    """Build, optionally resume, train, optionally save, evaluate; return a JSON-able summary.

    Under DDP every rank calls this (the process group already initialized); only rank 0 logs.
    ``with_params`` adds the final parameters (tensors) and the full step history, for comparisons.
    """
    start = time.perf_counter()
    if resume:
        check_resumable(resume)  # before the run is built: a bad checkpoint costs one line, not a traceback
    run = build_run(cfg, rank)
    if resume:
        load_checkpoint(run, resume)
    until = cfg.train.steps if until is None else until

    def progress(run, record):
        if record.step % log_every == 0 or run.step == until:
            print(f"step {record.step:5d}  loss {record.loss:.4f}  grad_norm {record.grad_norm:.3f}  "
                  f"lr {record.lr:.2e}  scale {record.scale:g}  {record.tokens_per_s:,.0f} tok/s", file=log)

    train_start = time.perf_counter()
    train(run, until, on_step=progress if log is not None and rank == 0 else None)
    train_s = time.perf_counter() - train_start
    if save:
        save_checkpoint(run, save)
    val_loss = evaluate(run.model, run.corpus.val, run.tokenizer.pad_id, cfg.train.eval_batch_size,
                        cfg.train.precision, cfg.data.pad_side)
    history = run.history
    summary = {
        "steps": run.step,
        "params": run.model.num_params(),
        "final_loss": history[-1].loss if history else None,
        "val_loss": val_loss,
        "loss_floor": run.corpus.loss_floor,
        "gap_to_floor": val_loss - run.corpus.loss_floor,
        "skipped_steps": sum(r.skipped for r in history),
        "tokens_per_s": sum(r.tokens for r in history) * run.world_size / max(sum(r.seconds for r in history), 1e-9),
        "train_s": train_s,
        "wall_s": time.perf_counter() - start,
        "precision": cfg.train.precision,
        "pad_side": cfg.data.pad_side,
        "accum": cfg.train.accum,
        "world_size": run.world_size,
        "zero": cfg.train.zero,
        "seed": cfg.seed,
    }
    if with_params:
        summary["history"] = [r.to_dict() for r in history]
        summary["state"] = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    return summary


def train_on_rank(rank: int, cfg_dict: dict, kwargs: dict) -> dict:
    """Pool entry point: ``train_reference`` on one rank (rank 0 logs to stderr when asked)."""
    log = sys.stderr if kwargs.pop("log", False) else None
    return train_reference(RunConfig.from_dict(cfg_dict), rank, log=log, **kwargs)
