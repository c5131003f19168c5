"""Step capture for repro bundles: a target's runner that ``captures`` keeps every step's state and batch here
(``harness.bundle`` makes a bundle of the step a finding names)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class StepCapture:
    """Keeps, on disk under ``directory``, the state of one rank before every step (and at the end of
    training) and every step's batch, numbered in the order they happen: a resume may repeat or skip a
    step number, the order never does."""

    def __init__(self, directory: Path, rank: int):
        self.dir = Path(directory) / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def state(self, run) -> None:
        from faultbench.model.checkpoint import capture_rng_state

        self.count += 1
        optimizer = getattr(run.optimizer, "optim", run.optimizer)  # ZeRO: this rank's shard (no collective)
        torch.save({"step": run.step, "model": run.model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
                    "rng": capture_rng_state()}, self.dir / f"state-{self.count:04d}.pt")
        with open(self.dir / "index.jsonl", "a") as f:
            f.write(json.dumps({"capture": self.count, "step": run.step}) + "\n")

    def batch(self, step: int, micro_batches: list[dict]) -> None:
        torch.save(micro_batches, self.dir / f"batch-{self.count:04d}.pt")
