"""What an optimizer step writes, in numbers (black-box track): ``optimizer.numerics.update-ratio`` and
``optimizer.numerics.state-precision``.

The update ratio of a param group at a step is ||w_after - w_before|| / ||w_before|| over the group's parameters
that hold a gradient (CS231n's "ratio of weight updates to weights"). It is what the optimizer actually did with
the gradients and the LR it was given: the LR, betas, eps, weight decay rule, moments, bias correction, loss
unscaling and clipping all shape it, so an optimizer that runs otherwise than the known-good runs' moves the
weights by another amount at the same step even where its reported LR and gradient norm agree with theirs. The
watch measures it on sampled steps from a fixed strided sample of each tensor (``SAMPLE`` elements at most: the
cost does not grow with the model), into ``StepRecord.updates``; ``faultbench.record_golden`` spans it per step.

- ``bb_golden_update``: a group's ratio more than ``FACTOR`` x outside the known-good runs' span at the same step,
  on ``MIN_STEPS`` sampled steps in a row, or on the first step after a resume (where the optimizer's state must
  carry the run on exactly as it was: a lost or mis-restored state shows in the first update).
- ``bb_state_precision``: every floating tensor of the optimizer's state is at least fp32 (moments and master
  weights in fp16/bf16 lose the small updates: Micikevicius et al. 2018, sec. 3.1).
"""

from __future__ import annotations

import math

import torch

from faultbench.detectors.api import NotApplicable, register
from faultbench.detectors.blackbox.api import BlackBoxDetector, StepRecord, WatchContext, local_shard

SAMPLE = 256  # elements read per tensor for the update ratio


def stepped_groups(optimizer) -> list[list[torch.Tensor]]:
    """Per param group, its parameters that hold a gradient (what the coming step may update)."""
    return [[p for p in g["params"] if p.grad is not None] for g in optimizer.param_groups]


class WeightSampler:
    """Per group of parameters, an fp32 copy of a fixed strided sample of them (``SAMPLE`` elements per tensor at
    most, the same elements on every call), None for an empty group. The strided views are made once and kept
    while the groups hold the same tensors in the same storage (a step costs one copy per group, not a view per
    tensor)."""

    def __init__(self) -> None:
        self._key: list | None = None
        self._views: list[list[torch.Tensor]] = []

    def sample(self, groups: list[list[torch.Tensor]]) -> list[torch.Tensor | None]:
        key = [[(id(p), p.data_ptr()) for p in params] for params in groups]
        if key != self._key:
            self._key = key
            self._views = [[_strided(p) for p in params] for params in groups]
        return [torch.cat(views).float() if views else None for views in self._views]

    def ratios(self, groups: list[list[torch.Tensor]], before: list[torch.Tensor | None]) -> list[float | None]:
        """Per group, ||after - before|| / ||before|| over the sample ``sample`` took before the step (None for an
        empty group or weights of norm 0)."""
        out = []
        for b, a in zip(before, self.sample(groups), strict=True):
            norm = float(torch.linalg.vector_norm(b)) if b is not None else 0.0
            out.append(float(torch.linalg.vector_norm(a - b)) / norm if norm > 0 and math.isfinite(norm) else None)
        return out


def _strided(p: torch.Tensor) -> torch.Tensor:
    flat = local_shard(p).reshape(-1)
    return flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE]


@register
class GoldenUpdate(BlackBoxDetector):
    """See the module's docstring: update ratios against the known-good runs' at the same steps."""

    id = "bb_golden_update"
    against_golden = True
    family = "optimizer"
    description = "the optimizer's update/weight ratio per group vs the known-good runs' at the same steps"
    FACTOR = 2.0  # outside [lo / FACTOR, hi x FACTOR]: seeds and data order move a healthy ratio far less
    MIN_STEPS = 3

    def on_start(self, ctx: WatchContext) -> None:
        if not any(s.get("updates") for s in (ctx.golden or {}).get("steps") or []):
            raise NotApplicable("no golden envelope with the update ratio per step (faultbench.record_golden)")

    def _outside(self, ctx: WatchContext, record: StepRecord) -> dict | None:
        steps = ctx.golden["steps"]
        index = record.step - 1
        if record.skipped or not record.updates or index >= len(steps) or not steps[index].get("updates"):
            return None
        for group, (ratio, span) in enumerate(zip(record.updates, steps[index]["updates"], strict=False)):
            if ratio is None or not span or not math.isfinite(ratio):
                continue
            lo, hi = span
            if ratio > hi * self.FACTOR or ratio < lo / self.FACTOR:
                # where the known-good runs did not move the weights (a step at LR 0), any move is infinitely more
                times = (ratio / hi if hi > 0 else math.inf) if ratio > hi else ratio / lo
                return {"step": record.step, "group": group, "ratio": ratio, "golden": [lo, hi], "times": times}
        return None

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        if not record.sampled or ctx.scaler_enabled and ctx.skipped_steps:  # skips shift the steps off the golden's
            return
        if ctx.start_step and record.step == ctx.start_step + 1:
            hit = self._outside(ctx, record)
            if hit:
                self.report_once("resume", ctx, "checkpoint", "optimizer",
                                 f"the first update after the resume at step {ctx.start_step} moved param group "
                                 f"{hit['group']}'s weights by {hit['ratio']:.3g} of their norm where the known-good "
                                 f"runs moved them by {hit['golden'][0]:.3g}-{hit['golden'][1]:.3g} at that step: "
                                 "the optimizer does not carry on from its saved state (moments, step count or "
                                 "hyperparameters lost or mis-restored at the load)", hit, confidence=0.6)
                return
        hits = self.tally("outside", self._outside(ctx, record), self.MIN_STEPS, in_a_row=True)
        if hits:
            first = hits[0]
            self.report_once("outside", ctx, "optimizer", "optimizer",
                             f"from step {first['step']} the optimizer moved param group {first['group']}'s weights "
                             f"by {first['ratio']:.3g} of their norm per step ({_times(first['times'])} the known-good "
                             f"runs' {first['golden'][0]:.3g}-{first['golden'][1]:.3g} at the same steps), "
                             f"{self.MIN_STEPS} sampled steps in a row: the update rule runs otherwise than declared "
                             "(its LR, betas, eps, decay or moments are not the ones reported)",
                             {"steps": hits[:5]}, confidence=0.45)


def _times(times: float) -> str:
    return f"{times:.2g} x" if math.isfinite(times) else "where nothing moved in"


_LOW = (torch.float16, torch.bfloat16)


@register
class StatePrecision(BlackBoxDetector):
    """Every floating tensor of the optimizer's state is fp32 or wider, checked once after the first step
    (exact: the dtype is what it is)."""

    id = "bb_state_precision"
    family = "precision"
    description = "optimizer moments and master weights kept in fp16/bf16"

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        self.retire("on_after_step")
        low = {}
        for state in ctx.optimizer.state.values():
            for key, value in (state.items() if isinstance(state, dict) else ()):
                if isinstance(value, torch.Tensor) and value.dtype in _LOW and value.numel() > 1:
                    low.setdefault(key, str(value.dtype).removeprefix("torch."))
        if low:
            self.report(ctx, "precision", "optimizer",
                        "the optimizer keeps its state in low precision (" +
                        ", ".join(f"{k}: {d}" for k, d in low.items()) + "): updates smaller than the state's "
                        "resolution are lost, so training stalls or drifts; moments and master weights belong in "
                        "fp32", {"state": low}, confidence=0.7)
