"""The detector API: findings, the run context a detector sees, the hooks it may implement, the registry.

A detector is a class with a unique ``id`` that implements any of the ``on_*`` hooks. The harness
calls the hooks of every detector of a suite during a run (see ``harness/case.py`` for when each
fires) and collects what they ``report``. Honesty rules (tested in tests/detectors/test_honesty.py):
- a detector never receives the fault id or any fault metadata: the context holds only the run;
- detector modules import neither ``faults`` nor ``model``: they reach the run's code only through
  the context (``ctx.run``'s objects, ``ctx.seam(name)`` for the run's live function of a seam);
- they use no introspection that reaches the harness or the injection (stack frames, the garbage
  collector, the line cache, source of seams, the environment, caches of seam functions): what a probe
  may know of the code (which seam a traceback line lies in) the context answers (``seam_at``,
  ``raising_seam``);
- on every clean run variant every detector must stay silent.

A detector whose assumptions do not hold for a run (a component, a config field or a seam it probes is
absent, the model does not take the call it probes with) says so instead of guessing: it declares what
it needs (``needs_run``, ``needs_config``, ``needs_seams``), checked before its first hook, or raises
``NotApplicable`` from a hook (``require`` does both). The suite records the reason once and calls the
detector no more: a not-applicable detector is neither a finding nor a detector error.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import os
import random
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

SUBSYSTEMS = (
    "data", "collate", "mask", "position", "model", "loss",
    "optimizer", "precision", "checkpoint", "distributed", "eval",
)


DETECTOR_ENTRY_POINTS = "faultbench.detectors"  # installed packages' detectors: loaded with the built-in ones


class NotApplicable(Exception):
    """This detector's assumptions do not hold for the run; the message says which (one line)."""


def traceless(exc: BaseException, _seen: set | None = None) -> BaseException:
    """``exc`` (and the exceptions it was raised from) without tracebacks, to be kept: a traceback's frames hold
    the loop's locals (its last loss and graph) and, through its globals, everything the loop holds."""
    seen = set() if _seen is None else _seen
    seen.add(id(exc))
    exc.__traceback__ = None
    for linked in (exc.__cause__, exc.__context__):
        if linked is not None and id(linked) not in seen:
            traceless(linked, seen)
    return exc


_ABSENT = object()


def _lookup(obj, path: str):
    """``obj.a.b`` for the dotted ``path`` "a.b", or ``_ABSENT`` where an attribute is missing."""
    for name in path.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            return _ABSENT
    return obj


@dataclass(frozen=True)
class Finding:
    """One thing a detector found: when (optimizer steps completed), where (subsystem, seam), and why."""

    detector: str
    step: int | None
    subsystem: str
    seam: str | None
    message: str
    evidence: dict = field(default_factory=dict)
    confidence: float = 0.5  # 0..1: how sure the detector is of the location, used to rank findings
    where: str | None = None  # black-box: the user's name for the place (module path, "optimizer", "file.py:fn")

    def to_dict(self) -> dict:
        return {"detector": self.detector, "step": self.step, "subsystem": self.subsystem, "seam": self.seam,
                "message": self.message, "evidence": self.evidence, "confidence": self.confidence,
                "where": self.where}


