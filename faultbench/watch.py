"""``faultbench.watch``: the black-box detectors on any causal-LM training loop, attached through hooks.

    with faultbench.watch(model, optimizer, scheduler=sched, scaler=scaler) as w:
        for step in ...:
            ...  # the loop, unchanged
    print(w.to_json())

What it attaches (all removed on exit, also when the block raises; nothing of torch is monkeypatched):
- ``model``'s forward pre-hook and hook: each call's batch (input_ids / attention_mask / position_ids / labels,
  positional or keyword) and its logits and loss (a tuple, an object with .logits/.loss, or a tensor);
  a call with grad enabled in train mode is a training forward, any other an evaluation forward;
- on the logits of the first training forward after each optimizer step: a gradient hook (it fires when that
  backward begins, before any parameter's gradient is accumulated: is ``.grad`` still holding the previous step's
  gradient?); no per-parameter hook runs in the loop's steps, except under an enabled scaler a post-accumulate
  hook on the parameter whose gradient a backward completes last (the gradient norm as the backward left it,
  before clipping and unscaling: one fused norm per sampled backward);
- each training batch's fingerprint (detectors.blackbox.batches: a hash per row and per batch, and where the
  tokenizer's BOS/EOS sit), in the step's record;
- the optimizer's step pre-/post-hooks: the lr of each group, the gradient norm it steps with (on sampled steps:
  ``WatchContext.sampled_step``, the first 4, then every 4th), the scaler's scale; one ``StepRecord`` per step;
- on the logits of each training forward (when a detector takes ``on_backward``, or the model returned no loss):
  a gradient hook giving d loss / d logits (divided by an enabled scaler's scale) to ``on_backward``; from it
  the loss the loop differentiated (sum of weight x NLL over the positions, detectors.blackbox.gradients) fills
  the step's loss when no loss was observed, on the watch's first ``IMPLIED_LOSS_DENSE`` steps (where the gradient
  detectors analyse the same gradients: no extra cost) and then every ``IMPLIED_LOSS_EVERY``-th (the others keep
  None: two passes over the logits cost a few % of a small model's step).
Detector errors never reach the loop: they are kept in the report. ``observe(loss=...)`` gives the loss of a
loop whose model does not return it; ``observe(eval_loss=...)`` the evaluation loss the loop reports (checked
against the evaluation forwards' own next-token NLL).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import sys
import time
from pathlib import Path

import torch

from faultbench.detectors.api import Finding, NotApplicable, all_detectors, rank_findings
from faultbench.detectors.blackbox.api import BlackBoxDetector, StepRecord, WatchContext, black_box_ids
from faultbench.detectors.blackbox.batches import FRACTIONS as LAYOUT_FRACTIONS
from faultbench.detectors.blackbox.batches import (
    batch_hash,
    document_hashes,
    fingerprint,
    layout_fractions,
)
from faultbench.detectors.blackbox.conventions import Conventions
from faultbench.detectors.blackbox.gradients import implied_loss as implied_loss_of
from faultbench.detectors.blackbox.optimizer_numerics import WeightSampler, stepped_groups
from faultbench.guard import callable_module, caller_place, crash_of, object_place, watched_crash

# the names a forward's arguments go by, mapped to the batch keys detectors read
_ARG_NAMES = {"input_ids": "input_ids", "idx": "input_ids", "tokens": "input_ids", "x": "input_ids",
              "input": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
              "labels": "labels", "targets": "labels", "y": "labels"}


def normalize_call(positional: tuple[str, ...] | None, args: tuple, kwargs: dict) -> dict:
    """A forward's arguments as {"input_ids", "attention_mask"?, "position_ids"?, "labels"?} tensors: positional
    arguments named by ``positional`` (the forward's parameters that take them, in order; ``_positional``), else
    the first integer tensor is the input ids."""
    named = dict(zip(positional, args, strict=False)) if positional else {}  # *args past the names
    named.update(kwargs)
    batch = {_ARG_NAMES[k]: v for k, v in named.items() if k in _ARG_NAMES and isinstance(v, torch.Tensor)}
    if "input_ids" not in batch:
        ids = next((a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point()), None)
        if ids is not None:
            batch["input_ids"] = ids
    return batch


def split_output(output) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logits, loss) of a forward's return value: an object with .logits/.loss, a tuple (logits first, a
    0-dim loss anywhere), or the logits tensor itself."""
    logits, loss = getattr(output, "logits", None), getattr(output, "loss", None)
    if isinstance(output, (tuple, list)):
        tensors = [t for t in output if isinstance(t, torch.Tensor)]
        logits = next((t for t in tensors if t.dim() >= 2 and t.is_floating_point()), None)
        loss = next((t for t in tensors if t.dim() == 0), None)
    elif isinstance(output, torch.Tensor):
        logits = output
    return logits, loss


def _unwrap_optimizer(optimizer):
    """The torch optimizer inside wrappers that hold it as ``.optimizer`` (accelerate's AcceleratedOptimizer):
    its step hooks are the ones that fire."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _positional(model: torch.nn.Module) -> tuple[str, ...] | None:
    """The names of the parameters of ``model.forward`` that positional arguments fill, in order; None when the
    signature cannot be read. Read once: binding each call's arguments to the signature costs tens of microseconds
    a forward."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)  # all before any *args
    return tuple(p.name for p in params if p.kind in kinds)


def _scalar(value) -> float:
    """A number the loop hands over, as a tensor or not."""
    return float(value.detach() if isinstance(value, torch.Tensor) else value)


def _nonzero(grad) -> bool:
    """Whether a .grad holds anything (NaN counts): one reduction."""
    return grad is not None and bool(grad.detach().any())


def _norm(tensors) -> float | None:
    """L2 norm over tensors, in one fused call (None when there are none)."""
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return None
    first = tensors[0]
    if all(t.dtype is first.dtype and t.device == first.device for t in tensors):  # the usual case: half the cost
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))))
    return float(torch.nn.utils.get_total_norm(tensors))


