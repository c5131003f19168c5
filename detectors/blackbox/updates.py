"""The optimizer's steps change the weights (black-box track): ``optimizer.accounting.updates-applied``.

A step that is not skipped, with a non-zero LR, changes every parameter it holds a non-zero gradient for: the
whole point of the step. Two ways a loop loses its updates without a crash: the step runs but writes nothing back
(an update computed into a copy, a step on parameters the model no longer uses, a wrapper that forgot to call the
inner optimizer's step), or no step runs at all although the loop trains (the call removed, a scaler whose step
never reaches the optimizer, another optimizer than the one watched). ``bb_updates_applied`` checks both:

- on the watch's first ``CHECKED_STEPS`` step with a non-zero gradient and LR, the norm of each parameter holding a
  gradient before the step and after it: a step that changed none of them is a finding (groups at LR 0, as a warmup
  from 0 has at its first step, are left out);
- at the end, a run whose backwards reached the logits at least ``MIN_FORWARDS`` times and whose optimizer never
  stepped: the weights unchanged since the start (nothing updates them) or changed (something other than the
  watched optimizer does).
Cost: two fused norms over the parameters on one step, one at the start and one at the end.
"""

from __future__ import annotations

import torch

from faultbench.detectors.api import register
from faultbench.detectors.blackbox.api import BlackBoxDetector, StepRecord, WatchContext, local_shard


def _fingerprint(params: list[torch.Tensor]) -> list[float]:
    """The L2 norm of each tensor (one fused kernel): any update written to a tensor changes it (all but surely)."""
    if not params:
        return []
    return torch.stack(torch._foreach_norm([local_shard(p) for p in params])).tolist()


@register
class UpdatesApplied(BlackBoxDetector):
    """See the module's docstring: steps that change no parameter with a gradient, and a training run without a
    single optimizer step."""

    id = "bb_updates_applied"
    family = "optimizer"
    description = "an optimizer step changes the parameters it has gradients for; a training run steps at all"
    CHECKED_STEPS = 1
    MIN_FORWARDS = 4  # training forwards whose logits need a gradient, before a run without a step is judged

    def __init__(self) -> None:
        super().__init__()
        self._forwards = 0
        self._checked = 0
        self._before: tuple[list[torch.Tensor], list] | None = None
        self._start: list | None = None

    def on_start(self, ctx: WatchContext) -> None:
        self._start = _fingerprint(ctx.optimizer_params())

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            self._forwards += 1
        if ctx.history:
            self.retire("on_forward")  # the run steps: counting forwards says nothing more

    def on_before_step(self, ctx: WatchContext) -> None:
        stepped = [p for g in ctx.optimizer.param_groups if float(g.get("lr", 0.0)) > 0 for p in g["params"]
                   if p.grad is not None]
        self._before = (stepped, _fingerprint(stepped)) if stepped else None

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        before, self._before = self._before, None
        if before is None or record.skipped or not record.grad_norm:  # the first steps' norms are measured
            return
        self._checked += 1
        if self._checked >= self.CHECKED_STEPS:
            self.retire("on_before_step")
            self.retire("on_after_step")
        params, prints = before
        if _fingerprint(params) == prints:
            self.report_once("unchanged", ctx, "optimizer", "optimizer",
                             f"optimizer step {record.step} changed none of the {len(params)} parameters it holds "
                             f"non-zero gradients for (lr {max(record.lrs):.3g}): the update never reaches the "
                             "weights the model uses (computed into a copy, or the parameters were replaced after "
                             "the optimizer was built)", {"step": record.step, "params": len(params)},
                             confidence=0.8)

    def on_end(self, ctx: WatchContext) -> None:
        if ctx.history or ctx.skipped_steps or self._forwards < self.MIN_FORWARDS or self._start is None:
            return  # steps taken, or skipped by the loss scaler (bb_scaler_skips says why)
        moved = _fingerprint(ctx.optimizer_params()) != self._start
        how = ("the weights changed anyway: something other than the watched optimizer updates them"
               if moved else "the weights never changed: the run trains nothing (the optimizer's step is never "
               "called, or a wrapper's step does not reach it)")
        self.report(ctx, "optimizer", "optimizer",
                    f"{self._forwards} training forwards ran and the watched optimizer never stepped; {how}",
                    {"training_forwards": self._forwards, "weights_changed": moved}, confidence=0.8)
