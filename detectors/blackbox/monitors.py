"""Monitors of the black-box track: passive checks on what ``faultbench.watch`` sees of any training loop.

Each names the user's object: "optimizer", "scheduler", "scaler", "batch", "loss", "eval", or a module path
from the model's ``named_modules``. None assumes a formula of ours: the LR monitor reads only the shape of the
LR the optimizer really used (a nanoGPT (s+1)/(W+1) warmup, a Trainer cosine or a constant LR are all fine),
the gradient monitors compare gradients with themselves at two moments of the same step.
"""

from __future__ import annotations

import math
import weakref

import torch

from faultbench.detectors.api import NotApplicable, register
from faultbench.detectors.blackbox.api import BlackBoxDetector, StepRecord, WatchContext, guarded


@register
class LRShape(BlackBoxDetector):
    """The LR the optimizer stepped with: a warmup that never ends, and an optimizer that does not follow its
    scheduler. Rules (no schedule formula): in a run whose planned length the loop declared (``total_steps``; the
    HF callback declares Trainer's ``max_steps``) and that the watch saw to its end, the LR rose at EVERY one of
    ``MIN_STEPS`` or more steps and was still rising at the last one (a warmup never outlasts the run it belongs to;
    a run watched only for part of its length says nothing about where its warmup ends); with a scheduler, the LR
    the optimizer used differs from the one the scheduler reports on ``MIN_MISMATCH`` steps."""

    id = "bb_lr_shape"
    family = "optimizer"
    description = "LR as the optimizer used it: endless warmup (rising to the declared end), scheduler ignored"
    MIN_STEPS = 20
    MIN_MISMATCH = 2

    def on_before_step(self, ctx: WatchContext) -> None:
        if ctx.scheduler is None or not hasattr(ctx.scheduler, "get_last_lr"):
            return
        used, reported = float(ctx.optimizer.param_groups[0]["lr"]), float(ctx.scheduler.get_last_lr()[0])
        mismatch = None if math.isclose(used, reported, rel_tol=1e-6, abs_tol=1e-12) else (ctx.step + 1, used, reported)
        hits = self.tally("ignored", mismatch, self.MIN_MISMATCH)
        if hits:
            self.report_once("ignored", ctx, "optimizer", "scheduler",
                             f"the optimizer steps with lr {used:.3g} while the scheduler reports {reported:.3g}: the "
                             "schedule does not reach the optimizer (it is stepped on another optimizer, or the lr is "
                             "overwritten after it)", {"steps": hits[:5]}, confidence=0.8)

    def on_end(self, ctx: WatchContext) -> None:
        lrs = [r.lrs[0] for r in ctx.history if r.lrs]
        planned = ctx.conventions.total_steps
        if len(lrs) < self.MIN_STEPS or planned is None or ctx.step < planned:
            return
        if all(b > a for a, b in zip(lrs, lrs[1:], strict=False)):
            where = "scheduler" if ctx.scheduler is not None else "optimizer"
            self.report(ctx, "optimizer", where,
                        f"the LR rose at every one of the {len(lrs)} steps watched ({lrs[0]:.3g} -> {lrs[-1]:.3g}) and "
                        f"was still rising at the run's planned last step ({planned}): the warmup never ends (its "
                        "length is in other units than the steps, or longer than the run), so the peak LR is never "
                        "reached",
                        {"first_lr": lrs[0], "last_lr": lrs[-1], "steps": len(lrs)}, confidence=0.8)


