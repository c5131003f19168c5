"""The gradients the optimizer steps with are the derivative of the loss (black-box track): a gradient check.

``gradients.accounting.true-gradient``: whatever a loop's loss is, it reaches the parameters through the logits,
so along any direction d of the parameters its derivative is <dL/dlogits, J d>, where dL/dlogits is what the
loop's backward gave the logits (the watch hands it to ``on_backward``, exactly as used) and J d is the change of
the logits, measured by central finite differences of the model's own forward in float64. The gradient the
optimizer steps with, g, must give the same number, <g, d>, up to one positive factor for the whole step
(clipping, loss scaling, accumulation divide every gradient alike). A forward that cuts a path (a ``detach``, a
``no_grad`` block, an in-place write autograd cannot see), a custom backward that is wrong, a gradient hook that
rescales some parameters, a micro-batch whose gradient is lost: each bends g away from the derivative.

``bb_gradient_check`` runs once, at the watch's first optimizer step (its pre-hook: the gradients as the optimizer
sees them), when the step's micro-batches (at most ``MAX_MICRO``) ran with float32 logits outside autocast, on one
rank, with float32 parameters, and no weight on the logits of padded positions. It replays each micro-batch's
forward in float64 (eval mode, no grad, RNG restored) and first checks that the replay gives the loop's logits
(else the forward is not reproducible here: dropout in train mode, another call; not applicable). Then: the factor
from the direction of g itself, and ``DIRECTIONS`` random directions that must agree with it within ``TOL`` of the
gradient's typical component. On a disagreement, each parameter tensor is checked alone to name the one nearest
the loss whose gradient is wrong.
Cost: 2 x (1 + DIRECTIONS) float64 forwards per micro-batch, once per run; the localization only when it fires.
"""

from __future__ import annotations

import math

import torch

from faultbench.detectors.api import NotApplicable, register
from faultbench.detectors.blackbox.api import BlackBoxDetector, WatchContext
from faultbench.detectors.blackbox.probes import fits_full_precision, full_precision


@register
class GradientCheck(BlackBoxDetector):
    """See the module's docstring."""

    id = "bb_gradient_check"
    family = "model"
    passive = False  # it runs forwards of its own (a probe): its cost is counted apart from the overhead
    description = "finite differences of the model's forward vs the gradients the optimizer steps with (float64)"
    MAX_MICRO = 2
    DIRECTIONS = 3
    EPS = 1e-5  # the step along a unit direction of all parameters (float64: rounding ~1e-11 of the change)
    TOL = 0.02  # disagreement, relative to the gradient's typical component along a random direction
    REPLAY_TOL = 1e-3  # the replay's logits vs the loop's (fp32 rounding ~1e-6)
    MAX_TENSORS = 64  # tensors checked one by one to localize a disagreement

    def __init__(self) -> None:
        super().__init__()
        self._micro: list[tuple[dict, torch.Tensor, torch.Tensor]] = []  # (inputs, the loop's logits, dL/dlogits)
        self._reduced = False
        self._padded_targets = False

    def on_start(self, ctx: WatchContext) -> None:
        if ctx.world_size > 1:
            raise NotApplicable("several ranks: each steps with the gradient averaged over all of them")

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        autocast = any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
        if autocast or (isinstance(logits, torch.Tensor) and logits.dtype != torch.float32):
            self._reduced = True
        self.retire("on_forward")

    def on_backward(self, ctx: WatchContext, batch: dict, logits, grad_logits) -> None:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        mask = inputs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.shape == grad_logits.shape[:2] and bool(
                grad_logits[mask == 0].ne(0).any()):
            # a padded position's logits come from a query that attends to nothing: their scores are absorbed by
            # the mask's -huge, so their finite difference is 0 whatever the analytic gradient says
            self._padded_targets = True
        if "input_ids" in inputs and len(self._micro) <= self.MAX_MICRO:
            self._micro.append((inputs, logits.detach(), grad_logits.detach()))

    def on_before_step(self, ctx: WatchContext) -> None:
        self.retire("on_backward")
        self.retire("on_before_step")
        micro, self._micro = self._micro, []
        if self._reduced:
            raise NotApplicable("the forward ran in reduced precision (autocast or half logits)")
        if self._padded_targets:
            raise NotApplicable("the loss weighs logits at padded positions (a left-padded row's first target): "
                                "their attention is degenerate, no finite difference measures it")
        if not micro or len(micro) > self.MAX_MICRO:
            raise NotApplicable(f"the first step accumulated {len(micro)} micro-batches (checked: 1..{self.MAX_MICRO})")
        if not fits_full_precision(ctx):
            raise NotApplicable("the parameters are not all float32 (the check replays the forward in float64)")
        try:
            lm = ctx.lm
        except ValueError as exc:
            raise NotApplicable(str(exc)) from exc
        params = [p for p in ctx.optimizer_params() if p.requires_grad and p.is_floating_point()]
        with ctx.probe(), full_precision(ctx.model):
            _Check(lm, micro, params, self).run(ctx)


