"""The black-box track's detector API: what a detector sees of ANY causal-LM training loop.

``faultbench.watch`` (faultbench/watch.py) fills a ``WatchContext`` from module, optimizer and gradient
hooks and fires the hooks of ``BlackBoxDetector`` below. A black-box detector sees only that context: the
model called as a causal LM, the batches, the loop's loss, gradients, the optimizer's param groups, the
scheduler's reported LR, the scaler, ranks and the golden envelope the USER recorded. No seam table, no
attribute names of any stack, no formula of ours. It reports the user's name for the place (``where``: a
module path such as "transformer.h.0.attn", "optimizer", "scheduler", "scaler", "batch", "loss", "eval").
"""

from __future__ import annotations

import contextlib
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from faultbench.detectors.api import SUBSYSTEMS, Detector, Finding, _jsonable
from faultbench.detectors.blackbox.conventions import Conventions


@dataclass
class StepRecord:
    """One optimizer step as the watch measured it.

    loss: mean of the step's training-forward losses (or of ``Watch.observe``); when the model returned none,
    the loss the step's backwards differentiated (sum over micro-batches of weight x NLL implied by the logits'
    gradient, detectors.blackbox.gradients), on the watch's first ``faultbench.watch.IMPLIED_LOSS_DENSE`` steps
    and every ``IMPLIED_LOSS_EVERY``-th after; None when neither was seen;
    lrs: the lr of each param group as the optimizer used it; grad_norm: L2 norm of the gradients the
    optimizer stepped with; backward_norm: L2 norm of the gradients as the last backward of the step left
    them (before any clipping or unscaling; scaled), measured under an enabled scaler only, else None; both
    norms are measured on ``sampled`` steps only (``WatchContext.sampled_step``; None on the others);
    scale: the scaler's scale at the step (None without an enabled scaler); skipped: steps the scaler skipped
    since the previous record (its scale fell); micro_batches: training forwards since the previous step;
    batches: a hash of each training batch of the step (detectors.blackbox.batches: same tokens, same hash);
    layout: counts over the step's training rows ("rows", "len": longest padded length, "cells", "idle": padding
    past each batch's longest row, and with a tokenizer's BOS/EOS ids "bos", "bos2", "eos", "full", "full_eos": see
    batches.layout); opt_count: the optimizer's own step counter
    after the step (a per-parameter "step" of its state; None for an optimizer without one); groups: on the
    first record of each watch only, the optimizer's param groups as configured (``WatchContext.group_config``).
    evals: [documents evaluated after the step (rows of evaluation forwards, one-token decoding steps left out), how
    many of them the run had trained on], None without evaluation; eval_sizes: the documents each evaluation that the
    loop reported a loss for (``Watch.observe(eval_loss=...)``) covered, in order. ``step`` counts from the step the
    watch was attached at (a resumed loop's)."""

    step: int
    loss: float | None
    lrs: list[float]
    grad_norm: float | None
    backward_norm: float | None
    scale: float | None
    skipped: int
    micro_batches: int
    batches: list[int] = field(default_factory=list)
    layout: dict | None = None
    opt_count: int | None = None
    groups: list[dict] | None = None
    evals: list[int] | None = None
    eval_sizes: list[int] | None = None  # documents of each evaluation the loop reported a loss for after the step
    model: dict | None = None  # on the first record of each watch only: WatchContext.model_structure()
    sampled: bool = True  # a step the sampled measurements (the gradient norms) and checks looked at
    updates: list[float | None] | None = None  # per param group, on sampled steps: ||w_after - w_before|| / ||w||
    init: dict | None = None  # on the first record of a fresh watch only: WatchContext.initial (the weights as found)


