"""A seeded, resumable sampler of global batches, sharded across ranks.

Every epoch is a fresh permutation of the dataset derived from (seed, epoch) alone, so the sampler's
whole state is two integers: the epoch and how many global batches of it were consumed. Each rank
takes a disjoint contiguous slice of every global batch; the last incomplete batch of an epoch is
dropped so every step sees exactly ``global_batch`` documents.
"""

from __future__ import annotations

import numpy as np


class ResumableSampler:
    def __init__(self, num_items: int, global_batch: int, seed: int, rank: int = 0, world_size: int = 1):
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by world_size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if num_items < global_batch:
            raise ValueError(f"dataset of {num_items} items is smaller than one global batch ({global_batch})")
        self.num_items, self.global_batch, self.seed = num_items, global_batch, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_items // self.global_batch

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch (a new shuffle)."""
        self.epoch, self.position = epoch, 0
        self._order = self._permutation(epoch)

    def next_indices(self) -> list[int]:
        """This rank's dataset indices for the next global batch; rolls over to the next epoch."""
        if self.position == self.batches_per_epoch:
            self.set_epoch(self.epoch + 1)
        per_rank = self.global_batch // self.world_size
        start = self.position * self.global_batch + self.rank * per_rank
        self.position += 1
        return self._order[start : start + per_rank].tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_items": self.num_items}

    def load_state_dict(self, state: dict) -> None:
        if (state["seed"], state["num_items"]) != (self.seed, self.num_items):
            raise ValueError(
                f"sampler state is for seed={state['seed']}, {state['num_items']} items; this sampler has "
                f"seed={self.seed}, {self.num_items} items"
            )
        self.set_epoch(state["epoch"])
        self.position = state["position"]