class _Check:
    """One gradient check over the micro-batches of a step, inside a float64 probe."""

    def __init__(self, lm, micro: list, params: list[torch.Tensor], det: GradientCheck):
        self.lm, self.micro, self.params, self.det = lm, micro, params, det
        self.grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().double() for p in params]
        self.gen = torch.Generator().manual_seed(0)

    def logits(self, inputs: dict) -> torch.Tensor:
        return self.lm.raw_logits(inputs["input_ids"], inputs.get("attention_mask"), inputs.get("position_ids"))

    def derivative(self, direction: list[torch.Tensor | None]) -> float:
        """<dL/dlogits, J direction> summed over the micro-batches, by central differences."""
        total = 0.0
        saved = [p.detach().clone() for p in self.params]
        try:
            for inputs, _, grad in self.micro:
                sides = []
                for sign in (1.0, -1.0):
                    with torch.no_grad():
                        for p, s, d in zip(self.params, saved, direction, strict=True):
                            if d is not None:
                                p.copy_(s + sign * self.det.EPS * d)
                    sides.append(self.logits(inputs).double())
                total += float(((sides[0] - sides[1]) / (2 * self.det.EPS) * grad.double()).sum())
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved, strict=True):
                    p.copy_(s)
        return total

    def observed(self, direction: list[torch.Tensor | None]) -> float:
        return float(sum((g * d).sum() for g, d in zip(self.grads, direction, strict=True) if d is not None))

    def random(self, only: int | None = None) -> list[torch.Tensor | None]:
        """A random unit direction over every parameter (``only``: over that one tensor)."""
        out = [None if only is not None and i != only else
               torch.randn(p.shape, generator=self.gen, dtype=torch.float64).to(p.device)
               for i, p in enumerate(self.params)]
        norm = math.sqrt(sum(float((d * d).sum()) for d in out if d is not None))
        return [None if d is None else d / norm for d in out]

    def run(self, ctx: WatchContext) -> None:
        for inputs, logits, _ in self.micro:
            replay = self.logits(inputs).double()
            gap = float((replay - logits.double()).abs().max() / logits.double().abs().max().clamp(min=1e-12))
            if gap > self.det.REPLAY_TOL:
                raise NotApplicable(f"a replay of the forward does not give the loop's logits (relative gap {gap:.2g}):"
                                    " dropout in train mode, or inputs the watch does not see")
        norm = math.sqrt(sum(float((g * g).sum()) for g in self.grads))
        if norm == 0.0:
            return
        along = self.derivative([g / norm for g in self.grads])  # the derivative along g: norm / factor
        n = sum(p.numel() for p in self.params)
        typical = norm / math.sqrt(n)  # |<g, d>| for a random unit d
        if along <= 0.0:
            self._report(ctx, norm, along, None, "the loss does not decrease along the gradient: the optimizer "
                         "steps uphill or sideways")
            return
        factor = norm / along
        worst = 0.0
        for _ in range(self.det.DIRECTIONS):
            d = self.random()
            worst = max(worst, abs(self.observed(d) - factor * self.derivative(d)) / typical)
        if worst > self.det.TOL:
            self._report(ctx, norm, along, worst, "the gradient is not the derivative of the loss")

    def _last_wrong(self, ctx: WatchContext) -> int | None:
        """The parameter tensor nearest the loss (in the order the forward reaches their modules) whose own gradient
        disagrees with its finite difference, against the factor most tensors agree on (their median ratio): the
        path to the loss is broken between it and the output."""
        order = _call_order(ctx.model, lambda: self.logits(self.micro[0][0]))
        owners = {id(p): name.rpartition(".")[0] for name, p in ctx.model.named_parameters()}
        checked = sorted(range(len(self.params)), key=lambda i: order.get(owners.get(id(self.params[i]), ""), -1))
        checked = checked[-self.det.MAX_TENSORS:]
        pairs = {}
        for i in checked:
            d = self.random(only=i)
            pairs[i] = (self.observed(d), self.derivative(d))
        ratios = sorted(seen / true for seen, true in pairs.values() if abs(true) > 1e-12)
        if not ratios:
            return None
        factor = ratios[len(ratios) // 2]
        wrong = [i for i in checked if abs(pairs[i][0] - factor * pairs[i][1])
                 > 0.2 * max(abs(pairs[i][0]), abs(factor * pairs[i][1]), 1e-12)]
        return wrong[-1] if wrong else None

    def _report(self, ctx: WatchContext, norm: float, along: float, worst: float | None, what: str) -> None:
        wrong = self._last_wrong(ctx)
        name = None if wrong is None else next(n for n, p in ctx.model.named_parameters() if p is self.params[wrong])
        measured = (f"finite differences of the model's forward (float64) disagree with the gradients the optimizer "
                    f"steps with (by {worst:.3g} of a typical component)" if worst is not None
                    else f"the derivative along the gradient is {along:.3g}")
        place = (f"; wrong from {name} on (the tensor nearest the loss whose own gradient disagrees with its finite "
                 "difference): between it and the output a detach, a no_grad, a custom backward or a gradient hook "
                 "bends its path" if name else "; no single tensor stands out")
        self.det.report(ctx, "model", None if wrong is None else ctx.param_owner(self.params[wrong]),
                        f"{what}: {measured}{place}", {"grad_norm": norm, "derivative_along_grad": along,
                                                        "disagreement": worst, "parameter": name}, confidence=0.75)


def _call_order(model: torch.nn.Module, call) -> dict[str, int]:
    """{module path: the order in which ``call()``'s forward first entered it}."""
    order: dict[str, int] = {}

    def enter(name: str) -> None:
        order.setdefault(name, len(order))

    handles = [m.register_forward_pre_hook(lambda m, a, name=name: enter(name)) for name, m in model.named_modules()]
    try:
        call()
    finally:
        for h in handles:
            h.remove()
    return order
