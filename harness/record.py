"""A bench case and its record: the types the harness and every target's runner share.

A ``Case`` names a recipe of a target, the faults injected (none: clean), a seed and the detectors; its
record is a JSON-able dict (``empty_record``'s keys) that the target's ``run_case`` fills and the scorer reads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from faultbench import targets


@dataclass(frozen=True)
class Case:
    """A recipe of a target (``targets.get``), the faults injected (none: clean), a seed, the detectors."""

    recipe: str
    seed: int
    faults: tuple[str, ...] = ()
    detectors: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    target: str = "ref"

    @property
    def name(self) -> str:
        """``fault/recipe/sSEED`` on the reference, ``target:fault/recipe/sSEED`` on another target."""
        prefix = "" if self.target == "ref" else f"{self.target}:"
        return f"{prefix}{'+'.join(self.faults) or 'clean'}/{self.recipe}/s{self.seed}"

    @property
    def world_size(self) -> int:
        return targets.get(self.target).recipes()[self.recipe].world_size

    def to_dict(self) -> dict:
        return {"target": self.target, "recipe": self.recipe, "seed": self.seed, "faults": list(self.faults),
                "detectors": list(self.detectors), "plugins": list(self.plugins)}


def case_from_dict(d: dict) -> Case:
    return Case(d["recipe"], d["seed"], tuple(d["faults"]), tuple(d["detectors"]), tuple(d["plugins"]),
                d.get("target", "ref"))  # a record or bundle from before targets is the reference's


def empty_record(case: Case, rank: int = 0) -> dict:
    """A case record before anything ran: no history, no findings, no crash."""
    return {"case": case.to_dict(), "rank": rank, "history": [], "crash": None, "val_loss": None, "train_s": 0.0,
            "wall_s": 0.0, "resumed_at": None, "findings": [], "detector_errors": {}, "step_seconds": {},
            "other_seconds": {}, "summaries": {}, "outputs": {"positions": 0}}


def failed_record(case: Case, kind: str, message: str) -> dict:
    """The record of a case whose process failed outside the run (a hang, a dead worker, a rank failure)."""
    return {**empty_record(case), "hang": kind == "Hang",
            "crash": {"type": kind, "message": message[:500], "step": None, "frames": [], "traceback": ""}}


def final_state(run) -> dict:
    """What the run left behind: a sha1 of its parameters, and how many of its step records still hold an
    autograd graph (a kept graph changes no number, only memory)."""
    digest = hashlib.sha1()
    for p in run.model.parameters():
        digest.update(p.detach().cpu().float().numpy().tobytes())
    held = sum(any(isinstance(v, torch.Tensor) and v.grad_fn is not None for v in vars(rec).values())
               for rec in run.history)
    return {"params": digest.hexdigest(), "graphs_held": held}

