"""The golden recorder: a member of a golden case's suite that keeps what a clean run looks like.

Its trace (``harness.golden.trace_of`` adds the step history) is what golden-envelope detectors compare to.
"""

from __future__ import annotations

import torch

from faultbench.detectors.api import Detector, RunContext


class GoldenRecorder(Detector):
    """Not a detector: records what a clean run looks like (it never reports)."""

    id = "golden_recorder"

    def __init__(self) -> None:
        super().__init__()
        self.trace: dict = {"activation_rms": {}, "grad_logits_l1": []}
        self._handles: list = []

    def summary(self) -> dict:
        return self.trace

    def on_start(self, ctx: RunContext) -> None:
        model = ctx.run.model
        shared: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            shared.setdefault(id(p), []).append(name)
        self.trace["structure"] = {
            "num_params": sum(p.numel() for p in model.parameters()),
            "shared": sorted(names for names in shared.values() if len(names) > 1),
            "shapes": {name: list(p.shape) for name, p in model.named_parameters()},
        }
        self.trace["param_rms"] = {name: float(p.detach().float().pow(2).mean().sqrt())
                                   for name, p in model.named_parameters()}
        self._handles = [m.register_forward_hook(self._activation(name)) for name, m in model.named_modules()]

    def _activation(self, name: str):
        def hook(module, args, output):
            if module.training and isinstance(output, torch.Tensor):
                self.trace["activation_rms"].setdefault(name or "<model>", float(output.detach().float().pow(2)
                                                                                 .mean().sqrt()))
        return hook

    def on_backward(self, ctx: RunContext, batch: dict, grad_logits: torch.Tensor) -> None:
        if len(self.trace["grad_logits_l1"]) < 4:
            self.trace["grad_logits_l1"].append(float(grad_logits.float().abs().sum(-1).max()))

    def on_after_step(self, ctx: RunContext, record) -> None:
        for h in self._handles:  # the first step's forwards are enough
            h.remove()
        self._handles = []

    def on_end(self, ctx: RunContext, metrics: dict) -> None:
        self.trace["val_loss"] = metrics["val_loss"]