class Watch:
    """The context manager ``watch`` returns: hooks in, detectors fired, findings out.

    ``findings``: ranked Finding objects; ``not_applicable``: {detector: reason}; ``errors``: {detector: error};
    ``to_json()`` / ``report()``: the same as JSON and as text (printed at exit when ``report=True``)."""

    def __init__(self, model, optimizer, *, scheduler=None, scaler=None, tokenizer=None, golden=None,
                 detectors="black-box", rank=None, world_size=None, report=True, out=None, step=0, previous=None,
                 declare=None, junit=None, collate=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"faultbench.watch: model must be a torch.nn.Module, not {type(model).__name__}")
        inner = _unwrap_optimizer(optimizer)
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError("faultbench.watch: optimizer must be a torch.optim.Optimizer (or a wrapper holding one "
                            f"as .optimizer), not {type(optimizer).__name__}")
        for name, path in (("out", out), ("junit", junit)):
            if path is not None and not Path(path).parent.is_dir():
                raise ValueError(f"faultbench.watch: {name}={str(path)!r}: its folder does not exist")
        rank, world_size = _ranks(rank, world_size)
        self.ctx = WatchContext(model, inner, scheduler=scheduler, scaler=scaler,
                                tokenizer=tokenizer, golden=load_golden(golden), rank=rank, world_size=world_size,
                                conventions=Conventions.of(tokenizer, declare))
        # a resumed loop: the step it resumes at, and the watch of the segment before (what it trained on)
        self.ctx.step = self.ctx.start_step = int(step or 0)
        if previous is not None:
            prev = previous.ctx if isinstance(previous, Watch) else previous
            self.ctx.previous = prev
            self.ctx.batches_seen = dict(prev.batches_seen)
            self.ctx.train_rows = set(prev.train_rows)
        self._special = self.ctx.conventions.special
        self._collate = getattr(collate, "collate_fn", collate)  # what builds the batches (a DataLoader's collate_fn)
        self._batches: list[int] = []
        self._layout: dict | None = None
        self._stale_hooked = False  # the stale-gradient check is hooked on this step's first backward
        self._last_param = None  # under a scaler: the parameter whose gradient a backward completes last
        self._grad_handles: dict = {}
        self._eval_handles: list = []  # after exit: forward hooks for evaluations only (watch_evaluations)
        self._eval_call = False  # the forward in flight is an evaluation one (its hook time is not step time)
        self._metrics_call = False  # the forward in flight re-runs the step's training batch for its metrics
        self._callers: dict[bool, dict | None] = {}  # training (False) / evaluation (True) forwards -> their caller
        self._eval_docs = 0  # documents of the evaluation forwards since the last reported evaluation loss
        self._forward_hooks = (self._before_forward, self._after_forward)
        self._stale_check = self._guard(self._grad_arrives)  # hooked on a sampled step's first logits
        self.detectors = _instantiate(detectors)
        self._listeners: dict[tuple, list] = {}  # (hook, sparse step) -> [(detector, bound hook)] of the active ones
        self.print_report, self.out, self.junit = report, out, junit
        self.not_applicable: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self._handles: list = []
        self._positional = _positional(model)
        self._pending: dict | None = None  # the batch of the call in flight
        self._losses: list[float] = []
        self._implied: list[float] = []  # each backward's loss implied by the logits' gradient (no loss observed)
        self._micro = 0
        self._fresh = True  # no backward yet since the last optimizer step
        self._trainable = [p for p in self.ctx.optimizer_params() if p.requires_grad]  # groups fixed at enter
        self._arrived: set[int] = set()  # parameters whose gradient this backward has accumulated
        self._backward_norm: float | None = None  # the norm as the last complete backward left the gradients
        self._before: dict = {}
        self._weights = WeightSampler()
        self._scale: float | None = None  # the scaler's scale when last read
        self._skips_recorded = 0  # ctx.skipped_steps at the last StepRecord
        # seconds per detector in the loop's steps (a passive detector's: its overhead; a probe's there is counted
        # apart by the scorer) and elsewhere (start, end, evaluation), and the watch's own hook time under "watch"
        self.step_seconds: dict[str, float] = {}
        self.other_seconds: dict[str, float] = {}
        self._fired_s = 0.0
        self._firing = 0  # detectors running now: what they do to the model (a state_dict copy) is not the loop's
        self._saved_at: int | None = None  # the step of the last checkpoint save seen (``on_save`` once per step)
        self._crashed = False  # the loop raised out of the watched block

    # ---- public
    @property
    def findings(self) -> list[Finding]:
        """Ranked (most confident, then earliest), the user's code first: a finding whose place is an installed
        library's code (not a module's: ``_library_key``) comes after every other; those the golden acknowledges are
        left out (``acknowledged``)."""
        return self._partition()[0]

    @property
    def acknowledged(self) -> list[Finding]:
        """Findings about a library's code that the golden's known-good runs made too (``record_golden``): true,
        not the user's to fix, and not repeated in ``findings`` or the report."""
        return self._partition()[1]

    def _partition(self) -> tuple[list[Finding], list[Finding]]:
        """(findings, acknowledged), each ranked; the findings about library code after the user's."""
        known = {tuple(k) for k in (self.ctx.golden or {}).get("acknowledged") or ()}
        keyed = [(f, _library_key(f)) for f in rank_findings([f for d in self.detectors for f in d.findings])]
        kept = sorted((pair for pair in keyed if pair[1] not in known), key=lambda pair: pair[1] is not None)
        return [f for f, _ in kept], [f for f, key in keyed if key in known]

    @property
    def attached(self) -> bool:
        """Whether the hooks are in (between enter and exit)."""
        return bool(self._handles)

    def observe(self, loss=None, eval_loss=None, across_ranks: bool = False, grad_norm=None) -> None:
        """What the loop computed itself. ``loss``: the loss of the current micro-batch, for loops whose model does
        not return one (ignored when its forward did: the model's own is kept). ``eval_loss``: the evaluation loss
        the loop reports (mean next-token cross-entropy of the evaluation it just ran, without label smoothing),
        checked against the evaluation forwards the watch saw since the last training forward;
        ``across_ranks=True``: the value covers every rank's share of the evaluation (gathered, as Trainer's
        ``eval_loss``) and every rank calls ``observe`` with it. ``grad_norm``: the norm the loop reports for the
        gradients of the step it just took (the norm it clipped), after the step."""
        if loss is not None and len(self._losses) < self._micro:  # the forward returned none for this micro-batch
            self._losses.append(_scalar(loss))
        if eval_loss is not None:
            if self.ctx.history:  # the evaluation just reported: how many documents it covered
                record = self.ctx.history[-1]
                record.eval_sizes = [*(record.eval_sizes or []), self._eval_docs]
            self._eval_docs = 0
            self._fire("on_eval_loss", self.ctx, _scalar(eval_loss), across_ranks)
        if grad_norm is not None:
            self._fire("on_grad_norm", self.ctx, _scalar(grad_norm))

    def to_dict(self) -> dict:
        """The report as data, and what a golden is made of: the step records kept ("history", the last
        ``StepHistory.LIMIT``), how many were taken ("recorded"), and whether the loop raised ("crashed")."""
        return {"steps": self.ctx.step, "findings": [f.to_dict() for f in self.findings],
                "acknowledged": [f.to_dict() for f in self.acknowledged],
                "not_applicable": dict(self.not_applicable), "errors": dict(self.errors),
                "history": [dataclasses.asdict(r) for r in self.ctx.history],
                "recorded": self.ctx.history.recorded, "crashed": self._crashed}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def to_junit(self) -> str:
        """The result as JUnit XML (``faultbench.junit``): a detector per test case, a finding per failure."""
        from faultbench.junit import junit_xml

        return junit_xml([d.id for d in self.detectors], self.to_dict())

    def report(self) -> str:
        """The readable report: ranked findings, then each not-applicable detector once, then detector errors."""
        findings = self.findings
        lines = [f"faultbench.watch: {len(findings) or 'no'} finding{'s' * (len(findings) != 1)} "
                 f"over {self.ctx.step} optimizer steps"]
        for i, f in enumerate(findings, 1):
            # "found at": the steps the loop had taken when the detector concluded; a message may quote the step
            # its evidence began at
            lines.append(f"{i:>2}. [{f.subsystem}] {f.where}{_whose(f)} (found at step {f.step}, {f.detector}, "
                         f"confidence {f.confidence:.2f}): {f.message}")
        known = len(self.acknowledged)
        if known:
            lines.append(f"acknowledged: {known} finding{'s' * (known != 1)} about library code that the golden's "
                         "known-good runs made too (w.acknowledged lists them)")
        lines += _not_applicable_lines(self.not_applicable)
        lines += [f"detector error: {d}: {err}" for d, err in self.errors.items()]
        return "\n".join(lines)

    def start(self) -> Watch:
        """The ``with`` block's entry, for a loop that is not one block: ``w = watch(...).start()``, then
        ``w.stop()`` (in a ``finally``, passing the loop's exception if it raised)."""
        return self.__enter__()

    def stop(self, exc: BaseException | None = None) -> None:
        """The ``with`` block's exit: normally, or with the loop's exception ``exc`` (located, never raised here)."""
        self.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc is not None else None)

    # ---- the context manager
    def __enter__(self) -> Watch:
        if self.attached:  # nested `with w:` on one watch: every hook would fire twice
            raise RuntimeError("faultbench.watch: this watch is already watching (a `with` of it is open); "
                               "one watch watches one loop at a time")
        self._attach()
        if not self.ctx.start_step and self.ctx.previous is None:  # a fresh run: the weights as initialized
            self.ctx.initial = self.ctx.initial_values()
        self._fire("on_start", self.ctx)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._crashed = exc is not None
        try:
            if exc is None:
                self._guard(self._track_scale)()  # a skip at the last step shows only in the scale after it
                self._fire("on_end", self.ctx)
            else:
                self._fire("on_crash", self.ctx, self._crash_of(exc))
            self._guard(self._name_code)()
        finally:
            self._detach()
        for name, path, text in (("out", self.out, self.to_json), ("junit", self.junit, self.to_junit)):
            if path is None:
                continue
            try:
                Path(path).write_text(text())
            except OSError as e:
                if exc is None:
                    raise
                # the loop's own exception is what the user must see: this is said beside it, never instead
                print(f"faultbench.watch: could not write {name}={path}: {e}", file=sys.stderr)
        if self.print_report:
            print(self.report(), file=sys.stderr)
        return False  # the user's exception propagates unchanged

    # ---- hooks
    def _attach(self) -> None:
        model, optimizer = self.ctx.model, self.ctx.optimizer
        self._handles += [model.register_forward_pre_hook(self._guard(self._before_forward), with_kwargs=True),
                          model.register_forward_hook(self._guard(self._after_forward)),
                          optimizer.register_step_pre_hook(self._guard(self._before_step)),
                          optimizer.register_step_post_hook(self._guard(self._after_step))]
        # a state read or loaded between steps by the loop (not by a detector) is a checkpoint being saved or restored
        checkpointing = self._guard(self._checkpointing)
        self._handles += [model.register_state_dict_pre_hook(self._guard(self._saving)),
                          model.register_load_state_dict_pre_hook(checkpointing),
                          optimizer.register_state_dict_pre_hook(checkpointing),
                          optimizer.register_load_state_dict_pre_hook(checkpointing)]
        if self.ctx.scaler_enabled:  # the backward's norm is read only where clipping before unscale_ is possible
            self._grad_handles = {id(p): p.register_post_accumulate_grad_hook(self._guard(self._grad_accumulated))
                                  for p in self._trainable}
            self._handles += list(self._grad_handles.values())

    def _name_code(self) -> None:
        """Each finding whose place is an object of the loop gets that object's place in code (evidence "code",
        ``faultbench.guard.object_place``): a module path its class's forward, "scheduler" its schedule function;
        "loss" and "eval" the code that called the model for training and for evaluation forwards (where the loss is
        computed or asked for: the user's step function, Trainer's ``compute_loss``); "batch" the loop's collate
        function (``collate=``), when it is the user's code."""
        modules = dict(self.ctx.model.named_modules())
        lambdas = getattr(self.ctx.scheduler, "lr_lambdas", None) or [None]
        for finding in (f for d in self.detectors for f in d.findings if f.evidence.get("code") is None):
            if finding.where in ("loss", "eval"):  # made where the model is called: training or evaluation forwards
                place = self._callers.get(finding.where == "eval")
            elif finding.where == "scheduler":
                place = object_place(lambdas[0]) if lambdas[0] is not None else None
            elif finding.where == "batch":  # the loop's own collate function; a library's only carries the user's data
                place = object_place(self._collate) if self._collate is not None else None
                place = place if place is not None and place["library"] is None else None
            else:  # a module path ("" is the model itself); None or another place of the loop: no object
                obj = modules.get(finding.where) if finding.where is not None else None
                place = object_place(obj) if obj is not None else None
            if place is not None:
                finding.evidence["code"] = place

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def watch_evaluations(self) -> None:
        """After exit: keep the model's forward hooks for evaluation forwards only (no grad or eval mode), so an
        evaluation run after training (``trainer.evaluate()``) reaches the detectors' ``on_eval_forward``; its
        findings join ``findings`` (not the report already printed). ``stop_watching_evaluations`` removes them."""
        if self.attached or self._eval_handles:
            return
        model = self.ctx.model
        self._eval_handles = [model.register_forward_pre_hook(self._guard(self._before_forward), with_kwargs=True),
                              model.register_forward_hook(self._guard(self._after_forward))]

    def crashed(self, exc: BaseException) -> None:
        """After exit, while evaluations are watched (``watch_evaluations``): the loop crashed in one (a
        ``trainer.evaluate()`` after ``train()`` raised ``exc``); the detectors' ``on_crash`` locate it and their
        findings join ``findings``. Call it from the ``except`` around that evaluation."""
        if self._eval_handles:
            self._fire("on_crash", self.ctx, self._crash_of(exc))

    def _crash_of(self, exc: BaseException) -> dict:
        """``on_crash``'s record of ``exc``: its type, message, frames and code place (``faultbench.guard.crash_of``),
        and the phase it interrupted; a guard around the watch leaves it to the watch."""
        watched_crash(exc)
        return {**crash_of(exc), "phase": self.ctx.phase}

    def stop_watching_evaluations(self) -> None:
        for handle in self._eval_handles:
            handle.remove()
        self._eval_handles = []

    def _guard(self, fn):
        """``fn`` as a hook that never raises into the loop (its error is kept as the watch's own) and keeps quiet
        during a detector's probe."""
        def hook(*args):
            if self.ctx.probing:
                return None
            start, fired = time.perf_counter(), self._fired_s
            try:
                fn(*args)
            except Exception as e:  # the user's loop must go on: report it instead
                self.errors.setdefault(f"watch.{fn.__name__.lstrip('_')}", f"{type(e).__name__}: {e}")
            own = time.perf_counter() - start - (self._fired_s - fired)
            # an evaluation forward's hooks run outside the training steps: not the loop's overhead
            timer = self.other_seconds if fn in self._forward_hooks and self._eval_call else self.step_seconds
            timer["watch"] = timer.get("watch", 0.0) + own
            return None

        return hook

    def _checkpointing(self, *args) -> bool:
        """A state read or load: between steps by the loop, the phase becomes "checkpoint" (True)."""
        if not self._firing and self.ctx.phase in ("setup", "between steps", "checkpoint"):
            self.ctx.phase = "checkpoint"
            return True
        return False

    def _saving(self, *args) -> None:
        """The model's state read by the loop between steps: a checkpoint saved, once per step (``on_save``)."""
        if self._checkpointing() and self._saved_at != self.ctx.step:
            self._saved_at = self.ctx.step
            self._fire("on_save", self.ctx)

    def _metrics_forward(self, batch: dict) -> bool:
        """A forward without gradients on the very batch this step trained on, before the step: the loop computing
        metrics of its training batch (TRL's SFTTrainer does, for its token accuracy), not an evaluation."""
        ids, last = batch.get("input_ids"), (self.ctx.last_batch or {}).get("input_ids")
        return bool(self._micro) and isinstance(ids, torch.Tensor) and isinstance(last, torch.Tensor) \
            and ids.shape == last.shape and bool(torch.equal(ids, last))

    def _before_forward(self, module, args, kwargs) -> None:
        self._eval_call = not (torch.is_grad_enabled() and module.training)
        self._pending = self.ctx.pending_batch = normalize_call(self._positional, args, kwargs)
        self._metrics_call = self._eval_call and self._metrics_forward(self._pending)
        self.ctx.phase = "eval forward" if self._eval_call else "forward"
        if self._metrics_call:
            return
        if self._eval_call not in self._callers:  # the code that calls the model, once a kind: where its loss is made
            self._callers[self._eval_call] = caller_place(2)
        if self.ctx.rng_at_start is None and torch.is_grad_enabled() and module.training:
            self.ctx.rng_at_start = torch.get_rng_state()  # the global RNG as the first training forward finds it

    def _after_forward(self, module, args, output) -> None:
        batch, self._pending = self._pending or {}, None
        logits, loss = split_output(output)
        training = torch.is_grad_enabled() and module.training
        ids = batch.get("input_ids")
        decoding = isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 1  # one token a call
        self.ctx.phase = "backward" if training else "generation" if decoding else "evaluation"
        if training:
            if not self.attached:  # after exit, only evaluations are watched
                return
            self._track_scale()
            self._micro += 1
            if loss is not None and loss.numel() == 1:
                self._losses.append(float(loss.detach()))
            self.ctx.last_batch = batch
            self._fingerprint(batch)
            if self._fresh and not self._stale_hooked and isinstance(logits, torch.Tensor) and logits.requires_grad \
                    and self.ctx.sampled_step:  # a forgotten zero_grad leaves stale gradients on every step alike
                self._stale_hooked = True
                logits.register_hook(self._stale_check)
            self._fire("on_forward", self.ctx, batch, logits, loss)
            # the loss the backward differentiates, when the model returns none: on the dense steps, then sparsely
            implied_loss = loss is None and self.ctx.sampled_every(IMPLIED_LOSS_EVERY, IMPLIED_LOSS_DENSE)
            if isinstance(logits, torch.Tensor) and logits.requires_grad and (implied_loss or self._listening(
                    "on_backward")):
                self._hook_logits(batch, logits, implied_loss)
        elif not self._metrics_call:
            self._eval_fingerprint(batch)
            self._fire("on_eval_forward", self.ctx, batch, logits)

    def _hook_logits(self, batch: dict, logits: torch.Tensor, implied_loss: bool) -> None:
        """A gradient hook on this forward's logits: the backward's d loss / d logits, unscaled, to ``on_backward``
        and, with ``implied_loss``, to the step's implied loss. Holds a detached alias only."""
        detached = logits.detach()

        def logits_grad(grad):
            grad = grad.detach()
            if self.ctx.scaler_enabled:
                scale = float(self.ctx.scaler.get_scale())
                if scale != 1.0:
                    grad = grad / scale
            self._fire("on_backward", self.ctx, batch, detached, grad)
            if implied_loss:  # after the detectors: the analysis one of them made of this gradient is reused
                loss = implied_loss_of(detached, grad, batch)
                if loss is not None:
                    self._implied.append(loss)

        logits.register_hook(self._guard(logits_grad))

    def _track_scale(self) -> None:
        """Count the scaler's skipped steps: each skip halves its scale (backoff) before the next forward, and a
        skipped step fires no optimizer hook, so the scale is read at every training forward and step."""
        if not self.ctx.scaler_enabled:
            return
        scale = float(self.ctx.scaler.get_scale())
        if self._scale is not None and scale < self._scale:
            self.ctx.skipped_steps += round(math.log2(self._scale / scale))
        self._scale = scale

    def _fingerprint(self, batch: dict) -> None:
        """The training batch's hash (StepRecord.batches), its rows' (ctx.train_rows) and its layout counts."""
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() not in (1, 2):
            return
        room = len(self.ctx.train_rows) < self.ctx.MAX_ROWS
        rows, counts, packed = fingerprint(ids, batch.get("attention_mask"), self._special, documents=room)
        self._batches.append(batch_hash(rows))
        if room:  # rows, and the documents packed rows hold
            self.ctx.train_rows.update(rows, packed)
        if self._layout is None:
            self._layout = counts
        else:
            for key, value in counts.items():
                self._layout[key] = max(self._layout[key], value) if key == "len" else self._layout.get(key, 0) + value

    # a one-token row is a decoding step, not a document; short documents count: duplicates among them are what a
    # leaky split shares with training first
    EVAL_MIN_TOKENS = 2

    def _eval_fingerprint(self, batch: dict) -> None:
        """An evaluation batch's documents (rows of EVAL_MIN_TOKENS real tokens or more; a packed row's documents)
        that the run trained on, as rows or as documents of packed rows: counted on the last step's record
        (``StepRecord.evals``: [evaluated, of them trained on])."""
        ids = batch.get("input_ids")
        if not self.ctx.history or not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2:
            return
        hashes = document_hashes(ids, batch.get("attention_mask"), self.EVAL_MIN_TOKENS, self._special.get("eos"))
        if not hashes:
            return
        record = self.ctx.history[-1]
        self._eval_docs += len(hashes)
        seen = sum(h in self.ctx.train_rows for h in hashes)
        record.evals = [(record.evals or [0, 0])[0] + len(hashes), (record.evals or [0, 0])[1] + seen]

    def _grad_arrives(self, grad) -> None:
        """The first gradient of the first backward after a step (the logits', before any parameter's is
        accumulated): does any .grad still hold the previous step's?"""
        if not self._fresh:
            return
        self._fresh = False
        params = self._trainable
        # a forgotten zero_grad leaves every gradient: the first and last parameters tell (cheap), all are then read
        if not params or not any(_nonzero(p.grad) for p in (params[0], params[-1])):
            self.ctx.stale_grads = None
            return
        stale = [p for p in params if _nonzero(p.grad)]
        self.ctx.stale_grads = {"params": len(stale), "of": len(params), "first": self.ctx.param_owner(stale[0]),
                                "norm": _norm(p.grad for p in stale)}

    def _grad_accumulated(self, param) -> None:
        """When the backward has accumulated every trainable parameter's gradient: their norm, in one call (the
        step sees them only after clipping and unscaling). Measured only under an enabled scaler, where clipping
        before unscaling is possible (the one reader, bb_clip_scaled)."""
        if self._last_param is not None:  # learned: only the backward's last gradient completes it
            if param is self._last_param and self.ctx.sampled_step:
                self._backward_norm = _norm(p.grad for p in self._trainable if p.grad is not None)
            return
        self._arrived.add(id(param))
        if len(self._arrived) == len(self._trainable):
            self._backward_norm = _norm(p.grad for p in self._trainable)
            self._arrived.clear()
            self._last_param = param
            for pid, handle in self._grad_handles.items():  # from now on one hook, on the backward's last parameter
                if pid != id(param):
                    handle.remove()

    def _before_step(self, optimizer, args, kwargs) -> None:
        scaler, sampled = self.ctx.scaler, self.ctx.sampled_step
        self.ctx.phase = "step"
        self.ctx.backward_seen = not self._fresh
        self._before = {"lrs": [float(g["lr"]) for g in optimizer.param_groups], "sampled": sampled,
                        # a fused norm over every gradient costs ~1% of a small model's step: sampled steps only
                        "grad_norm": _norm(p.grad for p in self._trainable if p.grad is not None) if sampled else None,
                        "backward_norm": self._backward_norm,
                        "scale": float(scaler.get_scale()) if self.ctx.scaler_enabled else None}
        if sampled:  # the update ratio: a fixed sample of each stepped tensor, read again after the step
            groups = stepped_groups(optimizer)
            self._before["weights"] = (groups, self._weights.sample(groups))
        self._fire("on_before_step", self.ctx)

    def _after_step(self, optimizer, args, kwargs) -> None:
        ctx, before = self.ctx, self._before
        ctx.phase = "between steps"
        self._track_scale()
        skipped, self._skips_recorded = ctx.skipped_steps - self._skips_recorded, ctx.skipped_steps
        loss = sum(self._losses) / len(self._losses) if self._losses else None
        if loss is None and self._implied:  # the loss the backwards differentiated, per optimizer step taken
            loss = sum(self._implied) / (1 + skipped)
        ctx.step += 1
        record = StepRecord(ctx.step, loss, before["lrs"], before["grad_norm"], before["backward_norm"],
                            before["scale"], skipped, self._micro, self._batches, self._layout,
                            ctx.optimizer_count(), None if ctx.history else ctx.group_config(),
                            model=None if ctx.history else ctx.model_structure(), sampled=before["sampled"],
                            updates=self._weights.ratios(*before.pop("weights")) if "weights" in before else None,
                            init=None if ctx.history else ctx.initial)
        for h in self._batches:
            if len(ctx.batches_seen) < ctx.MAX_ROWS:
                ctx.batches_seen.setdefault(h, ctx.step)
        ctx.rng_at_step = torch.get_rng_state()  # a 5 KB copy; compared only at a resume
        ctx.history.append(record)
        self._batches, self._layout, self._stale_hooked = [], None, False
        self._losses, self._implied, self._micro, self._fresh = [], [], 0, True
        self._backward_norm = None
        self._arrived.clear()
        self._fire("on_after_step", ctx, record)
        ctx.stale_grads = None  # measured again at the next sampled step's first backward

    # ---- detectors
    def _listening(self, hook: str) -> list:
        """[(detector, bound hook)] of the detectors to call for ``hook`` now: those that define it and are still
        active (listed once per hook: every training forward and step fires, so the loop over all detectors is not
        redone each time), less those that retired from it, and on a step that is not sampled
        (``WatchContext.sampled_step``) less the ``BlackBoxDetector.sampled`` ones' forward and backward hooks."""
        sparse = hook in _SAMPLED_HOOKS and not self.ctx.sampled_step  # sampled detectors skip this step
        listeners = self._listeners.get((hook, sparse))
        if listeners is None:
            listeners = self._listeners[hook, sparse] = [
                (det, getattr(det, hook)) for det in self.detectors
                if getattr(type(det), hook) is not getattr(BlackBoxDetector, hook) and not (sparse and det.sampled)
                and hook not in det.retired and det.id not in self.errors and det.id not in self.not_applicable]
        return listeners

    def _fire(self, hook: str, *args) -> None:
        """Call ``hook`` on the detectors ``_listening`` to it."""
        timer = self.step_seconds if hook in _STEP_HOOKS else self.other_seconds
        end = time.perf_counter()
        self._firing += 1
        try:
            self._fire_each(hook, timer, end, args)
        finally:
            self._firing -= 1

    def _fire_each(self, hook: str, timer: dict, end: float, args: tuple) -> None:
        """``_fire``'s loop: each listening detector called and timed from the previous one's end."""
        for det, method in self._listening(hook):
            start = end  # one clock reading between two detectors: each is timed to the next one's start
            try:
                method(*args)
                if hook in det.retired:
                    self._listeners.clear()  # relisted without it
            except NotApplicable as e:
                self.not_applicable[det.id] = str(e)
                self._listeners.clear()  # relisted without it
            except Exception as e:  # a detector's bug must not break the user's loop
                self.errors[det.id] = f"{hook}: {type(e).__name__}: {e}"
                self._listeners.clear()
            finally:
                end = time.perf_counter()
                seconds = end - start
                self._fired_s += seconds
                timer[det.id] = timer.get(det.id, 0.0) + seconds  # a probe's too: inside a step, not the loop's time