@register
class ScheduleSteps(BlackBoxDetector):
    """The schedule advances at most once per optimizer step: between two optimizer steps the scheduler's step
    counter (torch's ``LRScheduler.last_epoch``) moves by at most one per step the loop attempted (1 + the steps the
    scaler skipped in between: a loop may step its scheduler after a skipped step too), times the processes (a
    scheduler prepared by accelerate steps once per process). A scheduler stepped per epoch or on a plateau moves
    less, which is fine. Reported when the excess holds on ``MIN_STEPS`` steps."""

    id = "bb_schedule_steps"
    family = "optimizer"
    description = "the LR scheduler advances at most once per optimizer step (not per micro-batch, not twice)"
    MIN_STEPS = 2

    def __init__(self) -> None:
        super().__init__()
        self._epoch: int | None = None

    def on_start(self, ctx: WatchContext) -> None:
        if not isinstance(getattr(ctx.scheduler, "last_epoch", None), int):
            raise NotApplicable("no scheduler with a step counter (last_epoch) was handed to the watch")
        self._epoch = ctx.scheduler.last_epoch

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        epoch = ctx.scheduler.last_epoch
        moved, allowed = epoch - self._epoch, (1 + record.skipped) * max(1, ctx.world_size)
        self._epoch = epoch
        hits = self.tally("fast", (record.step, moved, allowed) if moved > allowed else None, self.MIN_STEPS)
        if hits:
            step, moved, allowed = hits[0]
            self.report_once("fast", ctx, "optimizer", "scheduler",
                             f"the LR scheduler advanced {moved} times between two optimizer steps (at most "
                             f"{allowed}: one per step the loop attempted) on {len(hits)} steps: it is stepped per "
                             "micro-batch or more than once per step, so the schedule runs that many times too fast "
                             "(warmup and decay end early)", {"steps": hits[:5]}, confidence=0.85, step=step)


@register
class GradientsCleared(BlackBoxDetector):
    """Gradients are cleared between optimizer steps: at the first backward after a step no parameter of the
    optimizer may still hold a non-zero ``.grad`` (the watch checks it when that backward's first gradient
    arrives, so zero_grad anywhere before the backward is fine). Reported when it holds on ``MIN_STEPS`` steps."""

    id = "bb_grads_cleared"
    family = "optimizer"
    description = "stale gradients at the first backward after a step (zero_grad missing)"
    MIN_STEPS = 2

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        # ctx.stale_grads describes the backward of the step just taken (the one after the previous step)
        stale = {"step": record.step, **ctx.stale_grads} if record.step > 1 and ctx.stale_grads else None
        hits = self.tally("stale", stale, self.MIN_STEPS)
        if hits:
            first = hits[0]
            self.report_once("stale", ctx, "optimizer", "optimizer",
                             f"gradients of the previous step were still in .grad when the next backward began "
                             f"({first['params']} of {first['of']} parameters, norm {first['norm']:.3g}, at step "
                             f"{first['step']}): zero_grad is not called between optimizer steps, so every step adds "
                             "the gradients of all earlier ones", {"steps": hits[:5]}, confidence=0.85)


class _GraphToken:
    """Lives exactly as long as the autograd node holding it (through a no-op pre-hook)."""


@register
class GraphsReleased(BlackBoxDetector):
    """A training step's autograd graph is freed once the step is over: the graph of each step's first training
    forward (a token held by its logits' node) may outlive its step by ``LAG`` steps at most (a loop variable still
    holding the last loss until the next step overwrites it). A graph alive later than that is kept by the loop: a
    loss (or logits) tensor stored for logging without ``.item()``/``.detach()``, and memory grows every step."""

    id = "bb_graphs_released"
    sampled = True  # every step keeps the contract alike
    family = "optimizer"
    description = "a training step's autograd graph still alive steps after the step (loss kept as a tensor)"
    LAG = 2

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[tuple[int, weakref.ref]] = []  # (step the graph belongs to, its token)
        self._tracked_step = -1

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        node = getattr(logits, "grad_fn", None)
        if node is None or self._tracked_step == ctx.step:
            return
        self._tracked_step = ctx.step
        token = _GraphToken()
        node.register_prehook(lambda grad_outputs, _token=token: None)
        self._pending.append((ctx.step + 1, weakref.ref(token)))

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        due = [(step, ref) for step, ref in self._pending if ctx.step - step >= self.LAG]
        self._pending = [entry for entry in self._pending if ctx.step - entry[0] < self.LAG]
        alive = [step for step, ref in due if ref() is not None]
        if alive:
            self.report_once("kept", ctx, "optimizer", "loss",
                             f"the autograd graph of training step {alive[0]} is still alive {ctx.step - alive[0]} "
                             "steps after that step ended: the loop keeps a tensor that requires grad (a loss summed "
                             "or stored as a tensor instead of .item()), so every step's graph stays in memory",
                             {"step": alive[0], "checked_at": ctx.step}, confidence=0.7)


