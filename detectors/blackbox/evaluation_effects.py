"""Evaluation leaves training as it found it (black-box track): ``eval.state.no-side-effects`` (no weight,
optimizer, scheduler or scaler state changes) and ``eval.isolation.no-update`` (no backward, no optimizer step, no
gradient left behind).

An evaluation, as the watch sees it, is a run of evaluation forwards (grad disabled or the model in eval mode:
validation, generation with a KV cache) between training forwards. Its window opens at its first forward and
closes at the next training forward, at the next optimizer step (an evaluation between a backward and its step),
or when the watch exits; the watch's own probes are no evaluation. A correct loop may do much around an
evaluation, so each rule compares only what a correct loop keeps:

- optimizer step: a step whose pre-hook finds evaluation forwards and no training forward since the previous
  step, in a loop whose steps follow training forwards (a closure optimizer such as LBFGS runs its forwards inside
  the step: never judged); the optimizer's own step counter advancing across the window without a step hook;
- gradients: at the next training forward (before its backward) or at exit, a parameter holds a non-zero gradient
  it did not hold at the window's first forward, or a different one (an evaluation in the middle of gradient
  accumulation keeps the accumulated gradients as they were). Gradients that vanish are no finding (a loop zeroes
  them where it likes), and none is compared at an optimizer step (clipping and unscaling after an evaluation
  change them legitimately);
- weights: a fingerprint of every parameter (a fixed random projection and the sum of squares, float64) at the
  window's first and second forwards. Only a change BETWEEN evaluation forwards is the evaluation's own (code
  after the evaluation may load the best checkpoint, prune, or restore swapped-in EMA weights); it is a finding
  when training resumes with it: the weights at the window's first forward were those the optimizer left (an
  anchor: per-parameter norms after the last step) and those at its close are neither. The anchor is taken at
  the start, and after each step only once the loop has shown such a change (no cost per step before): a loop
  that swaps EMA weights in for its evaluation and restores them is told apart from one that never restores them
  from its second evaluation on;
- scheduler: its ``last_epoch`` advancing twice or more across the window with no optimizer step (a correct loop
  steps a plateau or per-epoch scheduler once after its evaluation; the learning rates it sets are evidence);
- scaler: its scale changing across the window, when no update was pending at its start.
Cost: nothing per training step beyond counting forwards; per evaluation two fingerprints of the parameters and
one of the gradients (the first ``DENSE_WINDOWS`` evaluations, then at most one every ``CHECK_EVERY`` steps: a
loop that generates at every step, as RL fine-tuning does, is sampled).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from faultbench.detectors.api import NotApplicable, register
from faultbench.detectors.blackbox.api import BlackBoxDetector, StepRecord, WatchContext, local_shard

CHUNK = 1 << 22  # elements of a tensor read at once in float64 (32 MB)
SEED = 1234


class _Reader:
    """Fingerprints and norms of a fixed list of tensors' slots (the optimizer's floating-point parameters)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.groups: dict[tuple, list[int]] = {}  # (device, dtype) -> indices, for the fused norms
        for i, p in enumerate(params):
            local = local_shard(p)
            self.groups.setdefault((local.device, local.dtype), []).append(i)
        self.length = min(CHUNK, max((p.numel() for p in params), default=1))
        self._vectors: dict[torch.device, torch.Tensor] = {}

    def _vector(self, device: torch.device) -> torch.Tensor:
        """The fixed projection (standard normal, float64, its own generator: no global RNG is touched)."""
        r = self._vectors.get(device)
        if r is None:
            gen = torch.Generator().manual_seed(SEED)
            r = self._vectors[device] = torch.randn(self.length, generator=gen, dtype=torch.float64).to(device)
        return r

    @torch.no_grad()
    def fingerprint(self, tensors) -> np.ndarray:
        """(n, 3) float64: per tensor its projection, its sum of squares and its size; (nan, nan, -1) for None."""
        out = np.full((len(tensors), 3), np.nan)
        pending: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for i, t in enumerate(tensors):
            if t is None:
                out[i, 2] = -1
                continue
            flat = local_shard(t).reshape(-1)
            out[i, 2] = flat.numel()
            if flat.numel() == 0:
                out[i, :2] = 0.0
                continue
            r = self._vector(flat.device)
            proj = square = None
            for start in range(0, flat.numel(), CHUNK):
                c = flat[start:start + CHUNK].double()
                p, s = torch.dot(c, r[:c.numel()]), torch.dot(c, c)
                proj, square = (p, s) if proj is None else (proj + p, square + s)
            pending.setdefault(flat.device, []).append((i, torch.stack([proj, square])))
        for rows in pending.values():  # one transfer per device
            values = torch.stack([v for _, v in rows]).cpu().numpy()
            for (i, _), v in zip(rows, values, strict=True):
                out[i, :2] = v
        return out

    @torch.no_grad()
    def norms(self) -> list[torch.Tensor]:
        """Per (device, dtype) group, the L2 norm of each parameter: fused, left on the device (no sync)."""
        return [torch.stack(torch._foreach_norm([local_shard(self.params[i]) for i in idx]))
                for idx in self.groups.values()]

    def norms_array(self, norms: list[torch.Tensor]) -> np.ndarray:
        out = np.empty(len(self.params))
        for idx, values in zip(self.groups.values(), norms, strict=True):
            out[idx] = values.double().cpu().numpy()
        return out


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: whether two fingerprints are of the same tensor contents (NaN equal to NaN; rows of different sizes
    or a missing tensor are not comparable: True)."""
    comparable = (a[:, 2] == b[:, 2]) & (a[:, 2] >= 0)
    scale = np.sqrt(np.fmax(np.abs(a[:, 1]), np.abs(b[:, 1])))
    close = ((np.abs(a[:, 0] - b[:, 0]) <= 1e-9 * scale + 1e-300)
             & (np.abs(a[:, 1] - b[:, 1]) <= 1e-9 * scale ** 2 + 1e-300))
    both_nan = np.isnan(a[:, :2]).any(1) & np.isnan(b[:, :2]).any(1)
    return ~comparable | close | both_nan


@dataclass
class _Window:
    """One evaluation, as seen at its first forward (and its second, for the weights)."""

    step: int  # optimizer steps completed when it opened
    forwards: int  # training forwards since the last step when it opened (an evaluation mid-accumulation)
    checked: bool  # fingerprints taken (``EvaluationEffects.DENSE_WINDOWS`` / ``CHECK_EVERY``)
    count: int | None  # the optimizer's step counter
    epoch: int | None  # the scheduler's last_epoch
    lrs: list[float]
    scale: float | None  # the scaler's scale; None without an enabled scaler or with an update pending
    evals: int = 1
    params: np.ndarray | None = None  # fingerprints at the first forward
    grads: np.ndarray | None = None
    norms: np.ndarray | None = None  # per-parameter norms at the first forward, when an anchor is valid
    second: np.ndarray | None = None  # parameter fingerprints at the second forward


@register
class EvaluationEffects(BlackBoxDetector):
    """Evaluation trains nothing and changes no training state: no optimizer step, no backward leaving gradients,
    no weight changed between evaluation forwards and kept, no scheduler stepped repeatedly, no scaler update
    (module doc: what each rule compares, and why there)."""

    id = "bb_eval_side_effects"
    family = "eval"
    description = "evaluation leaves weights, gradients, optimizer steps, scheduler and scaler as it found them"
    DENSE_WINDOWS = 8  # the first evaluations are all checked ...
    CHECK_EVERY = 16  # ... then at most one every CHECK_EVERY optimizer steps

    def __init__(self) -> None:
        super().__init__()
        self._reader: _Reader | None = None
        self._window: _Window | None = None
        self._forwards = 0  # training forwards since the last optimizer step
        self._evals = 0  # evaluation forwards since the last optimizer step
        self._visible = False  # the loop's steps follow training forwards the watch sees
        self._ended = False
        self._checks, self._last_check = 0, 0
        self._anchoring = False  # per-step anchors: once the loop changed weights between evaluation forwards
        self._anchor: list[torch.Tensor] | None = None
        self._anchor_step: int | None = None

    # ---- hooks
    def on_start(self, ctx: WatchContext) -> None:
        params = [p for p in ctx.optimizer_params() if p.is_floating_point() and p.device.type != "meta"]
        if not params:
            raise NotApplicable("the optimizer holds no floating-point parameter")
        self._reader = _Reader(params)
        self._anchor, self._anchor_step = self._reader.norms(), ctx.step  # the weights the loop starts from

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        self._forwards += 1
        if self._window is not None:
            self._close(ctx, "at the next training forward", grads=True)

    def on_before_step(self, ctx: WatchContext) -> None:
        if self._evals and not self._forwards and self._visible:
            self.report_once("step", ctx, "eval", "eval",
                             f"optimizer.step() ran during evaluation: {self._evals} evaluation forwards and no "
                             f"training forward since the previous step (the optimizer's step counter was "
                             f"{ctx.optimizer_count()}, step {ctx.step + 1} follows): the evaluation trains the "
                             "model on what it evaluates",
                             {"eval_forwards": self._evals, "opt_count": ctx.optimizer_count()}, confidence=0.85)
        if self._forwards:
            self._visible = True
        if self._window is not None:
            self._close(ctx, "at the optimizer step after it", grads=False)

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        self._forwards = self._evals = 0
        if self._anchoring:
            self._anchor, self._anchor_step = self._reader.norms(), ctx.step

    def on_eval_forward(self, ctx: WatchContext, batch: dict, logits) -> None:
        if ctx.probing or self._ended:
            return
        self._evals += 1
        window = self._window
        if window is None:
            self._window = self._open(ctx)
        elif window.evals == 1 and window.checked:
            window.second = self._reader.fingerprint(self._reader.params)
            window.evals += 1
        else:
            window.evals += 1

    def on_end(self, ctx: WatchContext) -> None:
        if self._window is not None:
            self._close(ctx, "when the watch exited", grads=True)
        self._ended = True  # evaluations after the exit (Watch.watch_evaluations) have no close to compare at

    # ---- the window
    def _open(self, ctx: WatchContext) -> _Window:
        checked = self._checks < self.DENSE_WINDOWS or ctx.step - self._last_check >= self.CHECK_EVERY
        window = _Window(ctx.step, self._forwards, checked, ctx.optimizer_count(), _epoch(ctx), _lrs(ctx),
                         _scale(ctx))
        if checked:
            self._checks, self._last_check = self._checks + 1, ctx.step
            reader = self._reader
            window.params = reader.fingerprint(reader.params)
            window.grads = reader.fingerprint([p.grad for p in reader.params])
            if self._anchor_step == ctx.step:
                window.norms = reader.norms_array(reader.norms())
        return window

    def _close(self, ctx: WatchContext, at: str, grads: bool) -> None:
        window, self._window = self._window, None
        self._check_counters(ctx, window, at)
        if not window.checked:
            return
        if grads:
            self._check_grads(ctx, window, at)
        if window.second is not None:
            self._check_weights(ctx, window, at)

    def _check_counters(self, ctx: WatchContext, window: _Window, at: str) -> None:
        count = ctx.optimizer_count()
        if window.count is not None and count is not None and count > window.count:
            self.report_once("step", ctx, "eval", "eval",
                             f"the optimizer's step counter advanced from {window.count} to {count} during evaluation "
                             f"({window.evals} evaluation forwards; checked {at}) without an optimizer step the loop "
                             "took: the evaluation updates the optimizer's state",
                             {"opt_count": [window.count, count], "eval_forwards": window.evals}, confidence=0.8)
        epoch = _epoch(ctx)
        if window.epoch is not None and epoch is not None and epoch - window.epoch >= 2:
            lrs = _lrs(ctx)
            self.report_once("scheduler", ctx, "eval", "eval",
                             f"the LR scheduler stepped {epoch - window.epoch} times during evaluation with no "
                             f"optimizer step ({window.evals} evaluation forwards; checked {at}): the lr moved from "
                             f"{_fmt(window.lrs)} to {_fmt(lrs)}, so training resumes later in its schedule than the "
                             "steps it took",
                             {"last_epoch": [window.epoch, epoch], "lrs": [window.lrs, lrs],
                              "eval_forwards": window.evals}, confidence=0.75)
        scale = _scale(ctx) if window.scale is not None else None
        if scale is not None and scale != window.scale:
            self.report_once("scaler", ctx, "eval", "eval",
                             f"the loss scaler's scale changed from {window.scale:g} to {scale:g} during evaluation "
                             f"with no optimizer step (checked {at}): the evaluation updates the scaler",
                             {"scale": [window.scale, scale], "eval_forwards": window.evals}, confidence=0.7)

    def _check_grads(self, ctx: WatchContext, window: _Window, at: str) -> None:
        reader = self._reader
        now = reader.fingerprint([p.grad for p in reader.params])
        before = window.grads
        held = (now[:, 2] >= 0) & (now[:, 1] != 0)  # a gradient with something in it (NaN counts)
        new = held & ((before[:, 2] < 0) | (before[:, 1] == 0))
        changed = held & ~new & ~_same(before, now)
        hit = np.flatnonzero(new | changed)
        if not len(hit):
            return
        first = reader.params[hit[0]]
        what = (f"{int(new.sum())} that held none before it" if new.any() else "") + \
               (" and " if new.any() and changed.any() else "") + \
               (f"{int(changed.sum())} whose accumulated gradient it changed" if changed.any() else "")
        self.report_once("backward", ctx, "eval", "eval",
                         f"a backward ran during evaluation: {len(hit)} of the optimizer's {len(reader.params)} "
                         f"parameters hold a gradient {at} that the evaluation left ({what}; first: "
                         f"{ctx.param_owner(first)}): evaluation gradients reach the next optimizer step",
                         {"params": int(len(hit)), "of": len(reader.params), "new": int(new.sum()),
                          "changed": int(changed.sum()), "first": ctx.param_owner(first),
                          "mid_accumulation": window.forwards > 0, "eval_forwards": window.evals}, confidence=0.8)

    def _check_weights(self, ctx: WatchContext, window: _Window, at: str) -> None:
        """Parameters changed between the first two evaluation forwards and still changed at the close: the
        evaluation's own change, kept, unless the weights it started from were not the optimizer's (module doc)."""
        reader = self._reader
        moved = ~_same(window.params, window.second)
        if not moved.any():
            return
        now = reader.fingerprint(reader.params)
        kept = moved & ~_same(window.params, now)
        if not kept.any():
            return  # restored to what the evaluation found
        if window.norms is None:  # no anchor for this evaluation: judge the next ones
            self._anchoring = True
            return
        anchor, current = reader.norms_array(self._anchor), reader.norms_array(reader.norms())
        evidence = kept & (anchor == window.norms) & (current != anchor)
        hit = np.flatnonzero(evidence)
        if not len(hit):
            return  # the evaluation ended on the weights the optimizer left (a swap restored), or began elsewhere
        first = reader.params[hit[0]]
        self.report_once("weights", ctx, "eval", "eval",
                         f"evaluation changed the weights: {len(hit)} of the optimizer's {len(reader.params)} "
                         f"parameters (first: {ctx.param_owner(first)}) changed between evaluation forwards, and "
                         f"training resumes {at.removeprefix('at the ').removeprefix('when ')} with them instead of "
                         "the weights the optimizer left (an in-place update, or weights swapped in and never "
                         "restored)",
                         {"params": int(len(hit)), "of": len(reader.params), "first": ctx.param_owner(first),
                          "eval_forwards": window.evals, "at": at}, confidence=0.75)


def _epoch(ctx: WatchContext) -> int | None:
    epoch = getattr(ctx.scheduler, "last_epoch", None) if ctx.scheduler is not None else None
    return epoch if isinstance(epoch, int) else None


def _lrs(ctx: WatchContext) -> list[float]:
    return [float(g["lr"]) for g in ctx.optimizer.param_groups if isinstance(g.get("lr"), (int, float))]


def _scale(ctx: WatchContext) -> float | None:
    """The enabled scaler's scale, None when none is enabled or an update is pending (an evaluation placed between
    ``scaler.step`` and ``scaler.update`` sees the loop's own update after it); None too for a scaler whose pending
    state cannot be read."""
    scaler = ctx.scaler
    if not ctx.scaler_enabled:
        return None
    pending = getattr(scaler, "_per_optimizer_states", None)
    if pending is None or len(pending):
        return None
    return float(scaler.get_scale())


def _fmt(lrs: list[float]) -> str:
    return "[" + ", ".join(f"{lr:.3g}" for lr in lrs) + "]"
