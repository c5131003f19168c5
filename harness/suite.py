"""The white-box detectors of one case and the dispatcher of their hooks (any target's runner fires them).

When the hooks fire (see ``detectors.api.Detector``; a target's runner keeps this order):
  on_start        after the run is built, before step 0
  on_batch        after the step's micro-batches are drawn, before the training step
  on_forward      forward hook of the model, training forwards only
  on_backward     hook on the logits' gradient, one call per micro-batch
  on_before_step  the optimizer's step pre-hook (skipped steps of fp16 never reach it)
  on_after_step   after the training step returns its record
  on_checkpoint_save / on_checkpoint_load   after the save, after the load into a fresh run
  on_end          after the end-of-run evaluation
  on_crash        the run raised
"""

from __future__ import annotations

import time
from collections.abc import Callable

from faultbench.detectors.api import HOOKS, Detector, NotApplicable, RunContext, all_detectors, rank_findings
from faultbench.harness.record import final_state
from faultbench.harness.recorder import GoldenRecorder
from faultbench.harness.watched import Watched


class Suite:
    """The detectors of a case and the dispatcher of their hooks: each call is timed and contained.

    Before a detector's first hook its declared needs are checked (``Detector.check_applicable``); a
    detector that is not applicable to the run (there, or by raising ``NotApplicable`` from a hook) has
    its reason recorded once in ``not_applicable`` (and its summary) and is called no more.
    """

    def __init__(self, ids, ctx: RunContext):
        registry = {**all_detectors(), GoldenRecorder.id: GoldenRecorder}
        self.ctx = ctx
        self.detectors: list[Detector] = [registry[i]() for i in ids]
        self.errors: dict[str, str] = {}
        self.not_applicable: dict[str, str] = {}  # detector id -> why its assumptions do not hold for the run
        self._checked: set[str] = set()
        self.step_seconds = {d.id: 0.0 for d in self.detectors}  # inside training steps: the overhead
        self.other_seconds = {d.id: 0.0 for d in self.detectors}  # probes at start, checkpoint, end
        # only detectors that override a hook are called for it (the base class's hooks do nothing)
        self._subscribers = {hook: [d for d in self.detectors if getattr(type(d), hook) is not getattr(Detector, hook)]
                             for hook in HOOKS}
        self.in_step = False
        self.quiet: Callable[[bool], None] = lambda on: None  # another observer of the run (the watch) looks away

    def wants(self, hook: str) -> bool:
        return bool(self._subscribers[hook])

    def fire(self, hook: str, *args) -> None:
        timer = self.step_seconds if self.in_step else self.other_seconds
        for det in self._subscribers[hook]:
            if det.id in self.errors or det.id in self.not_applicable:
                continue
            start = time.perf_counter()
            self.quiet(True)
            try:
                if det.id not in self._checked:
                    self._checked.add(det.id)
                    det.check_applicable(self.ctx)
                getattr(det, hook)(self.ctx, *args)
            except NotApplicable as exc:  # said once, with its reason: neither a finding nor an error
                self.not_applicable[det.id] = f"{hook}: {exc}"[:500]
            except Exception as exc:  # a broken detector is recorded and silenced, never fatal
                self.errors[det.id] = f"{hook}: {type(exc).__name__}: {exc}"[:500]
            finally:
                self.quiet(False)
                timer[det.id] += time.perf_counter() - start

    def summaries(self) -> dict:
        out = {d.id: d.summary() for d in self.detectors if d.summary()}
        for det, reason in self.not_applicable.items():
            out[det] = {**out.get(det, {}), "not_applicable": reason}
        return out

    def findings(self) -> list:
        return rank_findings([f for d in self.detectors for f in d.findings])


def suite_into(out: dict, suite: Suite | None, watched: Watched | None) -> dict:
    """``out`` with what the case's detectors saw, both tracks (of a run that could not even be built, what the
    black-box track's guard located)."""
    if suite is not None:
        out.update(findings=[f.to_dict() for f in suite.findings()], detector_errors=suite.errors,
                   step_seconds=suite.step_seconds, other_seconds=suite.other_seconds, summaries=suite.summaries())
    if watched is not None:
        watched.merge_into(out)
    return out


def crashed(out: dict, exc: BaseException, crash: dict, suite: Suite | None, watched: Watched | None) -> None:
    """A target's run raised ``exc``: ``crash`` (its record) is the case's outcome, both tracks are told."""
    out["crash"] = crash
    if suite is not None:
        suite.fire("on_crash", crash)
    if watched is not None:
        watched.finish(exc)


def finished(out: dict, run, start: float, suite: Suite | None, watched: Watched | None) -> dict:
    """The end of every target's case record: what the run left (``final_state``), the wall time since ``start``
    (``time.perf_counter``), and what both tracks saw."""
    if run is not None:
        out["outputs"].update(final_state(run))
    out["wall_s"] = time.perf_counter() - start
    return suite_into(out, suite, watched)