# the implied loss costs two passes over the logits (~4% of a small model's step): on a watch's first steps (the
# gradient detectors' analysis of the same backwards gives it), then every IMPLIED_LOSS_EVERY-th step
IMPLIED_LOSS_DENSE = 2
IMPLIED_LOSS_EVERY = 8
_STEP_HOOKS = ("on_forward", "on_backward", "on_before_step", "on_after_step")  # fired inside the loop's training steps
_SAMPLED_HOOKS = ("on_forward", "on_backward")  # a BlackBoxDetector.sampled detector's, fired on sampled steps only


def _ranks(rank, world_size) -> tuple[int, int]:
    """The given rank/world size, else torch.distributed's when it is initialized, else 0 / 1."""
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    if rank is None:
        rank = torch.distributed.get_rank() if dist else 0
    if world_size is None:
        world_size = torch.distributed.get_world_size() if dist else 1
    return rank, world_size


def _instantiate(detectors) -> list[BlackBoxDetector]:
    """Fresh detectors from "black-box" (every registered one of the track) or a list of their ids."""
    ids = black_box_ids() if detectors == "black-box" else list(detectors)
    registry = all_detectors()
    unknown = [d for d in ids if d not in registry or registry[d].track != "black-box"]
    if unknown:
        raise ValueError(f"not black-box detectors: {', '.join(unknown)} (known: {', '.join(black_box_ids())})")
    return [registry[d]() for d in ids]