# General facts about a run that a detector may use on any target. A run offers each as its own attribute
# of that name; the reference's run (``model/``, which does not change for this protocol) keeps it at the
# path given here. ``RunContext.fact`` reads them; a run that offers neither makes the detector not applicable.
FACTS = {
    "loss_floor": "corpus.loss_floor",  # Bayes-optimal nats per predicted token of the run's corpus
    "pad_id": "tokenizer.pad_id",  # the id the batches are padded with
    "vocab_size": "config.model.vocab_size",  # rows of the embedding / columns of the logits
    "precision": "config.train.precision",  # "fp32" | "bf16" | "fp16"
    "pad_side": "config.data.pad_side",  # "left" | "right": where collate puts the pads
    "accum": "config.train.accum",  # micro-batches per optimizer step
    "device": "config.train.device",  # where the run trains ("cpu", "cuda"), as torch.device takes it
    "bos_id": "tokenizer.bos_id",  # the id that opens each document
    "eos_id": "tokenizer.eos_id",  # the id that closes each document
    "unk_id": "tokenizer.unk_id",  # the unknown-token id
    "seq_len": "config.data.seq_len",  # the longest document a batch holds, in tokens
    "train_docs": "corpus.train",  # the training documents as the run tokenizes them (token-id lists; a prefix will do)
    "val_docs": "corpus.val",  # the validation documents, likewise
    "weight_decay": "config.train.weight_decay",  # the decoupled weight decay the user configured for matrices
    "lr": "config.train.lr",  # the configured peak learning rate
    "betas": "config.train.betas",  # the configured Adam betas
    "eps": "config.train.eps",  # the configured Adam epsilon
    "grad_clip": "config.train.grad_clip",  # the configured max gradient norm (0: no clipping)
    "head_dim": "config.model.head_dim",  # channels per attention head
    "max_positions": "config.model.max_positions",  # the longest sequence the model's positions cover
    "steps": "config.train.steps",  # the optimizer steps the run is configured for (the schedule's horizon)
    # step -> the LR the user's configuration declares for that optimizer step, by the documented semantics of the
    # stack's schedule option (computed by the target, not by the run's code); without it a detector falls back on
    # the reference's documented warmup + cosine
    "lr_schedule": "lr_schedule",
}