@register
class ClipOnScaledGrads(BlackBoxDetector):
    """With an enabled loss scaler, clipping must act on unscaled gradients. The optimizer steps with gradients of
    norm ``grad_norm``; the backward left them with norm ``backward_norm`` = scale x the true norm. Clipping after
    ``unscale_`` gives grad_norm <= true norm with a ratio of max_norm / true norm; clipping the SCALED gradients
    gives max_norm / (scale x true norm): ``scale`` times smaller. Reported when grad_norm / true norm is below
    1 / sqrt(scale) on ``MIN_STEPS`` steps (a clean run would need a true norm sqrt(scale) times max_norm)."""

    id = "bb_clip_scaled"
    family = "precision"
    description = "gradients clipped while still scaled by the GradScaler (clip before unscale_)"
    MIN_SCALE = 256.0
    MIN_STEPS = 3

    def on_start(self, ctx: WatchContext) -> None:
        if not ctx.scaler_enabled:
            raise NotApplicable("no enabled loss scaler (GradScaler) was given")

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        if not (record.scale and record.scale >= self.MIN_SCALE and record.grad_norm and record.backward_norm):
            return
        true_norm = record.backward_norm / record.scale
        ratio = record.grad_norm / true_norm
        hits = self.tally("clip", {"step": record.step, "scale": record.scale, "norm_stepped": record.grad_norm,
                                   "unscaled_norm": true_norm, "ratio": ratio}
                          if ratio < 1 / math.sqrt(record.scale) else None, self.MIN_STEPS)
        if hits:
            hit = hits[0]
            self.report_once("clip", ctx, "precision", "scaler",
                             f"the optimizer stepped with gradients of norm {hit['norm_stepped']:.3g} while their "
                             f"unscaled norm was {hit['unscaled_norm']:.3g} (ratio {hit['ratio']:.2g}, scale "
                             f"{hit['scale']:g}): they were clipped while still scaled, before scaler.unscale_, so "
                             "every update is ~scale times too small", {"steps": hits[:5]}, confidence=0.85)


@register
class ParamsOutsideOptimizer(BlackBoxDetector):
    """Every trainable parameter of the model is in one of the optimizer's param groups."""

    id = "bb_params_in_optimizer"
    family = "optimizer"
    description = "trainable parameters that no optimizer param group holds"

    def on_start(self, ctx: WatchContext) -> None:
        held = {id(p) for p in ctx.optimizer_params()}
        missing = [name for name, p in ctx.model.named_parameters() if p.requires_grad and id(p) not in held]
        if missing:
            owner = missing[0].rpartition(".")[0] or missing[0]
            self.report(ctx, "optimizer", owner,
                        f"{len(missing)} trainable parameters are in no param group of the optimizer (first: "
                        f"{missing[0]}): they get gradients but never change", {"missing": missing[:10]},
                        confidence=0.8)


@register
class GoldenModel(BlackBoxDetector):
    """The model is built as in the user's known-good runs (``ctx.golden["model"]``): as many distinct parameter
    tensors holding as many elements, the same names sharing a tensor (tied weights). A model with other parameters
    is the model's own difference, whatever the optimizer that holds them then shows."""

    id = "bb_golden_model"
    against_golden = True
    family = "model"
    description = "the model's parameters (count, elements, tied weights) vs the known-good runs'"

    def on_start(self, ctx: WatchContext) -> None:
        want = (ctx.golden or {}).get("model")
        if want is None:
            raise NotApplicable("no golden envelope with the model's parameters was given")
        have = ctx.model_structure()
        if have == want:
            return
        untied = [name for name in want["shared"] if name not in have["shared"]]
        where = untied[0].rpartition(".")[0] if untied else ""
        tie = f"; {', '.join(untied[:3])} no longer share{'s' * (len(untied) == 1)} a tensor" if untied else ""
        self.report(ctx, "model", where,
                    f"the model has {have['params']} parameter tensors of {have['numel']} elements where the "
                    f"known-good runs' had {want['params']} of {want['numel']}{tie}: it is not built as they were",
                    {"golden": want, "model": have}, confidence=0.75)