def _library_key(finding: Finding | dict) -> tuple[str, str] | None:
    """(detector, qualified name) of a finding whose place in code is an installed library's and not a module's
    forward (a module, whatever its class, is a part of the user's model: a Trainer's loss, a schedule function or a
    collator is the library's); None for the user's, and for a comparison with the user's own known-good runs
    (``BlackBoxDetector.against_golden``: a change the user made, wherever the code that runs it lives)."""
    f = finding.to_dict() if isinstance(finding, Finding) else finding
    code = (f.get("evidence") or {}).get("code")
    relative = getattr(all_detectors().get(f["detector"]), "against_golden", False)
    library = isinstance(code, dict) and code.get("library") and not code.get("method_of_module") and not relative
    return (f["detector"], code["qualname"]) if library else None


def _whose(finding: Finding) -> str:
    """" (transformers 5.23.0's code)" when the finding's place in code is an installed library's, not the user's."""
    code = finding.evidence.get("code")
    return f" ({code['library']}'s code)" if isinstance(code, dict) and code.get("library") else ""


def _not_applicable_lines(reasons: dict[str, str], width: int = 110) -> list[str]:
    """The not-applicable checks in a few lines: one per reason, its checks listed (each reason cut to ``width``;
    ``Watch.not_applicable`` keeps them whole)."""
    by_reason: dict[str, list[str]] = {}
    for detector, why in reasons.items():
        by_reason.setdefault(why, []).append(detector)
    if not by_reason:
        return []
    lines = [f"not applicable: {len(reasons)} check{'s' * (len(reasons) != 1)} (w.not_applicable says each why)"]
    for why, detectors in by_reason.items():
        short = why if len(why) <= width else why[: width - 3] + "..."
        lines.append(f"  {', '.join(detectors)}: {short}")
    return lines