# The roles of any causal-LM training stack: what a component does, called one normalized way. A target offers
# each role it has as a ``Role`` (``RunContext.roles``); a white-box detector probes roles, never a target's seam
# names, and a finding about a role names the seam the role stands for. A role the run lacks makes the detector
# (or the check that needs it) not applicable. The normalized calls:
ROLES = {
    "encode": "(text) -> the token ids the stack's tokenizer gives a document's text (its special tokens added, "
              "nothing truncated)",
    "truncate": "(ids: a document's token ids, max_len, eos_id) -> ids: at most max_len, the prefix kept, ending in "
                "EOS where the document did",
    "collate": "(docs: token-id lists, pad_id, side 'left'|'right') -> dict of (B, T) int64 tensors: input_ids, "
               "attention_mask (1 on real tokens), labels (aligned with input_ids: the loss shifts; one ignore value "
               "outside the vocabulary on pads and on each row's first real token, which no position predicts) and, "
               "where the stack collates them, position_ids",
    "documents": "the code that turns the corpus into token-id documents (not called: its output is the train_docs "
                 "fact)",
    "batches": "the code that draws a step's micro-batches and has them collated (not called)",
    "forward": "(input_ids (B, T), attention_mask (B, T) or None, position_ids (B, T) or None) -> logits (B, T, V)",
    "loss": "(logits (B, T, V), labels (B, T) as collate makes them, num_targets: int | None = None) -> the "
            "next-token cross-entropy summed over the targets and divided by num_targets (default: the targets' count)",
    "count_targets": "(labels (B, T)) -> int: the number of targets `loss` scores",
    "token_loss": "(logits (N, V), targets (N,) with the ignore value, num_targets: int | None) -> the cross-entropy "
                  "summed over the non-ignored targets / num_targets, or their mean when None (the loss's last step)",
    "pad": "(docs: token-id lists, pad_id, side) -> dict with input_ids, attention_mask (B, T): each document at the "
           "side's edge, pad_id elsewhere, the mask 1 exactly on the document (collate's padding step)",
    "position_ids": "(attention_mask (B, T) 0/1, past_len: int = 0) -> position ids (B, T - past_len) of the last "
                    "columns: each row's real tokens counted 0, 1, ... from its first real token",
    "apply_rope": "(q, k (B, nh, T, hs), cos, sin (B, 1, T, hs // 2): each position's angles per frequency) -> (q, k) "
                  "rotated by those angles in the stack's channel layout",
    "decode": "(input_ids (B, T0) left-padded, attention_mask (B, T0), new: int) -> (tokens (B, new), logits (B, new, "
              "V)): greedy decoding with the stack's KV cache; step i's logits chose token T0 + i",
    "kv_append": "() -> a fresh one-layer KV cache: a call (k, v (B, nh, T, hs)) appends them and returns every key "
                 "and value cached so far, oldest first",
    "repeat_kv": "(kv (B, n_kv, T, hs), groups) -> (B, n_kv * groups, T, hs): the key/value heads shared by grouped "
                 "queries, query head h reading kv head h // groups",
    "attend": "(q (B, nh, T_q, hs), k, v (B, nh, T_k, hs), additive mask (B, 1, T_q, T_k) or None for plain causal, "
              "dropout_p) -> softmax(q k^T / sqrt(hs) + mask) v (B, nh, T_q, hs)",
    # a mask builder made of parts (FlexAttention-style mask functions: (b, h, q_idx, kv_idx) index tensors ->
    # bool, True where the query may attend the key): where the run offers them, a broken mask is traced to one
    "causal_mask_mod": "the mask function of causality: True where kv_idx <= q_idx",
    "padding_mask_mod": "(attention_mask (B, T_k) bool, True on real tokens) -> the mask function: True where the "
                        "key kv_idx of row b is real",
    "and_mask_mods": "(*mask functions) -> the mask function of their intersection",
    "causal_skip": "(attention_mask (B, T_k) 0/1, query_len) -> bool: whether the stack may attend plain causally "
                   "without an explicit mask (exact only without padding)",
    "evaluate": "(docs: token-id lists) -> the stack's evaluation of the model on them: the mean next-token loss per "
                "target (over every rank's share where the stack splits them)",
    "eval_step": "(batch as collate makes it) -> the loss the evaluation takes for that one batch (its mean per "
                 "target)",
    "split_of": "(document text, val_fraction) -> 'train' | 'val': the split a document belongs to",
    "lr_at": "(step) -> the LR of that optimizer step by the run's schedule function at the configured settings",
    "make_scheduler": "(optimizer) -> an LR scheduler built the run's way for that optimizer (stepped once per "
                      "optimizer step)",
    "accumulation": "the code that decides how the micro-batch losses of an accumulation window are normalized (not "
                    "called)",
    "train_step": "the code of one optimizer step: forwards and backwards of its micro-batches, clipping, the "
                  "optimizer and scheduler steps, clearing the gradients (not called)",
    "optimizer_step": "(optimizer, scaler, scheduler) -> whether the scaler skipped: step through the scaler, update "
                      "it, advance the schedule once, clear the gradients",
    "clip_gradients": "(model, optimizer, scaler, max_norm) -> the true pre-clip norm: unscale, then clip to max_norm",
    "restore_optimizer": "the code that restores the optimizer's and the LR scheduler's state from a checkpoint (not "
                         "called)",
    "restore_position": "the code that restores the loader's position (epoch, batches already drawn) on a resume "
                        "(not called)",
    "epoch_order": "the code that sets the permutation a shuffled loader draws each epoch (not called)",
    "init_weights": "the code that initializes the model's parameters (not called)",
    "place_model": "the code that places the model's weights for training: device and dtype (not called)",
    "optimizer_groups": "the code that builds the optimizer and its param groups (read off the run's optimizer: "
                        "not called)",
    "decay_names": "(model) -> the names of the parameters the optimizer's groups decay",
    "mask_builder": "(attention_mask (B, T_k) 0/1, query_len, dtype) -> the additive mask (B, 1, query_len, T_k) in "
                    "dtype of the last query_len positions, or None where plain causal attention is exact",
}


@dataclass(frozen=True)
class Role:
    """A target's component for one of ``ROLES``: the seam it stands for and, where the seam's own call is not the
    role's normalized one, ``adapt``: (run, the seam's live function) -> the role's callable. Resolved at each
    ``RunContext.role`` call, so the callable runs the code the run runs (injected faults included)."""

    seam: str
    adapt: Callable[[Any, Callable], Callable] | None = None


