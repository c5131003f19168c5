"""A resumed run starts from the state its checkpoint saved (black-box track): ``checkpoint.accounting.complete``
and ``checkpoint.numerics.bitwise-roundtrip`` for the weights and the optimizer's state, ``head.state.tie-survives-
load`` for the model's layout (tied weights still one tensor, every dtype kept).

When the loop saves a checkpoint (it reads the model's state between steps: ``on_save``), ``bb_resume_state``
records a fingerprint of every parameter and of the optimizer's per-parameter state (float64 sum and sum of squares
of each tensor, its step counts) in ``ctx.saved_states[step]``. A segment resumed at that step (its watch handed the
segment before, ``watch(..., step=, previous=)``) compares: the weights at its first training forward, the
optimizer's state before its first step. A parameter or moment that differs beyond float64 summation's rounding was
not restored (a load skipped, a tensor left at its initial value, a dtype lost on the way). A checkpoint saved at
another step than the resumed one says nothing; so does a loop that saves nothing the watch sees.
"""

from __future__ import annotations

import math

import torch

from faultbench.detectors.api import NotApplicable, register
from faultbench.detectors.blackbox.api import BlackBoxDetector, WatchContext

REL_TOL = 1e-6  # float64 sums of the same float32 values agree far closer; a restored tensor is bit-exact


def _fingerprint(t: torch.Tensor) -> tuple[float, float]:
    x = t.detach().double()
    return float(x.sum()), float((x * x).sum())


def model_fingerprint(model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    return {name: _fingerprint(p) for name, p in model.named_parameters()}


def model_layout(model: torch.nn.Module) -> dict:
    """What a restore must keep besides values: each parameter's dtype, and which names share one tensor (tied
    weights; ``named_parameters`` lists a shared tensor once, so every name is read from the modules)."""
    names: dict[int, list[str]] = {}
    dtypes = {}
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            names.setdefault(id(p), []).append(full)
            dtypes[full] = str(p.dtype)
    return {"dtypes": dtypes, "tied": sorted(sorted(group) for group in names.values() if len(group) > 1)}


def optimizer_fingerprint(optimizer) -> dict[str, tuple[float, float]]:
    """{"<group>.<index>.<key>": fingerprint} of the optimizer's state per parameter, in param_groups order."""
    out = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.numel():
                    out[f"{g}.{i}.{key}"] = _fingerprint(value)
                elif isinstance(value, (int, float)):
                    out[f"{g}.{i}.{key}"] = (float(value), 0.0)
    return out


def differing(saved: dict, now: dict) -> list[tuple[str, float]]:
    """[(key, relative difference)] of the entries that are not restored (absent now, or other values)."""
    out = []
    for key, (s1, s2) in saved.items():
        if key not in now:
            out.append((key, math.inf))
            continue
        n1, n2 = now[key]
        gap = max(abs(s1 - n1) / max(abs(s1), math.sqrt(abs(s2)), 1e-12), abs(s2 - n2) / max(abs(s2), 1e-12))
        if gap > REL_TOL:
            out.append((key, gap))
    return out


@register
class ResumeState(BlackBoxDetector):
    id = "bb_resume_state"
    family = "checkpoint"
    description = "resumed loop: the weights and optimizer state are those its checkpoint saved at that step"

    def __init__(self) -> None:
        super().__init__()
        self._saved: dict | None = None
        self._weights_checked = False

    def on_save(self, ctx: WatchContext) -> None:
        ctx.saved_states.setdefault(ctx.step, {}).update(
            weights=model_fingerprint(ctx.model), optimizer=optimizer_fingerprint(ctx.optimizer),
            layout=model_layout(ctx.model))

    def on_start(self, ctx: WatchContext) -> None:
        prev = ctx.previous
        if ctx.start_step and prev is not None:
            self._saved = prev.saved_states.get(ctx.start_step)

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        if self._weights_checked or self._saved is None:
            return
        self._weights_checked = True
        saved, now = self._saved.get("layout"), model_layout(ctx.model)
        if saved and saved != now:
            untied = [g for g in saved["tied"] if g not in now["tied"]]
            recast = sorted(k for k, v in saved["dtypes"].items() if now["dtypes"].get(k, v) != v)
            self.report_once("layout", ctx, "checkpoint", "checkpoint",
                             f"the loop resumed at step {ctx.start_step} with a model laid out unlike the one it "
                             "saved: " + "; ".join(
                                 ([f"{' and '.join(untied[0])} were one tied tensor and are not"] if untied else [])
                                 + ([f"{len(recast)} parameters changed dtype ({recast[0]})"] if recast else [])
                                 or ["its parameters differ in name or sharing"]),
                             {"kind": "layout", "untied": untied[:3], "recast": recast[:5]}, confidence=0.8)
        self._judge(ctx, "weights", "the model's weights", self._saved.get("weights"), model_fingerprint(ctx.model))

    def on_before_step(self, ctx: WatchContext) -> None:
        self.retire("on_before_step")  # its saves are still recorded (on_save) for a segment resumed from them
        self.retire("on_forward")
        if self._saved is not None:
            self._judge(ctx, "optimizer", "the optimizer's state", self._saved.get("optimizer"),
                        optimizer_fingerprint(ctx.optimizer))

    def on_end(self, ctx: WatchContext) -> None:
        if ctx.start_step and self._saved is None:
            raise NotApplicable("no checkpoint the watch saw saved at the step the loop resumed from")

    def _judge(self, ctx: WatchContext, kind: str, what: str, saved: dict | None, now: dict) -> None:
        if not saved:
            return
        bad = differing(saved, now)
        if bad:
            key, gap = max(bad, key=lambda kv: kv[1])
            self.report_once(kind, ctx, "checkpoint", "checkpoint",
                             f"the loop resumed at step {ctx.start_step} with {what} unlike what it saved there: "
                             f"{len(bad)} of {len(saved)} tensors differ (most: {key}, relative {gap:.3g}); the "
                             "checkpoint's state was not restored (or not saved whole)",
                             {"kind": kind, "differing": len(bad), "tensors": len(saved),
                              "examples": [k for k, _ in bad[:5]]}, confidence=0.8)