@register
class GradientsPresent(BlackBoxDetector):
    """Every parameter the optimizer holds receives a gradient: one whose ``.grad`` is None at ``MIN_STEPS``
    consecutive steps while others have theirs is cut off from the loss (a detach, an unused branch)."""

    id = "bb_grads_present"
    family = "model"
    description = "optimizer parameters that never receive a gradient (cut off from the loss)"
    MIN_STEPS = 3

    def __init__(self) -> None:
        super().__init__()
        self._missing_since: dict[int, int] = {}
        self._params: list[torch.Tensor] = []

    def on_start(self, ctx: WatchContext) -> None:
        self._params = [p for p in ctx.optimizer_params() if p.requires_grad]  # the groups as the watch began

    def on_before_step(self, ctx: WatchContext) -> None:
        params = self._params
        absent = [p for p in params if p.grad is None]
        if len(absent) == len(params):
            return  # no gradient at all: nothing to compare with (a loop stepping before its first backward)
        self._missing_since = {id(p): self._missing_since.get(id(p), 0) + 1 for p in absent}
        cut = [p for p in absent if self._missing_since[id(p)] >= self.MIN_STEPS]
        if cut:
            where = ctx.param_owner(cut[0])
            self.report_once("cut", ctx, "model", where,
                             f"{len(cut)} parameters of the optimizer got no gradient in {self.MIN_STEPS} steps in a "
                             f"row (first in {where}): they are cut off from the loss", {"params": len(cut)},
                             confidence=0.6)


@register
class ScalerSkips(BlackBoxDetector):
    """The loss scaler skips a step when gradients overflow; most steps skipped means the run does not train. When
    the loss itself was non-finite the skips are a consequence of the forward, not of the scale: lower confidence."""

    id = "bb_scaler_skips"
    family = "precision"
    description = "loss scaler skipping most steps (overflowing gradients)"
    MIN_ATTEMPTS = 10

    def __init__(self) -> None:
        super().__init__()
        self._non_finite_loss = False

    def on_start(self, ctx: WatchContext) -> None:
        if not ctx.scaler_enabled:
            raise NotApplicable("no enabled loss scaler (GradScaler) was given")

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        self._non_finite_loss = self._non_finite_loss or _non_finite(loss)

    def on_end(self, ctx: WatchContext) -> None:
        skipped = ctx.skipped_steps
        attempts = skipped + ctx.history.recorded
        if attempts >= self.MIN_ATTEMPTS and skipped > attempts / 2:
            cause = ("the loss itself was non-finite (a forward problem)" if self._non_finite_loss
                     else "the gradients overflow in the scaled loss")
            self.report(ctx, "precision", "scaler",
                        f"the loss scaler skipped {skipped} of {attempts} optimizer steps (its scale fell that often): "
                        f"{cause}",
                        {"skipped": skipped, "attempts": attempts, "non_finite_loss": self._non_finite_loss},
                        confidence=0.4 if self._non_finite_loss else 0.7)