def watch(model, optimizer, **kwargs) -> Watch:
    """Watch a training loop: ``with watch(model, optimizer, scheduler=, scaler=, tokenizer=, golden=,
    detectors="black-box", rank=, world_size=, report=True, out=None, junit=None, declare=None, collate=None) as w:
    ...``. See ``Watch``; ``out``: the result as JSON at exit, ``junit``: as JUnit XML (a CI gate); ``collate``: the
    function (or DataLoader) that builds the batches, named by findings about a batch;
    ``declare``: the loop's conventions (detectors.blackbox.conventions), e.g. {"positions": "relative",
    "total_steps": 1000, "pad_id": 0}."""
    return Watch(model, optimizer, **kwargs)


# ---- golden envelopes: the user's own known-good runs
def record_golden(runs, path=None) -> dict:
    """The envelope of finished known-good runs (``Watch`` objects, or their histories: lists of StepRecord or of
    its dicts; a resumed run's history is its segments' in order). Written as JSON to ``path`` when given::

        {"runs": N,
         "steps": [{"loss": [lo, hi], "grad_norm": [lo, hi], "lrs": [[lo, hi] per param group],
                    "updates": [[lo, hi] per param group] (StepRecord.updates)}, ...],
         "final_loss": [lo, hi],
         "scaled": every run stepped under an enabled loss scaler,
         "groups": the optimizer's param groups as configured (WatchContext.group_config), when all runs agree,
         "model": the model's parameters as built (WatchContext.model_structure), when all runs agree,
         "init": {name: {"std": [lo, hi], "mean": [lo, hi], "numel": n}} of each parameter and floating buffer as
                 the runs started (StepRecord.init), when every run started fresh,
         "layout": {"bos" | "bos2" | "eos" | "full_eos" | "idle": [lo, hi] of each run's fraction of its rows, of
                    its full-width rows, of its padded cells (detectors.blackbox.batches.FRACTIONS)}, "max_len": int,
         "repeats": the most training batches any run trained on twice,
         "eval_overlap": the largest fraction of evaluated documents that a run had trained on,
         "acknowledged": [[detector, qualified name], ...] of the findings about an installed library's code that a
                         run given as a Watch or its saved dict made (true, not the user's: a watch with this golden
                         lists them under ``acknowledged``, not among its findings)}

    A span is None where no run measured it; keys of fields no run recorded are None.
    """
    histories = [_history(run) for run in runs]
    library = {key for run in runs for f in _run_findings(run) if (key := _library_key(f)) is not None}
    if not histories or not all(histories):
        raise ValueError("record_golden needs at least one finished run with optimizer steps")
    steps = min(len(h) for h in histories)

    def span(values):
        values = [v for v in values if v is not None and math.isfinite(v)]
        return [min(values), max(values)] if values else None

    def per_group(i, key):  # [lo, hi] per param group at step i of every run (groups all runs have)
        groups = min(len(getattr(h[i], key) or []) for h in histories)
        return [span(getattr(h[i], key)[g] for h in histories) for g in range(groups)]

    golden = {"runs": len(histories),
              "steps": [{"loss": span(h[i].loss for h in histories),
                         "grad_norm": span(h[i].grad_norm for h in histories), "lrs": per_group(i, "lrs"),
                         "updates": per_group(i, "updates")} for i in range(steps)],
              "final_loss": span(h[-1].loss for h in histories),
              "scaled": all(r.scale is not None for h in histories for r in h)}
    golden["groups"], golden["model"] = _agreed(histories, "groups"), _agreed(histories, "model")
    golden["init"] = _init_spans(histories)
    layouts = [[r.layout for r in h if r.layout] for h in histories]
    if all(layouts):
        fractions = [layout_fractions(run) for run in layouts]
        golden["layout"] = {k: span(run.get(k) for run in fractions) for k in LAYOUT_FRACTIONS
                            if all(k in lay for run in layouts for lay in run)}
        golden["max_len"] = max(lay["len"] for run in layouts for lay in run)
    else:
        golden["layout"], golden["max_len"] = None, None
    evals = [[sum(r.evals[i] for r in h if r.evals) for i in (0, 1)] for h in histories]
    golden["eval_overlap"] = max(seen / n for n, seen in evals) if all(n for n, _ in evals) else None
    sizes = [{str(r.step): r.eval_sizes for r in h if r.eval_sizes} for h in histories]
    golden["eval_sizes"] = sizes[0] if sizes[0] and all(s == sizes[0] for s in sizes) else None
    batches = [[b for r in h for b in r.batches] for h in histories]
    golden["repeats"] = max(len(b) - len(set(b)) for b in batches) if all(batches) else None
    golden["acknowledged"] = [list(key) for key in sorted(library)]
    if path is not None:
        Path(path).write_text(json.dumps(golden, indent=1))
    return golden