@dataclass
class RunContext:
    """What a detector may look at. ``run`` is the live run (model, train_model, optimizer, scheduler,
    scaler, sampler, corpus, tokenizer, config, history, rank, world_size, step); it is replaced by
    the resumed run after a checkpoint load. ``golden`` is the recorded envelope of clean reference
    runs of the same recipe (other seeds), or None."""

    run: Any
    seam_resolver: Callable[[str], Callable]  # sealed on construction: seam-table names only (see seam)
    seams: dict[str, str] = field(default_factory=dict)  # the localization vocabulary: seam name -> subsystem
    golden: dict | None = None
    phase: str = "train"  # "train", "eval" (the end-of-run evaluation), "probe"
    roles: dict[str, Role] = field(default_factory=dict)  # role (ROLES) -> the run's component for it
    _memo: dict = field(default_factory=dict, repr=False)
    _spans: Callable[[], list] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # the raw resolver imports any dotted name (``faults.registry`` included): it stays in closures
        raw, names = self.seam_resolver, frozenset(self.seams)
        self.seam_resolver = _sealed_resolver(raw, names)
        self._spans = functools.cache(lambda: _seam_spans(raw, names))  # the live code is fixed for a run

    @property
    def config(self):
        return self.run.config

    @property
    def step(self) -> int:
        return self.run.step

    def fact(self, name: str):
        """The general fact ``name`` of ``FACTS`` about this run; ``NotApplicable`` when the run offers none."""
        value = _lookup(self.run, name)
        if value is _ABSENT:
            value = _lookup(self.run, FACTS[name])
        if value is _ABSENT:
            raise NotApplicable(f"this run does not offer its {name}")
        return value

    def role(self, name: str) -> Callable:
        """The run's component for the role ``name`` (``ROLES``), called the role's normalized way; under injection
        the code the run executes. ``NotApplicable`` when the run offers no such role."""
        if name not in ROLES:
            raise ValueError(f"unknown role {name!r} (known: {', '.join(ROLES)})")
        spec = self.roles.get(name)
        if spec is None:
            raise NotApplicable(f"this run offers no {name} role")
        fn = self.seam(spec.seam)
        return fn if spec.adapt is None else spec.adapt(self.run, fn)

    def role_seam(self, name: str) -> str | None:
        """The seam the run's ``name`` role stands for (what a finding about it names), None without the role."""
        spec = self.roles.get(name)
        return spec.seam if spec is not None else None

    def known_seam(self, name: str) -> str | None:
        """``name`` if it is in this run's seam table, else None: a finding names a seam only where the run has it."""
        return name if name in self.seams else None

    def seam(self, name: str) -> Callable:
        """The run's live function for a seam name such as ``"model.data.collate"`` (a class name such as
        ``"model.gpt.KVCache"`` also resolves). Under injection this is the code the run executes.
        Names outside the seam table raise ValueError; a cached seam comes without its cache."""
        return self.seam_resolver(name)

    def seam_at(self, path: str, line: int) -> str | None:
        """The seam whose live function holds source line ``line`` of file ``path`` (a traceback's frame),
        the tightest one when functions nest; None when no seam does."""
        real = os.path.realpath(path)
        hits = [(last - first, name) for name, file, first, last in self._spans()
                if file == real and first <= line <= last]
        return min(hits)[1] if hits else None

    def raising_seam(self, exc: BaseException) -> str | None:
        """The innermost seam on ``exc``'s traceback (a probe's call that raised), or None."""
        frames = traceback.extract_tb(exc.__traceback__)
        return next((s for f in reversed(frames) if (s := self.seam_at(f.filename, f.lineno))), None)

    def memo(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per run (the resumed run is a new one): a verdict several detectors use,
        such as "lm_loss honours its contract", is probed once and shared."""
        cached = self._memo.get(key)
        if cached is None or cached[0] is not self.run:
            cached = self._memo[key] = (self.run, compute())
        return cached[1]

    @contextlib.contextmanager
    def probe(self, train_mode: bool = False):
        """A side-effect-free probe: no grad, the model in eval mode (unless asked), every global RNG
        state restored after, so the run continues exactly as without the probe."""
        model = self.run.model
        was_training, phase = model.training, self.phase
        states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        model.train(train_mode)
        self.phase = "probe"
        try:
            with torch.no_grad():
                yield model
        finally:
            model.train(was_training)
            self.phase = phase
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])


def _sealed_resolver(resolve: Callable[[str], Any], names: frozenset[str]) -> Callable[[str], Any]:
    """``resolve`` restricted to the seam table: a seam's function, or a class one of them is a method of."""
    def seam(name: str):
        obj = resolve(name) if name in names or any(s.startswith(name + ".") for s in names) else None
        if name not in names and not isinstance(obj, type):  # a prefix may be a class, never a module
            raise ValueError(f"{name!r} is not a seam (nor a class of one): the context resolves seams only")
        return obj if isinstance(obj, (types.FunctionType, type)) else _without_cache(obj)

    return seam


def _without_cache(fn: Callable) -> Callable:
    """A plain function calling ``fn`` (e.g. an ``lru_cache`` wrapper) with its name, doc and signature,
    and no way to its cache: whether the injection cleared it would tell which fault runs."""
    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    call.__module__, call.__name__, call.__qualname__, call.__doc__ = (
        fn.__module__, fn.__name__, fn.__qualname__, fn.__doc__)
    call.__signature__ = inspect.signature(fn)
    return call


def _seam_spans(resolve: Callable[[str], Any], names) -> list[tuple[str, str, int, int]]:
    """(seam, real file, first line, last line) of every seam's live function that has code."""
    spans = []
    for name in names:
        try:
            span = _line_span(resolve(name))
        except (TypeError, ValueError):
            continue
        if span is not None:
            spans.append((name, *span))
    return spans


def _line_span(fn) -> tuple[str, int, int] | None:
    """(real file, first line, last line) of the code a function runs, from its code objects (nested
    ones included); None for anything else. Honesty exemption (tests/detectors/test_honesty.py): line
    numbers are what a traceback already shows, and the source text is never read."""
    fn = inspect.unwrap(fn)
    if not isinstance(fn, types.FunctionType):
        return None
    codes, lines = [fn.__code__], []
    while codes:
        code = codes.pop()
        lines += [end for _, end, _, _ in code.co_positions() if end is not None]
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return os.path.realpath(fn.__code__.co_filename), fn.__code__.co_firstlineno, max(lines)


class Detector:
    """Base class: override the hooks you need; call ``report`` for each finding.

    Hooks (all optional), in the order a run fires them:
      on_start(ctx)                 the run is built (probes of components go here)
      on_batch(ctx, micro_batches)  a step's collated micro-batches, before the first forward
      on_forward(ctx, batch, logits) each training forward of the model (batch: the micro-batch dict)
      on_backward(ctx, batch, grad_logits) d(loss)/d(logits) of each micro-batch, during backward
      on_before_step(ctx)           optimizer.step() is about to run (gradients unscaled and clipped)
      on_after_step(ctx, record)    the step's record (loss, grad_norm, lr, scale, skipped, tokens)
      on_checkpoint_save(ctx, path) / on_checkpoint_load(ctx, path)   around a save/resume
      on_end(ctx, metrics)          after the end-of-run evaluation (metrics: {"val_loss": ...})
      on_crash(ctx, crash)          the run raised; crash = {type, message, step, frames, traceback}
    """

    id: ClassVar[str] = ""
    family: ClassVar[str] = ""  # the subsystem the detector mainly localizes (documentation, heatmap order)
    passive: ClassVar[bool] = True  # watches training steps (counted in the overhead) vs probes only
    baseline: ClassVar[bool] = False  # scored alongside the suite, not part of it
    exclusive: ClassVar[bool] = False  # changes the run itself (e.g. anomaly mode): the bench runs it in its own case
    description: ClassVar[str] = ""
    # "white-box": hooks of the harness's Suite on a target's run; "black-box": hooks of faultbench.watch on
    # any loop (detectors.blackbox.api), never run by the Suite
    track: ClassVar[str] = "white-box"
    # what the detector assumes of a run, checked before its first hook (see ``require``): dotted attribute
    # paths of ``ctx.run`` ("corpus.train") and of ``ctx.config`` ("train.precision"), and the seams it probes
    needs_run: ClassVar[tuple[str, ...]] = ()
    needs_config: ClassVar[tuple[str, ...]] = ()
    needs_seams: ClassVar[tuple[str, ...]] = ()
    # the general facts (``FACTS``) and roles (``ROLES``) it needs: what lets one detector serve every target
    needs_facts: ClassVar[tuple[str, ...]] = ()
    needs_roles: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self._reported_keys: set[str] = set()

    def report(self, ctx: RunContext, subsystem: str, seam: str | None, message: str, evidence: dict | None = None,
               confidence: float = 0.7, step: int | None = None) -> None:
        if subsystem not in SUBSYSTEMS:
            raise ValueError(f"{self.id}: unknown subsystem {subsystem!r}; expected one of {SUBSYSTEMS}")
        self.findings.append(Finding(self.id, ctx.step if step is None else step, subsystem, seam, message,
                                     _jsonable(evidence or {}), confidence))

    def report_once(self, key: str, ctx: RunContext, *args, **kwargs) -> None:
        """``report``, unless this detector already reported under ``key`` (one finding per kind of problem)."""
        if key not in self._reported_keys:
            self._reported_keys.add(key)
            self.report(ctx, *args, **kwargs)

    def require(self, ctx: RunContext, run=(), config=(), seams=(), facts=(), roles=()) -> None:
        """Raise ``NotApplicable`` naming every one of ``run`` (attribute paths of the run), ``config``
        (attribute paths of its config), ``seams`` (names), ``facts`` (``FACTS``) and ``roles`` (``ROLES``) that
        this run lacks; a hook may call it for what only some paths need."""
        missing = ([f"run.{p}" for p in run if _lookup(ctx.run, p) is _ABSENT]
                   + [f"config.{p}" for p in config if _lookup(ctx.config, p) is _ABSENT]
                   + [f"seam {s}" for s in seams if s not in ctx.seams]
                   + [f"fact {f}" for f in facts if not _offers(ctx, f)]
                   + [f"role {r}" for r in roles if r not in ctx.roles])
        if missing:
            raise NotApplicable(f"this run has no {', '.join(missing)}")

    def check_applicable(self, ctx: RunContext) -> None:
        """``require`` of the declared needs; the suite calls it once, before the detector's first hook."""
        self.require(ctx, self.needs_run, self.needs_config, self.needs_seams, self.needs_facts, self.needs_roles)

    @property
    def fired(self) -> bool:
        return bool(self.findings)

    def summary(self) -> dict:
        """Anything worth keeping in the case record besides findings (statistics, traces); {} by default."""
        return {}

    # the hooks: no-ops here; the harness calls only the ones a detector overrides
    def on_start(self, ctx: RunContext) -> None: ...
    def on_batch(self, ctx: RunContext, micro_batches: list[dict]) -> None: ...
    def on_forward(self, ctx: RunContext, batch: dict, logits: torch.Tensor) -> None: ...
    def on_backward(self, ctx: RunContext, batch: dict, grad_logits: torch.Tensor) -> None: ...
    def on_before_step(self, ctx: RunContext) -> None: ...
    def on_after_step(self, ctx: RunContext, record) -> None: ...
    def on_checkpoint_save(self, ctx: RunContext, path) -> None: ...
    def on_checkpoint_load(self, ctx: RunContext, path) -> None: ...
    def on_end(self, ctx: RunContext, metrics: dict) -> None: ...
    def on_crash(self, ctx: RunContext, crash: dict) -> None: ...


def _offers(ctx: RunContext, fact: str) -> bool:
    try:
        ctx.fact(fact)
    except NotApplicable:
        return False
    return True


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _jsonable(value.tolist())
    if isinstance(value, float):
        return value if np.isfinite(value) else str(value)
    if isinstance(value, (np.integer, np.floating)):
        return _jsonable(value.item())
    return value if isinstance(value, (int, str, bool, type(None))) else repr(value)


HOOKS = ("on_start", "on_batch", "on_forward", "on_backward", "on_before_step", "on_after_step",
         "on_checkpoint_save", "on_checkpoint_load", "on_end", "on_crash")

DETECTORS: dict[str, type[Detector]] = {}
BUILTIN_MODULES = (
    "faultbench.detectors.data", "faultbench.detectors.collate", "faultbench.detectors.mask",
    "faultbench.detectors.position", "faultbench.detectors.model",
    "faultbench.detectors.loss", "faultbench.detectors.optimizer", "faultbench.detectors.precision",
    "faultbench.detectors.checkpoint",
    "faultbench.detectors.distributed", "faultbench.detectors.eval", "faultbench.detectors.resources",
    "faultbench.detectors.baselines",
    "faultbench.detectors.blackbox.monitors", "faultbench.detectors.blackbox.probes",
    "faultbench.detectors.blackbox.gradients", "faultbench.detectors.blackbox.evaluation",
    "faultbench.detectors.blackbox.crashes", "faultbench.detectors.blackbox.evaluation_effects",
    "faultbench.detectors.blackbox.updates", "faultbench.detectors.blackbox.gradient_check",
    "faultbench.detectors.blackbox.resume_state", "faultbench.detectors.blackbox.optimizer_numerics",
    "faultbench.detectors.blackbox.initialization",
)
_loaded = False


def register(cls: type[Detector]) -> type[Detector]:
    """Class decorator: add a detector to the registry under its ``id``."""
    if not cls.id:
        raise ValueError(f"{cls.__name__} needs an id")
    if cls.id in DETECTORS and DETECTORS[cls.id] is not cls:
        raise ValueError(f"detector id {cls.id!r} is registered twice")
    if cls.family and cls.family not in SUBSYSTEMS + ("baseline", "resources"):
        raise ValueError(f"{cls.id}: unknown family {cls.family!r}")
    DETECTORS[cls.id] = cls
    return cls


def all_detectors() -> dict[str, type[Detector]]:
    global _loaded
    if not _loaded:
        _loaded = True
        import importlib
        from importlib.metadata import entry_points

        for name in BUILTIN_MODULES:
            importlib.import_module(name)
        for ep in entry_points(group=DETECTOR_ENTRY_POINTS):
            ep.load()
    return DETECTORS


def white_box_ids() -> list[str]:
    """Every registered detector the harness's Suite can run (the black-box track runs under faultbench.watch)."""
    return [d for d, cls in all_detectors().items() if cls.track == "white-box"]


def suite_ids() -> list[str]:
    """The detectors of the default suite (every white-box one but the baselines)."""
    return [d for d in white_box_ids() if not all_detectors()[d].baseline]


def baseline_ids() -> list[str]:
    return [d for d, cls in all_detectors().items() if cls.baseline]


def black_box_suite_ids() -> list[str]:
    """The black-box track's suite: every black-box detector but the baselines (they run under a watch)."""
    return [d for d, cls in all_detectors().items() if cls.track == "black-box" and not cls.baseline]


def resolve_ids(names) -> list[str]:
    """Expand ``all`` (both tracks) / ``suite`` (the white-box suite) / ``black-box`` (the black-box suite) /
    ``baselines`` and check every id ("did you mean" on a typo)."""
    known = all_detectors()
    out: list[str] = []
    for name in names:
        if name == "all":
            out += white_box_ids() + black_box_suite_ids()
        elif name == "suite":
            out += suite_ids()
        elif name == "black-box":
            out += black_box_suite_ids()
        elif name == "baselines":
            out += baseline_ids()
        elif name in known:
            out.append(name)
        else:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"unknown detector {name!r}{hint} (`faultbench detectors` lists them)")
    return list(dict.fromkeys(out))


def rank_key(finding: Finding | dict) -> tuple:
    """Most confident first, then earliest (a stable sort keeps report order among ties); works on a
    Finding and on its ``to_dict()``."""
    f = finding.to_dict() if isinstance(finding, Finding) else finding
    return -f["confidence"], f["step"] if f["step"] is not None else 1 << 30


def rank_findings(findings: list[Finding]) -> list[Finding]:
    """One ranked list of the findings of every detector of a suite."""
    return sorted(findings, key=rank_key)
