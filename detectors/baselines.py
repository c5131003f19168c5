"""Baselines: what a practitioner gets from the usual tools, scored alongside the suite (not in it).

- ``detect_anomaly``: PyTorch's anomaly mode for the whole run (it changes the run: slower, and a NaN
  in backward raises), so it runs in its own case. When it fires, the forward traceback it prints
  (captured as a warning) is mapped to the innermost seam through the run's live seam functions.
- ``loss_curve``: a loss watcher: NaN/inf loss, a jump after a resume, a run that does not learn, a
  loss far above or below clean runs of the same recipe (the golden traces). It can only guess a
  subsystem and never names a seam.
- ``crash_triage``: on a crash, the innermost reference frame of the traceback that is a seam.
"""

from __future__ import annotations

import math
import os
import re
import warnings

import torch

from faultbench.detectors.api import Detector, RunContext, register

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def innermost_seam(ctx: RunContext, frames: list[tuple[str, int]]) -> str | None:
    """The innermost (last) of ``frames`` (file, line) that lies inside a seam's live function."""
    return next((seam for path, line in reversed(frames) if (seam := ctx.seam_at(path, line))), None)


@register
class DetectAnomaly(Detector):
    id = "detect_anomaly"
    family = "baseline"
    baseline = True
    exclusive = True  # anomaly mode slows every op and turns a NaN in backward into an error
    passive = True
    description = ("torch.autograd anomaly mode for the whole run; a NaN in backward is mapped, through the forward "
                   "traceback anomaly mode prints, to the innermost seam")

    def __init__(self) -> None:
        super().__init__()
        self._catcher = None
        self._log: list = []
        self._previous = False

    def on_start(self, ctx: RunContext) -> None:
        self._previous = torch.is_anomaly_enabled()
        self._catcher = warnings.catch_warnings(record=True)
        self._log = self._catcher.__enter__()
        warnings.simplefilter("always")
        torch.autograd.set_detect_anomaly(True)

    def _switch_off(self) -> None:
        if self._catcher is not None:
            torch.autograd.set_detect_anomaly(self._previous)
            self._catcher.__exit__(None, None, None)
            self._catcher = None

    def on_end(self, ctx: RunContext, metrics: dict) -> None:
        self._switch_off()

    def on_crash(self, ctx: RunContext, crash: dict) -> None:
        traces = [str(w.message) for w in self._log if "Traceback of forward call" in str(w.message)]
        self._switch_off()
        message = crash.get("message", "")
        if "nan values" not in message and not traces:
            return  # not an anomaly: another kind of crash (crash_triage's)
        frames = [(path, int(line)) for path, line, _ in _FRAME.findall(traces[-1])] if traces else []
        seam = innermost_seam(ctx, frames) if frames else None
        op = re.search(r"Function '(\w+)'", message)
        evidence = {"error": message[:200], "forward_frames": [f"{os.path.basename(p)}:{n}" for p, n in frames[-6:]]}
        if seam is not None:
            self.report(ctx, ctx.seams[seam], seam, f"anomaly mode: {op.group(1) if op else 'a backward function'} "
                        f"returned NaN; its forward ran in {seam}", evidence=evidence, confidence=0.6,
                        step=crash.get("step"))
        else:
            self.report(ctx, "model", None, "anomaly mode: a backward function returned NaN (no seam on the forward "
                        "traceback)", evidence=evidence, confidence=0.3, step=crash.get("step"))


