"""Checkpoints: everything a run needs to continue exactly as if it had never stopped.

A checkpoint is a directory holding ``state.pt`` (model, optimizer, scheduler, scaler, sampler,
step, step history, Python/NumPy/torch RNG states of every rank) and ``meta.json`` (format, step, the sha256 of
``state.pt``, the run config and the tokenizer's sha256). It is written to a temporary directory
and renamed into place, so a crash mid-save never leaves a half-written checkpoint under the
target name. Loading verifies the hash, the config and the tokenizer before touching the run, and
reads ``state.pt`` with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .train import StepRecord

FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupted, or belongs to another run."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def capture_rng_state() -> dict:
    """The global RNG states as tensors and plain Python values (loadable with weights_only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "cached_gaussian": cached},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _gather_rng_states(run) -> list[dict]:
    """Every rank's RNG state, in rank order (each rank draws its own dropout masks)."""
    state = capture_rng_state()
    if run.world_size == 1:
        return [state]
    states = [None] * run.world_size
    dist.all_gather_object(states, state)
    return states


def save_checkpoint(run, directory) -> Path:
    """Write the run's full state to ``directory`` atomically; returns the directory.

    Under DDP every rank must call it: ZeRO's sharded optimizer state is consolidated on rank 0, the
    RNG states of all ranks are gathered, and rank 0 alone writes.
    """
    directory = Path(directory)
    if hasattr(run.optimizer, "consolidate_state_dict"):  # ZeRO: each rank holds one shard
        run.optimizer.consolidate_state_dict(to=0)
    rng_states = _gather_rng_states(run)
    if run.rank == 0:
        _write_checkpoint(run, directory, rng_states)
    if run.world_size > 1:
        dist.barrier()  # no rank goes on (and maybe loads) before the checkpoint exists
    return directory


def _write_checkpoint(run, directory: Path, rng_states: list[dict]) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "sampler": run.sampler.state_dict(),
        "step": run.step,
        "history": [r.to_dict() for r in run.history],
        "rng": rng_states,
    }
    torch.save(state, tmp / "state.pt")
    meta = {
        "format": FORMAT,
        "step": run.step,
        "world_size": run.world_size,
        "sha256": _sha256(tmp / "state.pt"),
        "config": run.config.to_dict(),
        "tokenizer_sha256": run.tokenizer.sha256,
        "torch_version": torch.__version__,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)


def read_meta(directory) -> dict:
    path = Path(directory) / "meta.json"
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {directory}: {path.name} is missing")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from e
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror})") from e
    wrong = [k for k, kind in META_FIELDS.items() if not isinstance(meta, dict) or not isinstance(meta.get(k), kind)]
    if wrong:
        raise CheckpointError(f"{path} lacks (or mistypes) {', '.join(wrong)}: not a checkpoint's meta.json")
    return meta


META_FIELDS = {"format": int, "sha256": str, "config": dict, "tokenizer_sha256": str}


def _config_mismatch(saved: dict, current: dict, prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _config_mismatch(a, b, f"{prefix}{key}.")
        elif a != b and not (isinstance(a, list) and tuple(a) == b):
            diffs.append(f"{prefix}{key}: checkpoint {a!r} vs run {b!r}")
    return diffs


def load_checkpoint(run, directory) -> None:
    """Restore the run's full state from ``directory``; raises ``CheckpointError`` on any mismatch.

    Under DDP every rank loads the same file and takes its own RNG state from it.
    """
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
    run.step = state["step"]
    run.history = [StepRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in state["history"]]
    restore_rng_state(state["rng"][run.rank])