@register
class FirstNonFinite(BlackBoxDetector):
    """The first module (in execution order) whose output is non-finite, found by replaying the batch of the
    first training forward with a non-finite loss or logits under forward hooks on every submodule."""

    id = "bb_first_nonfinite"
    family = "model"
    description = "first module whose output turns non-finite, when the loss does"

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        if self.findings or not _non_finite(loss if loss is not None else logits):
            return
        if "input_ids" not in batch:
            raise NotApplicable("the model's forward takes no token ids the watch could read")
        first = _first_non_finite_module(ctx, batch)
        if first is None:
            self.report(ctx, "loss", "loss", "the loss is non-finite while every module's output is finite: the loss "
                        "computation itself overflows", {"step": ctx.step}, confidence=0.6)
            return
        params_bad = any(not torch.isfinite(p).all() for p in first[1].parameters(recurse=False))
        self.report(ctx, "optimizer" if params_bad else "model", first[0],
                    f"the first non-finite output comes from {first[0]}"
                    + (" whose parameters are already non-finite (an earlier update broke them)" if params_bad
                       else ""), {"module": first[0], "params_non_finite": params_bad}, confidence=0.6)


def _non_finite(t) -> bool:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return False
    t = t.detach()
    if t.numel() == 1:
        return not math.isfinite(float(t))
    # an fp32 sum is finite unless an element is not (or it overflows): one cheap reduction instead of a
    # full isfinite mask on every forward (~35x faster on a batch's logits); a non-finite sum is confirmed exactly
    return not math.isfinite(float(t.sum(dtype=torch.float32))) and not bool(torch.isfinite(t).all())


def _first_non_finite_module(ctx: WatchContext, batch: dict) -> tuple[str, torch.nn.Module] | None:
    """(path, module) of the first submodule whose output is non-finite on ``batch``, or None."""
    order: list[torch.nn.Module] = []

    def hook(module, args, output):
        outs = output if isinstance(output, (tuple, list)) else (output,)
        if not order and any(_non_finite(o) for o in outs):
            order.append(module)

    lm = ctx.lm
    handles = [m.register_forward_hook(hook) for name, m in ctx.model.named_modules() if name]
    try:
        with ctx.probe():
            lm.logits(batch["input_ids"], batch.get("attention_mask"))
    finally:
        for h in handles:
            h.remove()
    return (ctx.module_path(order[0]), order[0]) if order else None