@register
class LossCurve(Detector):
    id = "loss_curve"
    family = "baseline"
    baseline = True
    passive = True
    description = ("the training loss: NaN/inf, a jump right after a resume, no decrease, or far from clean runs of "
                   "the recipe (golden traces); a subsystem guess without a seam")

    MARGIN = 0.5  # nats: a gap from the clean envelope that seed-to-seed variation never reaches

    def __init__(self) -> None:
        super().__init__()
        self.losses: dict[int, float] = {}
        self._resumed_at: int | None = None

    def _golden(self, ctx: RunContext) -> list[list[float]]:
        runs = (ctx.golden or {}).get("runs", [])
        return [r["loss"] for r in runs if r.get("loss")]

    def on_checkpoint_load(self, ctx: RunContext, path) -> None:
        self._resumed_at = ctx.step

    def on_after_step(self, ctx: RunContext, record) -> None:
        step, loss = record.step, float(record.loss)
        self.losses[step] = loss
        if not math.isfinite(loss):
            amp = ctx.fact("precision") != "fp32"
            self.report_once("nan", ctx, "precision" if amp else "model", None,
                             f"the training loss is {loss} at step {step}", {"loss": str(loss)}, confidence=0.35,
                             step=step)
            return
        if self._resumed_at is not None and step in (self._resumed_at, self._resumed_at + 1):
            before = [self.losses[s] for s in range(self._resumed_at - 3, self._resumed_at) if s in self.losses]
            if before and loss - sum(before) / len(before) > self.MARGIN:
                self.report_once("resume", ctx, "checkpoint", None,
                                 f"the loss jumps from {before[-1]:.3f} to {loss:.3f} right after resuming at step "
                                 f"{self._resumed_at}", {"before": before, "after": loss}, confidence=0.35, step=step)
        golden = [g[step] for g in self._golden(ctx) if step < len(g) and math.isfinite(g[step])]
        if golden and step >= 2:
            high, low = max(golden), min(golden)
            if loss > high + self.MARGIN + 0.1 * high:
                self.report_once("high", ctx, "optimizer", None,
                                 f"step {step}: loss {loss:.3f} is far above clean runs of this recipe "
                                 f"({low:.3f}..{high:.3f})",
                                 {"loss": loss, "golden": golden}, confidence=0.3, step=step)
            elif loss < low - self.MARGIN - 0.1 * low:
                self.report_once("low", ctx, "loss", None,
                                 f"step {step}: loss {loss:.3f} is far below clean runs of this recipe "
                                 f"({low:.3f}..{high:.3f}): the targets may leak into the inputs",
                                 {"loss": loss, "golden": golden}, confidence=0.3, step=step)

    def on_end(self, ctx: RunContext, metrics: dict) -> None:
        steps = sorted(s for s, v in self.losses.items() if math.isfinite(v))
        if len(steps) < 8:
            return
        head = [self.losses[s] for s in steps[:2]]
        tail = [self.losses[s] for s in steps[-4:]]
        if sum(tail) / len(tail) > sum(head) / len(head) - 0.1:
            self.report_once("flat", ctx, "optimizer", None,
                             f"the loss does not decrease: {sum(head) / 2:.3f} over the first steps, "
                             f"{sum(tail) / 4:.3f} over the last", {"head": head, "tail": tail}, confidence=0.3)


@register
class CrashTriage(Detector):
    id = "crash_triage"
    family = "baseline"
    baseline = True
    passive = False
    description = "on a crash, the innermost frame of the traceback that is a seam (its subsystem)"

    def on_crash(self, ctx: RunContext, crash: dict) -> None:
        frames = [f.split(".<locals>")[0] for f in crash.get("frames", [])]
        seam = next((f for f in reversed(frames) if f in ctx.seams), None)
        evidence = {"type": crash.get("type"), "message": crash.get("message", "")[:200], "frames": frames[-6:]}
        if seam is not None:
            self.report(ctx, ctx.seams[seam], seam, f"{crash.get('type')} raised inside {seam}", evidence=evidence,
                        confidence=0.5, step=crash.get("step"))
            return
        modules = {s.rsplit(".", 1)[0]: sub for s, sub in ctx.seams.items()}
        for frame in reversed(frames):  # no seam: the subsystem of the innermost reference module's seams
            module = next((m for m in modules if frame.startswith(m + ".")), None)
            if module is not None:
                self.report(ctx, modules[module], None, f"{crash.get('type')} raised in {frame}", evidence=evidence,
                            confidence=0.3, step=crash.get("step"))
                return