def _run_findings(run) -> list:
    """A known-good run's findings, acknowledged ones included (none for a bare history)."""
    if isinstance(run, Watch):
        return [*run.findings, *run.acknowledged]
    if isinstance(run, dict):
        return [*(run.get("findings") or []), *(run.get("acknowledged") or [])]
    return []


def _agreed(histories: list[list[StepRecord]], field: str):
    """A first-record-only ``field`` (``groups``, ``model``) when every run recorded the same value, else None."""
    values = [next((getattr(r, field) for r in h if getattr(r, field) is not None), None) for h in histories]
    return values[0] if values[0] is not None and all(v == values[0] for v in values) else None


def _init_spans(histories: list[list[StepRecord]]) -> dict | None:
    """{name: {"std": [lo, hi], "mean": [lo, hi], "numel": n}} over the runs' initial weights (``StepRecord.init``),
    for the tensors every run had at the same size; None unless every run started fresh."""
    inits = [h[0].init for h in histories]
    if not all(inits):
        return None
    names = [n for n in inits[0] if all(n in i and i[n][2] == inits[0][n][2] for i in inits)]
    return {n: {"std": [min(i[n][0] for i in inits), max(i[n][0] for i in inits)],
                "mean": [min(i[n][1] for i in inits), max(i[n][1] for i in inits)], "numel": inits[0][n][2]}
            for n in names}


