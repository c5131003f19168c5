"""The seams of the reference: its small named functions and methods, each with its subsystem.

A seam's qualified name (``module.function`` or ``module.Class.method``) is its location. This
table is the localization vocabulary: a diagnosis names a subsystem and, ideally, a seam.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass

SUBSYSTEMS = (
    "data", "collate", "mask", "position", "model", "loss",
    "optimizer", "precision", "checkpoint", "distributed", "eval",
)

SEAMS: dict[str, str] = {
    # data: corpus, tokenizer, sampler, truncation
    "model.corpus.MarkovSource.sample": "data",
    "model.tokenizer.train_tokenizer": "data",
    "model.tokenizer.Tokenizer.encode": "data",
    "model.tokenizer.Tokenizer.encode_batch": "data",
    "model.tokenizer.Tokenizer.decode": "data",
    "model.data.truncate": "data",
    "model.data.load_corpus": "data",
    "model.sampler.ResumableSampler.next_indices": "data",
    "model.train.next_micro_batches": "data",
    # collate: padding, attention_mask, labels
    "model.data.collate": "collate",
    # mask: causal and padding masks
    "model.attention.build_attention_mask": "mask",
    # position: position ids, RoPE, cache offsets
    "model.rope.position_ids_from_mask": "position",
    "model.rope.rope_tables": "position",
    "model.rope.rope_at": "position",
    "model.rope.apply_rope": "position",
    # model: forward, init, tying, dropout, attention math, KV cache
    "model.attention.attend": "model",
    "model.attention.CausalSelfAttention.forward": "model",
    "model.gpt.MLP.forward": "model",
    "model.gpt.Block.forward": "model",
    "model.gpt.GPT.init_weights": "model",
    "model.gpt.GPT.forward": "model",
    "model.gpt.GPT.generate": "model",
    "model.gpt.KVCache.update": "model",
    # loss: shift, ignore_index, reduction, accumulation normalization
    "model.loss.count_targets": "loss",
    "model.loss.lm_loss": "loss",
    "model.train.forward_loss": "loss",
    # optimizer: AdamW groups, LR schedule, clipping, zero_grad, step order
    "model.optim.configure_optimizer": "optimizer",
    "model.optim.lr_at": "optimizer",
    "model.optim.make_scheduler": "optimizer",
    "model.train.clip_gradients": "optimizer",
    "model.train.optimizer_step": "optimizer",
    "model.train.train_step": "optimizer",
    # precision: autocast, GradScaler, dtypes
    "model.precision.autocast_context": "precision",
    "model.precision.make_grad_scaler": "precision",
    # checkpoint: save/resume state
    "model.checkpoint.capture_rng_state": "checkpoint",
    "model.checkpoint.restore_rng_state": "checkpoint",
    "model.checkpoint.save_checkpoint": "checkpoint",
    "model.checkpoint.load_checkpoint": "checkpoint",
    # distributed: DDP, ZeRO, per-rank seeding, gradient sync
    "model.distributed.rank_seed": "distributed",
    "model.distributed.wrap_model": "distributed",
    "model.distributed.average_gradients_hook": "distributed",
    "model.distributed.grad_sync_context": "distributed",
    "model.distributed.global_target_count": "distributed",
    "model.distributed.mean_over_ranks": "distributed",
    # eval: eval loop, metrics, splits
    "model.corpus.split_of": "eval",
    "model.evaluate.evaluate": "eval",
}


@dataclass(frozen=True)
class Seam:
    name: str
    subsystem: str
    file: str  # path relative to the repository root
    line: int

    def to_dict(self) -> dict:
        return {"name": self.name, "subsystem": self.subsystem, "file": self.file, "line": self.line}


# the package this one is installed under (the project's namespace); empty where ``model`` is a top-level copy
_HOME = __package__.rpartition(".")[0]


def live_module(name: str) -> str:
    """The importable name of a module a seam names. Seams keep their logical names (``model.data``,
    ``targets.hf.data``), whose packages are installed under the home package (``<home>.model.data``);
    another stack's modules (``transformers.trainer``) and a top-level copy's are importable as named."""
    return f"{_HOME}.{name}" if _HOME and _is_home_package(name.partition(".")[0]) else name


@functools.cache
def _is_home_package(head: str) -> bool:
    return importlib.util.find_spec(f"{_HOME}.{head}") is not None


def resolve(name: str):
    """The function object a seam name designates (raises ``ValueError`` for an unknown name)."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):  # longest importable module prefix
        module_name, attr_path = ".".join(parts[:split]), parts[split:]
        try:
            obj = importlib.import_module(live_module(module_name))
        except ModuleNotFoundError:
            continue
        try:
            for attr in attr_path:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise ValueError(f"{name!r} does not name a function of the reference")


def seams() -> list[Seam]:
    """Every seam with its subsystem and its definition's file:line, in table order."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = []
    for name, subsystem in SEAMS.items():
        fn = inspect.unwrap(resolve(name))
        _, line = inspect.getsourcelines(fn)
        out.append(Seam(name, subsystem, os.path.relpath(inspect.getsourcefile(fn), root), line))
    return out