def _dropout_active(model: torch.nn.Module) -> list[str]:
    """Paths of dropout modules with p > 0 (what train mode changes in a forward)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]


@register
class EvalMode(BlackBoxDetector):
    """A forward without grad (evaluation, generation) runs with the model in eval mode: in train mode its
    dropout layers drop activations and the metrics are noisy and pessimistic."""

    id = "bb_eval_mode"
    family = "eval"
    description = "evaluation forwards (no grad) with the model in train mode"

    def on_eval_forward(self, ctx: WatchContext, batch: dict, logits) -> None:
        if not ctx.model.training:
            return
        active = _dropout_active(ctx.model)
        self.report_once("train_mode", ctx, "eval", "eval",
                         "a forward without grad (evaluation or generation) ran with the model in train mode "
                         + (f"(dropout active in {active[0]} and {len(active) - 1} more): model.eval() is missing"
                            if active else "(no dropout module, so only mode-dependent code changes): model.eval() "
                            "is missing"), {"dropout_modules": active[:5]}, confidence=0.7 if active else 0.5)


@register
class PadIds(BlackBoxDetector):
    """Batches against the declared pad id (the tokenizer's ``pad_token_id``, or ``declare={"pad_id": ...}``): where
    attention_mask is 0 the ids are the pad id; where it is 1 there is no pad id (unless pad doubles as another
    special token, e.g. EOS). A batch given without a mask is all "1": rows that open with a run of pad ids while
    others open with a token are left padding the model attends to (a causal model's real tokens never see right
    padding, so only the left side counts). Whether padded targets are trained is the loss's gradient's to say
    (bb_loss_padding): the label value a loop ignores them with is its own choice."""

    id = "bb_pad_ids"
    sampled = True  # every batch keeps the contract alike
    family = "collate"
    description = "padding in the batches vs the declared pad id: masked real tokens, attended pads"

    def on_start(self, ctx: WatchContext) -> None:
        self._pad = ctx.conventions.pad_id
        if self._pad is None:
            raise NotApplicable("no pad id was declared (a tokenizer's pad_token_id, or declare={'pad_id': ...})")
        self._special = ctx.conventions.doubles_as_special(self._pad)  # then a pad id may be attended (as EOS, ...)

    LEFT_RUN = 2  # pad ids opening a row: one could be a document's own first token (a pad that doubles as BOS)

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        mask, ids = batch.get("attention_mask"), batch.get("input_ids")
        if mask is None and isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > self.LEFT_RUN:
            self._unmasked_left_padding(ctx, ids)
        if mask is None or ids is None or mask.shape != ids.shape:
            return
        pad, hidden = self._pad, mask == 0
        is_pad = ids == pad
        # elementwise tests and one reduction (no boolean indexing): every sampled forward pays for them; where
        # the padding keeps the contract (the usual case) one test says so
        if bool(((hidden & ~is_pad) if self._special else (is_pad != hidden)).any()):
            self._mismatch(ctx, pad, hidden, is_pad)

    def _unmasked_left_padding(self, ctx: WatchContext, ids: torch.Tensor) -> None:
        opens = (ids[:, :self.LEFT_RUN] == self._pad).all(dim=1)
        if bool(opens.any()) and not bool(opens.all()):  # some rows padded on the left, others not: padding
            rows = int(opens.sum())
            self.report_once("unmasked_left", ctx, "mask", "batch",
                             f"{rows} of {ids.shape[0]} rows open with a run of the pad id {self._pad} while the "
                             "others open with a token, and the model was given no attention_mask: every real token "
                             "of those rows attends to their left padding", {"rows": rows}, confidence=0.75)

    def _mismatch(self, ctx: WatchContext, pad: int, hidden: torch.Tensor, is_pad: torch.Tensor) -> None:
        masked_real = int((hidden & ~is_pad).sum())
        if masked_real:
            self.report_once("masked_real", ctx, "collate", "batch",
                             f"attention_mask is 0 on {masked_real} positions holding real tokens "
                             f"(not the pad id {pad}): the mask and the padding disagree (pads on another side?)",
                             {"positions": masked_real}, confidence=0.8)
        attended_pad = 0 if self._special else int((is_pad & ~hidden).sum())
        if attended_pad:
            self.report_once("attended_pad", ctx, "collate", "batch",
                             f"attention_mask is 1 on {attended_pad} pad tokens: the model attends to padding",
                             {"positions": attended_pad}, confidence=0.8)

    def on_eval_forward(self, ctx: WatchContext, batch: dict, logits) -> None:
        """An evaluation or generation batch (batched generation pads on the left) keeps the same contract between
        its mask and its ids."""
        self.on_forward(ctx, batch, logits, None)


@register
class GoldenLoss(BlackBoxDetector):
    """The loss per step against the user's golden envelope (``faultbench.record_golden`` of known-good runs):
    outside [min - tol, max + tol] with tol = max(3 x the envelope's width, 10% of its max) on ``MIN_STEPS``
    consecutive steps. It says only that the run left known-good behaviour: low confidence, at the loss."""

    id = "bb_golden_loss"
    against_golden = True
    family = "loss"
    description = "loss outside the envelope of the user's own known-good runs"
    MIN_STEPS = 3

    def on_start(self, ctx: WatchContext) -> None:
        if not ctx.golden or not ctx.golden.get("steps"):
            raise NotApplicable("no golden envelope was given (faultbench.record_golden)")

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        steps = ctx.golden["steps"]
        if record.loss is None or record.step > len(steps) or not steps[record.step - 1]["loss"]:
            return
        lo, hi = steps[record.step - 1]["loss"]
        tol = max(3 * (hi - lo), 0.1 * abs(hi))
        outside = not (lo - tol <= record.loss <= hi + tol)
        point = {"step": record.step, "loss": record.loss, "golden": [lo, hi]}
        streak = self.tally("out", point if outside else None, self.MIN_STEPS, in_a_row=True)
        if streak:
            first = streak[0]
            self.report_once("out", ctx, "loss", "loss",
                             f"from step {first['step']} the loss ({first['loss']:.4g}) left the envelope of the "
                             f"known-good runs ({first['golden'][0]:.4g}..{first['golden'][1]:.4g}) for "
                             f"{self.MIN_STEPS} steps in a row", {"steps": streak}, confidence=0.3)


# the monitors against golden runs, resumed segments and other ranks live beside these (registered on import)
from faultbench.detectors.blackbox import monitors_state  # noqa: E402,F401

# registered after monitors_state's detectors: the suite's order (report order among ties) stays as it was

@register
class StepLocalBackward(BlackBoxDetector):
    """A step's backward differentiates that step's forwards only (contract ``loss.state.step-local``): the gradient
    of a training forward's logits arrives before the optimizer step that follows the forward. One that arrives
    after it comes from a loss still holding an earlier step's graph (a running loss kept as a tensor and
    backpropagated with ``retain_graph``: each step's update then carries every earlier step's gradient again), or,
    when the step had no forward of its own yet, from a backward the loop issues after the optimizer step it should
    have fed (that step stepped with the previous gradients, or none). Exact: no threshold, a gradient arrives late
    or it does not. Steps the scaler skipped fire no optimizer step and so move nothing here."""

    id = "bb_step_local_backward"
    family = "loss"
    description = "a backward reaches the graph of an earlier optimizer step (running loss tensor, backward after step)"

    def __init__(self) -> None:
        super().__init__()
        self._last_forward: int | None = None  # the step (ctx.step) of the latest training forward
        self._ended = False
        self._errors: list[str] = []  # raised by the hooks autograd calls (``guarded``), reported at the next hook

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        self._raise_errors()
        self._last_forward = ctx.step
        target = logits if isinstance(logits, torch.Tensor) and logits.requires_grad else loss
        if not (isinstance(target, torch.Tensor) and target.requires_grad):
            return
        # the hook outlives the watch where the loop keeps the graph: it holds weak references only
        me, context, step = weakref.ref(self), weakref.ref(ctx), ctx.step
        target.register_hook(guarded(lambda grad: _late_gradient(me, context, step), self._errors))

    def on_end(self, ctx: WatchContext) -> None:
        self._ended = True
        self._raise_errors()

    def _raise_errors(self) -> None:
        if self._errors:  # the watch reports it as this detector's error
            raise RuntimeError(f"judging when a gradient arrived: {self._errors[0]}")

    def late(self, ctx: WatchContext, produced: int) -> None:
        """The gradient of a forward of step ``produced`` arrived during step ``ctx.step``."""
        if self._ended or self.findings:
            return
        evidence = {"forward_step": produced, "backward_step": ctx.step}
        if self._last_forward == ctx.step:  # this step made a forward of its own: the loss also holds an older one
            self.report(ctx, "loss", "loss",
                        f"the backward of step {ctx.step} also differentiated the forward of step {produced}: the loss "
                        "carries an earlier step's graph (a running loss summed as a tensor and backpropagated with "
                        "retain_graph?), so every update adds earlier steps' gradients again; accumulate "
                        "loss.item() for logging and backpropagate only the current step's loss",
                        evidence, confidence=0.9)
        else:
            self.report(ctx, "optimizer", "optimizer",
                        f"the gradient of step {produced}'s forward arrived after the optimizer had stepped (step "
                        f"{ctx.step} began without a forward): the loop calls backward after optimizer.step, so each "
                        "step applies the previous step's gradients (the first, none); call loss.backward() before "
                        "optimizer.step()", evidence, confidence=0.9)


def _late_gradient(detector_ref, ctx_ref, produced: int) -> None:
    """Tensor hook of ``StepLocalBackward`` (changes no gradient; ``guarded`` keeps its errors out of the backward)."""
    detector, ctx = detector_ref(), ctx_ref()
    if detector is not None and ctx is not None and ctx.step > produced and not ctx.probing:
        detector.late(ctx, produced)