class StepHistory:
    """The watch's step records, bounded so a long run's memory stays flat: the last ``limit`` records are kept
    (older ones are dropped, first in first out); ``recorded`` counts every record ever appended. Iterates and
    indexes (slices too) like a list of the kept records."""

    LIMIT = 1000  # ~0.7 KB a record: under 1 MB however long the run

    def __init__(self, limit: int | None = None):
        limit = self.LIMIT if limit is None else limit
        if limit < 1:
            raise ValueError(f"a step history keeps at least one record, not {limit}")
        self._kept: deque[StepRecord] = deque(maxlen=limit)
        self.recorded = 0

    def append(self, record: StepRecord) -> None:
        self._kept.append(record)
        self.recorded += 1

    @property
    def dropped(self) -> int:
        return self.recorded - len(self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    def __iter__(self):
        return iter(self._kept)

    def __getitem__(self, index):
        return list(self._kept)[index] if isinstance(index, slice) else self._kept[index]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor, detached (a DTensor's local shard: reading it runs no collective), else
    the tensor itself, detached."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def cuda_devices(model: torch.nn.Module) -> list:
    """The CUDA device ``model`` lives on, as ``torch.random.fork_rng(devices=...)`` takes it ([] on the CPU)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return [device] if device.type == "cuda" else []


class WatchContext:
    """What a black-box detector may see. ``step``: optimizer steps completed; ``last_batch``: the most recent
    training batch ({"input_ids", and "attention_mask", "labels", "position_ids" when the loop passed them});
    ``history``: one StepRecord per optimizer step; ``stale_grads``: filled by the watch at the first backward
    of each sampled step (``sampled_step``), {"params": how many of the optimizer's parameters still held a non-zero
    gradient, "of": how many it has, "first": the first such parameter's name}, until that step's record; None when
    all were clear or the step was not sampled;
    ``skipped_steps``: steps the loss scaler skipped so far (no optimizer hook fires for those);
    ``conventions``: what the loop declared about itself (special ids, positions, planned length:
    detectors.blackbox.conventions), never guessed."""

    def __init__(self, model: torch.nn.Module, optimizer, *, scheduler=None, scaler=None, tokenizer=None,
                 golden: dict | None = None, rank: int = 0, world_size: int = 1,
                 conventions: Conventions | None = None):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.tokenizer, self.golden, self.rank, self.world_size = tokenizer, golden, rank, world_size
        self.conventions = conventions or Conventions.of(tokenizer)
        self.step = 0
        self.last_batch: dict | None = None
        self.history = StepHistory()
        self.stale_grads: dict | None = None
        self.skipped_steps = 0  # optimizer steps the loss scaler skipped (its scale fell), trailing ones included
        self.rng_at_start: torch.Tensor | None = None  # torch's global RNG state before the first training forward
        self.rng_at_step: torch.Tensor | None = None  # ... and after the last optimizer step
        self.pending_batch: dict | None = None  # the batch of the forward in flight (a crash's batch)
        self.backward_seen = False  # at a step: whether a backward ran through a training forward since the last
        self.start_step = 0  # the loop's step when the watch was attached (a resumed loop's step; ``step`` too)
        self.previous: WatchContext | None = None  # the watch of the run's segment before a resume, if given
        self.saved_states: dict[int, dict] = {}  # step -> what detectors recorded as a checkpoint was saved there
        self.initial: dict | None = None  # a fresh watch's model as found at its start (``initial_values``)
        self.batches_seen: dict[int, int] = {}  # training batch hash -> the step it was trained at (MAX_ROWS at most)
        self.train_rows: set[int] = set()  # hashes of the training rows seen (at most MAX_ROWS)
        self.probing = False  # the watch ignores the model's calls made inside ``probe``
        # where the loop is in its step (what a crash interrupted): "setup" (no forward yet), "forward" (a training
        # forward), "backward" (after it: the loss, backward, clipping), "step" (the optimizer's), "between steps"
        # (the scheduler, the next batch, logging), "checkpoint" (the loop read or loaded the model's or optimizer's
        # state since: saving or restoring), "eval forward" / "evaluation" (in / after a forward without grad, until
        # the next training forward or step), "generation" (after such a forward of one token a row: a decode step)
        self.phase = "setup"
        # evaluations after the watch's exit are watched too (``Watch.watch_evaluations``): their checks may still come
        self.evaluations_follow = False
        self._names: dict[int, str] | None = None
        self._lm = None

    @property
    def lm(self):
        """The model as a ``CausalLM`` (detectors.blackbox.lm), built on first use (one trial call, as a probe)."""
        if self._lm is None:
            from faultbench.detectors.blackbox.lm import CausalLM

            with self.probe():
                self._lm = CausalLM.wrap(self.model)
        return self._lm

    @property
    def scaler_enabled(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    @contextlib.contextmanager
    def probe(self):
        """A side-effect-free probe: no grad, the model in eval mode, every global RNG state restored after, and
        the watch's hooks quiet, so the loop continues exactly as without the probe."""
        was_training, was_probing = self.model.training, self.probing
        states = (random.getstate(), np.random.get_state())
        self.probing = True
        try:
            with torch.random.fork_rng(devices=cuda_devices(self.model)), torch.no_grad():
                self.model.eval()
                yield self.model
        finally:
            self.model.train(was_training)
            self.probing = was_probing
            random.setstate(states[0])
            np.random.set_state(states[1])


    def module_path(self, module: torch.nn.Module) -> str:
        """``module``'s name in ``model.named_modules()`` ("transformer.h.0.attn"; "" for the model itself)."""
        if self._names is None:
            self._names = {id(m): name for name, m in self.model.named_modules()}
        return self._names.get(id(module), type(module).__name__)

    def param_owner(self, param: torch.Tensor) -> str:
        """The module path owning ``param`` ("transformer.h.0.mlp.c_fc"), or its full name where no module does."""
        for name, p in self.model.named_parameters():
            if p is param:
                return name.rpartition(".")[0] or name
        return "?"

    MAX_ROWS = 200_000  # bounds train_rows and batches_seen (~30 MB at most, however long the run)

    def group_config(self) -> list[dict]:
        """The optimizer's param groups as configured: per group the number of parameters and of their elements,
        their dtypes, and each hyperparameter other than the lr (betas, eps, weight_decay, momentum, ...)."""
        out = []
        for group in self.optimizer.param_groups:
            params = group["params"]
            conf = {"params": len(params), "numel": sum(p.numel() for p in params),
                    "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params})}
            for key, value in group.items():
                if key in ("params", "lr", "initial_lr") or key.startswith("_"):
                    continue
                if isinstance(value, (bool, int, float, str)) or value is None:
                    conf[key] = value
                elif isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value):
                    conf[key] = list(value)
            out.append(conf)
        return out

    def model_structure(self) -> dict:
        """The model's parameters as built: how many distinct tensors, their elements, and the names that share an
        earlier name's tensor (tied weights: ``lm_head.weight`` sharing ``wte.weight``)."""
        distinct: dict[int, torch.Tensor] = {}
        shared = []
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in distinct:
                shared.append(name)
            distinct.setdefault(id(p), p)
        return {"params": len(distinct), "numel": sum(p.numel() for p in distinct.values()), "shared": shared}

    def initial_values(self) -> dict[str, list]:
        """Each parameter and floating buffer as the model holds it now: {name: [std, mean, numel]} (this rank's
        shard of a sharded tensor; tied tensors once, under their first name)."""
        out, seen = {}, set()
        with torch.no_grad():
            named = [*self.model.named_parameters(), *self.model.named_buffers()]
            for name, t in named:
                if id(t) in seen or not t.is_floating_point() or t.numel() == 0:
                    continue
                seen.add(id(t))
                values = local_shard(t)
                values = values if values.dtype == torch.float32 else values.float()
                std, mean = torch.std_mean(values) if values.numel() > 1 else (torch.zeros(()), values.mean())
                out[name] = [float(std), float(mean), values.numel()]
        return out

    def optimizer_count(self) -> int | None:
        """The optimizer's own step counter: the "step" of its state for one parameter (Adam, AdamW, RMSprop,
        Adagrad keep one per parameter, all stepped together), None when its state holds none."""
        for state in self.optimizer.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if step is not None:
                return int(step)
        return None

    DENSE_STEPS = 4  # a watch's first steps: every one is checked (what a bug does from the start shows at once)
    SAMPLE_EVERY = 4  # then every SAMPLE_EVERY-th step (the checks of ``BlackBoxDetector.sampled`` detectors)

    @property
    def sampled_step(self) -> bool:
        """Whether the step in progress is one the sampled checks look at: the first DENSE_STEPS steps of this watch,
        then every SAMPLE_EVERY-th."""
        return self.sampled_every(self.SAMPLE_EVERY)

    def sampled_every(self, every: int, dense: int | None = None) -> bool:
        """Whether the step in progress is one of this watch's first ``dense`` (default DENSE_STEPS), or an
        ``every``-th after."""
        local = self.step - self.start_step
        return local < (self.DENSE_STEPS if dense is None else dense) or local % every == 0

    def all_gather(self, values) -> list[list[float]]:
        """Every rank's ``values`` (a few numbers, float64), gathered on the parameters' device: a collective, so
        every rank must call it at the same point."""
        device = next((p.device for p in self.optimizer_params()), torch.device("cpu"))
        mine = torch.tensor(values, dtype=torch.float64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(gathered, mine)
        return torch.stack(gathered).cpu().tolist()

    def optimizer_params(self) -> list[torch.Tensor]:
        """Every parameter of the optimizer's groups, once."""
        seen: dict[int, torch.Tensor] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
        return list(seen.values())


class BlackBoxDetector(Detector):
    """A detector of the black-box track: hooks fired by ``faultbench.watch``, findings that name the user's code.

    Hooks (all optional):
      on_start(ctx)                         the watch is entered
      on_forward(ctx, batch, logits, loss)  each training forward (grad enabled, model in train mode)
      on_backward(ctx, batch, logits, grad_logits)
                                            the backward through that forward's logits: d loss / d logits
                                            (same shape, detached, divided by an enabled scaler's scale)
      on_before_step(ctx)                   optimizer step pre-hook: gradients as the optimizer sees them
      on_after_step(ctx, record)            optimizer step post-hook, with the step's StepRecord
      on_eval_forward(ctx, batch, logits)   a forward without grad (evaluation, generation)
      on_grad_norm(ctx, grad_norm)          the loop reported its last step's gradient norm (``Watch.observe``)
      on_eval_loss(ctx, eval_loss, across_ranks)
                                            the loop reported the loss of its evaluation (``Watch.observe``):
                                            with ``across_ranks`` it covers every rank's share, each rank reports it
      on_save(ctx)                          the loop read the model's state between steps: a checkpoint saved at
                                            ``ctx.step`` (once per step; what a detector records in
                                            ``ctx.saved_states[ctx.step]`` the resumed segment reads in
                                            ``ctx.previous``)
      on_end(ctx)                           the watch exited normally
      on_crash(ctx, crash)                  the with-block raised: {type, message, frames: [(file, line, func)],
                                            code: the place to act on (``faultbench.guard.crash_of``),
                                            phase: ``WatchContext.phase`` when it raised}
    Raise ``NotApplicable`` (detectors.api) from a hook when the loop breaks the detector's assumption: the
    watch says so once in its report and calls the detector no more.

    ``retire(hook)``: the detector needs ``hook`` no more (a check made on the first few steps only).
    ``sampled``: the detector's on_forward/on_backward check a contract every step keeps alike (a bug breaks it on
    every step), so the watch fires them on sampled steps only (``WatchContext.sampled_step``): every step the tiny
    models of the bench take costs a few ms, and a check's fixed cost per call is what its overhead is made of.
    ``against_golden``: every finding compares the run with the user's own known-good runs (``ctx.golden``): it
    reports a change from the user's known-good setup, so the watch never ranks it as a library's finding, whoever's
    code the place it names is (a library's schedule built from the user's arguments).
    """

    track: ClassVar[str] = "black-box"
    sampled: ClassVar[bool] = False
    against_golden: ClassVar[bool] = False
    retired: frozenset[str] = frozenset()  # hooks this detector needs no more (``retire``)

    def __init__(self) -> None:
        super().__init__()
        self._tallies: dict[str, list] = {}  # ``tally``'s evidence, per kind of finding

    def check_applicable(self, ctx: Any) -> None:
        """Black-box detectors declare no run paths: a hook raises ``NotApplicable`` where an assumption fails."""

    def tally(self, key: str, hit: Any, need: int, in_a_row: bool = False) -> list | None:
        """Evidence for one kind of finding, gathered over steps: ``hit`` (None: not this time) joins ``key``'s
        list, which a miss empties when ``in_a_row``; the list once it holds ``need`` hits (the first is the one a
        message quotes), else None."""
        hits = self._tallies.setdefault(key, [])
        if hit is not None:
            hits.append(hit)
        elif in_a_row:
            hits.clear()
        return hits if len(hits) >= need else None

    def retire(self, hook: str) -> None:
        """This detector's checks on ``hook`` are done (it examined what it needed): the watch calls it there no
        more, and hooks no logits' gradient once no detector takes ``on_backward``."""
        self.retired = self.retired | {hook}

    def report(self, ctx: WatchContext, subsystem: str, where: str | None, message: str,
               evidence: dict | None = None, confidence: float = 0.7, step: int | None = None) -> None:
        if subsystem not in SUBSYSTEMS:
            raise ValueError(f"{self.id}: unknown subsystem {subsystem!r}; expected one of {SUBSYSTEMS}")
        self.findings.append(Finding(self.id, ctx.step if step is None else step, subsystem, None, message,
                                     _jsonable(evidence or {}), confidence, where))

    # the hooks: no-ops here; the watch calls only the ones a detector overrides
    def on_start(self, ctx: WatchContext) -> None: ...
    def on_forward(self, ctx: WatchContext, batch: dict, logits: torch.Tensor | None, loss) -> None: ...

    def on_backward(self, ctx: WatchContext, batch: dict, logits: torch.Tensor, grad_logits: torch.Tensor) -> None:
        """The gradient of the loop's loss w.r.t. the logits of a training forward, as its backward computed it
        (detached; divided by the loss scale under an enabled scaler). For a token-level cross-entropy it is
        w[b, t] * (softmax(logits[b, t]) - onehot(label)): the labels and per-token weights the loop trained with,
        whether or not the model returned a loss (detectors.blackbox.gradients). Fired only for detectors that
        override it; the watch's hook costs nothing otherwise."""

    def on_before_step(self, ctx: WatchContext) -> None: ...
    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None: ...
    def on_eval_forward(self, ctx: WatchContext, batch: dict, logits: torch.Tensor | None) -> None: ...
    def on_eval_loss(self, ctx: WatchContext, eval_loss: float, across_ranks: bool) -> None: ...
    def on_grad_norm(self, ctx: WatchContext, grad_norm: float) -> None: ...
    def on_save(self, ctx: WatchContext) -> None: ...
    def on_end(self, ctx: WatchContext) -> None: ...  # type: ignore[override]
    def on_crash(self, ctx: WatchContext, crash: dict) -> None: ...


def black_box_ids() -> list[str]:
    """Every registered black-box detector (the default of ``faultbench.watch``)."""
    from faultbench.detectors.api import black_box_suite_ids

    return black_box_suite_ids()


def guarded(fn, errors: list):
    """``fn`` for autograd to call (outside the watch's guard): its exception never reaches the loop's backward, it
    is appended to ``errors`` (the detector raises it from a hook of its own, where the watch reports it)."""
    def call(*args):
        try:
            fn(*args)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    return call