def _history(run) -> list[StepRecord]:
    """A run's step records: a Watch's history, a saved watch's (``Watch.to_dict``, the ``out=`` JSON), or a
    recorded history (StepRecords or their dicts)."""
    if isinstance(run, Watch) and run.ctx.history.dropped:
        kept = run.ctx.history
        raise ValueError(f"record_golden needs a run's every step: this watch kept the last {len(kept)} of its "
                         f"{kept.recorded} step records (a golden run is a short one)")
    if isinstance(run, dict):
        return _saved_history(run)
    history = run.ctx.history if isinstance(run, Watch) else list(run)
    return [StepRecord(**r) if isinstance(r, dict) else r for r in history]


def _saved_history(saved: dict) -> list[StepRecord]:
    """The step records of a saved watch, refused (ValueError, one line) where it is no known-good run's."""
    history = saved.get("history")
    if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
        raise ValueError("holds no step history (a watch's out= JSON from before history was saved, or another file)")
    if saved.get("crashed"):
        raise ValueError("is a run that crashed: a golden is made of known-good runs")
    if saved.get("recorded", len(history)) != len(history):
        raise ValueError(f"kept the last {len(history)} of its {saved['recorded']} step records: a golden run is a "
                         "short one")
    fields = {f.name for f in dataclasses.fields(StepRecord)}
    try:
        return [StepRecord(**{k: v for k, v in r.items() if k in fields}) for r in history]
    except TypeError as e:  # a record without a field StepRecord requires
        raise ValueError(f"holds a step record StepRecord cannot read ({e})") from None


def golden_from_files(paths, out=None) -> dict:
    """``record_golden`` of watches saved with ``out=`` (``faultbench golden RUN.json ... --out golden.json``); a
    file that is missing, not JSON, or no known-good run is refused in one line naming it."""
    runs = []
    for path in paths:
        try:
            saved = json.loads(Path(path).read_text())
            if not isinstance(saved, dict):
                raise ValueError("is not a watch's out= JSON (an object)")
            runs.append(_saved_history(saved))
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return record_golden(runs, out)


def load_golden(golden) -> dict | None:
    """A golden envelope from a dict, a JSON file path, or None."""
    if golden is None or isinstance(golden, dict):
        return golden
    return json.loads(Path(golden).read_text())


callable_module(__name__, watch)
