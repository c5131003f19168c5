"""Monitors of the black-box track against the user's known-good runs and across a run's segments and ranks.

What a run is compared with: the golden envelope ``faultbench.record_golden`` made of the user's own known-good runs
of the same loop (``ctx.golden``: the LR each step, the gradient norm, the optimizer as configured, where BOS/EOS
sit in the rows, whether any batch was trained twice), the segment before a resume (``ctx.previous``, the loop's
``step``), and the other ranks (an all-gather of a parameter fingerprint and a batch hash). None assumes a formula,
a schedule, a token convention or a name of ours: each checks a contract any loop has (a resumed run continues
where it stopped; replicas stay equal; ranks see different data; evaluation data is not training data) or the
user's own known-good behaviour, and stays silent where the user gave nothing to compare with.
"""

from __future__ import annotations

import math

import torch

from faultbench.detectors.api import NotApplicable, register
from faultbench.detectors.blackbox.api import BlackBoxDetector, StepRecord, WatchContext
from faultbench.detectors.blackbox.batches import layout_fractions, row_hashes


def _golden_steps(ctx: WatchContext) -> list[dict]:
    return (ctx.golden or {}).get("steps") or []


def _window(ctx: WatchContext) -> int:
    """How many steps a record may sit off its golden index: the skipped steps of a loss scaler shift it."""
    scaled = ctx.scaler_enabled or bool((ctx.golden or {}).get("scaled"))
    return 2 + ctx.skipped_steps if scaled else 0


def _span(steps: list[dict], index: int, window: int, key: str, group: int | None = None):
    """[lo, hi] of ``key`` over the golden steps index-window .. index+window (None where none has it)."""
    lo = hi = None
    for i in range(max(0, index - window), min(len(steps), index + window + 1)):
        value = steps[i].get(key)
        if group is not None:
            value = value[group] if value and group < len(value) else None
        if value:
            lo = value[0] if lo is None else min(lo, value[0])
            hi = value[1] if hi is None else max(hi, value[1])
    return None if lo is None else (lo, hi)


def _resumed(ctx: WatchContext) -> bool:
    return ctx.start_step > 0


@register
class GoldenLR(BlackBoxDetector):
    """The LR the optimizer stepped with against the known-good runs' LR at the same step (``ctx.golden``): a
    schedule is deterministic, so an LR outside their span by more than ``REL`` is another schedule. Out at one of
    the first ``RESUME_STEPS`` steps after a resume (the loop's ``step`` > 0) while the run before it followed the
    golden: the resume did not restore the schedule's position (checkpoint). Elsewhere, out on ``MIN_STEPS``
    step(s) in a row: the schedule itself is wrong (optimizer: its horizon, its units, its scale)."""

    id = "bb_golden_lr"
    against_golden = True
    family = "optimizer"
    description = "LR the optimizer used vs the known-good runs' LR at the same step (schedule, resume)"
    REL = 0.02
    MIN_STEPS = 1  # a schedule is deterministic: one step off the known-good runs' LR is another schedule
    RESUME_STEPS = 2

    def __init__(self) -> None:
        super().__init__()
        self._out: list[dict] = []

    def on_start(self, ctx: WatchContext) -> None:
        if not any(s.get("lrs") for s in _golden_steps(ctx)):
            raise NotApplicable("no golden envelope with the LR per step was given (faultbench.record_golden)")
        # a resume is to blame only for a schedule that was right before it
        prev = ctx.previous.history if ctx.previous is not None else []
        self._before_ok = not any(self._outside(ctx, r) for r in prev[-2:])

    def _outside(self, ctx: WatchContext, record: StepRecord) -> dict | None:
        steps, index = _golden_steps(ctx), record.step - 1
        if index >= len(steps) + _window(ctx):
            return None
        for g, used in enumerate(record.lrs or []):
            span = _span(steps, index, _window(ctx), "lrs", g)
            if span is not None and not (span[0] * (1 - self.REL) - 1e-12 <= used <= span[1] * (1 + self.REL) + 1e-12):
                return {"step": record.step, "group": g, "lr": used, "golden": list(span)}
        return None

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        if self.findings or not record.lrs:
            return
        point = self._outside(ctx, record)
        if point is None:
            self._out = []
            return
        self._out.append(point)
        first = self._out[0]
        where = "scheduler" if ctx.scheduler is not None else "optimizer"
        if _resumed(ctx) and self._before_ok and first["step"] <= ctx.start_step + self.RESUME_STEPS:
            self.report(ctx, "checkpoint", where,
                        f"right after the resume at step {ctx.start_step}, step {first['step']} used lr "
                        f"{first['lr']:.3g} where the known-good runs used {first['golden'][0]:.3g}.."
                        f"{first['golden'][1]:.3g}: the resumed run's LR does not continue the schedule where it "
                        "stopped (the scheduler's or the optimizer's state was not restored)",
                        {"points": self._out, "resumed_at": ctx.start_step}, confidence=0.8)
        elif len(self._out) >= self.MIN_STEPS:
            ratio = first["lr"] / first["golden"][1] if first["golden"][1] else math.inf
            self.report(ctx, "optimizer", where,
                        f"from step {first['step']} the optimizer stepped with lr {first['lr']:.3g} where the "
                        f"known-good runs used {first['golden'][0]:.3g}..{first['golden'][1]:.3g} (x{ratio:.3g}) for "
                        f"{len(self._out)} step(s) in a row: the LR schedule is not the one of the known-good runs "
                        "(its horizon, its units or its scale differ)", {"points": self._out[:5]}, confidence=0.75)


@register
class GoldenGradNorm(BlackBoxDetector):
    """The gradients the optimizer steps with (their norm, on the watch's sampled steps): none at all (or all zero)
    on ``MIN_STEPS`` sampled steps in a row although a backward ran each time (they were cleared between the
    backward and the step); and, against the known-good runs, a norm above ``HIGH`` x their largest at the same
    steps on ``MIN_STEPS`` sampled steps in a row (their clipping or scaling does not act), or below their smallest
    / ``LOW`` (the loss the backward differentiates is scaled down: a normalization applied twice)."""

    id = "bb_golden_grad_norm"
    against_golden = True
    family = "optimizer"
    description = "optimizer stepping with no gradient after a backward, or with gradients larger than known-good"
    MIN_STEPS = 3
    HIGH = 1.5
    LOW = 1.8  # Adam hides a smaller loss scale from the updates: only the gradients show it

    def __init__(self) -> None:
        super().__init__()
        self._backward = False

    def on_before_step(self, ctx: WatchContext) -> None:
        self._backward = ctx.backward_seen

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        if not record.sampled:  # its norm was not measured: "in a row" counts the sampled steps
            return
        empty = self.tally("empty", record.step if not record.grad_norm and self._backward else None, self.MIN_STEPS,
                           in_a_row=True)
        if empty:
            self.report_once("empty", ctx, "optimizer", "optimizer",
                             f"the optimizer stepped with no gradient "
                             f"({'norm 0' if record.grad_norm == 0 else 'all None'})"
                             f" at steps {empty[:3]} although a backward ran before each: the gradients are "
                             "cleared between the backward and optimizer.step (zero_grad in the wrong place)",
                             {"steps": empty[:5]}, confidence=0.85)
        steps = _golden_steps(ctx)
        span = _span(steps, record.step - 1, _window(ctx), "grad_norm") if steps else None
        if span is None or record.grad_norm is None or not math.isfinite(record.grad_norm):
            return
        point = {"step": record.step, "grad_norm": record.grad_norm, "golden": list(span)}
        for key, off, subsystem, confidence, why in (
                ("high", record.grad_norm > self.HIGH * span[1], "optimizer", 0.6,
                 "where the known-good runs stepped with at most {hi:.3g}, {n} sampled steps in a row. Larger "
                 "gradients than the known-good runs' have many causes (a loss scaled up, a learning signal the "
                 "good runs did not have, a scaler's gradients stepped unscaled); if the loop clips, check that "
                 "the clipping acts on what the optimizer steps with (not before the backward)"),
                ("low", 0 < record.grad_norm < span[0] / self.LOW, "loss", 0.35,
                 "where the known-good runs' were at least {lo:.3g}, {n} sampled steps in a row. Possible "
                 "causes: the loss the backward differentiates is scaled down (a mean taken twice: over the "
                 "accumulation steps or the tokens), or part of it no longer reaches the weights")):
            hits = self.tally(key, point if off else None, self.MIN_STEPS, in_a_row=True)
            if hits:
                (lo, hi), first = hits[0]["golden"], hits[0]
                self.report_once(key, ctx, subsystem, subsystem,
                                 f"from step {first['step']} the optimizer stepped with gradients of norm "
                                 f"{first['grad_norm']:.3g} " + why.format(lo=lo, hi=hi, n=self.MIN_STEPS),
                                 {"steps": hits[:5]}, confidence=confidence)


_PRECISION_KEYS = ("dtypes",)


@register
class GoldenConfig(BlackBoxDetector):
    """The optimizer as configured against the known-good runs' (``ctx.golden["groups"]``): the same param groups
    holding as many elements, the same dtypes, the same hyperparameters (betas, eps, weight decay, ...; the LR is
    the schedule's business); and a loss scaler enabled where theirs was."""

    id = "bb_golden_config"
    against_golden = True
    family = "optimizer"
    description = "optimizer groups, hyperparameters, dtypes and loss scaler vs the known-good runs'"

    def on_start(self, ctx: WatchContext) -> None:
        golden = ctx.golden or {}
        if golden.get("groups") is None and not golden.get("scaled"):
            raise NotApplicable("no golden envelope with the optimizer's configuration was given")
        if golden.get("scaled") and not ctx.scaler_enabled:
            self.report(ctx, "precision", "scaler",
                        "the known-good runs stepped under an enabled loss scaler; this run has none (or it is "
                        "disabled): low-precision gradients underflow unscaled", {"scaler": ctx.scaler is not None},
                        confidence=0.75)
        want = golden.get("groups")
        if want is None:
            return
        have = ctx.group_config()
        sharded = ctx.world_size > 1  # a sharding optimizer's groups hold each rank's own parameters
        diffs = []
        if len(have) != len(want):
            diffs.append(("groups", len(want), len(have)))
        for g, (a, b) in enumerate(zip(want, have, strict=False)):
            for key in sorted(set(a) | set(b)):
                if sharded and key in ("params", "numel"):
                    continue
                if key == "dtypes" and not (a.get("params") and b.get("params")):
                    continue  # an emptied group has no dtype: its parameter count says what changed
                if a.get(key) != b.get(key):
                    diffs.append((f"group {g} {key}", a.get(key), b.get(key)))
        if not diffs:
            return
        precision = [d for d in diffs if d[0].endswith(_PRECISION_KEYS)]
        if precision:
            name, was, now = precision[0]
            self.report(ctx, "precision", "optimizer",
                        f"the optimizer holds {now} parameters where the known-good runs' held {was} ({name}): the "
                        "weights themselves are in another precision (no full-precision master copy)",
                        {"diffs": precision}, confidence=0.7)
        rest = [d for d in diffs if d not in precision]
        if rest:
            text = "; ".join(f"{n}: {w} in the known-good runs, {h} here" for n, w, h in rest[:3])
            self.report(ctx, "optimizer", "optimizer",
                        f"the optimizer is not configured as in the known-good runs ({text})", {"diffs": rest},
                        confidence=0.7)


@register
class ResumeContinuity(BlackBoxDetector):
    """A resumed loop (``watch(..., step=N)``, the HF callback's global_step) continues where it stopped: the
    optimizer's own step counter (Adam's, per parameter) equals the loop's step when the watch attaches (without a
    loss scaler, whose skipped steps the optimizer does not count), and it is not restarted (1 after the first
    resumed step); a segment before it (``previous``) ended at the step the loop resumes from."""

    id = "bb_resume_continuity"
    family = "checkpoint"
    description = "resumed loop: optimizer state and step counter continue where the run stopped"

    def __init__(self) -> None:
        super().__init__()
        self._count_at_start: int | None = None

    def on_start(self, ctx: WatchContext) -> None:
        if not _resumed(ctx):
            raise NotApplicable("the loop did not resume (watch(..., step=0))")
        self._count_at_start = ctx.optimizer_count()
        prev = ctx.previous
        if prev is not None and prev.history and not prev.skipped_steps and not ctx.scaler_enabled:
            ended = prev.history[-1].step
            if ended != ctx.start_step:
                self.report(ctx, "checkpoint", "checkpoint",
                            f"the loop resumed at step {ctx.start_step} but the run before the checkpoint ended after "
                            f"step {ended}: the restored step counter is off by {ctx.start_step - ended}",
                            {"resumed_at": ctx.start_step, "ended_at": ended}, confidence=0.8)
                return
        count = self._count_at_start
        if count is not None and not ctx.scaler_enabled and count != ctx.start_step:
            self.report(ctx, "checkpoint", "checkpoint",
                        f"the loop resumed at step {ctx.start_step} while its optimizer has taken {count} steps: the "
                        "restored step counter and the optimizer's state disagree (one of them is off)",
                        {"resumed_at": ctx.start_step, "optimizer_steps": count}, confidence=0.75)

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        if self.findings or record.step != ctx.start_step + 1 or record.opt_count is None:
            return
        if record.opt_count == 1 and ctx.start_step >= 2:
            self.report(ctx, "checkpoint", "optimizer",
                        f"the loop resumed at step {ctx.start_step} but its optimizer counts 1 step after the first "
                        "resumed one: its state (moments, step counts) was not restored, so it restarts from empty "
                        "moments", {"resumed_at": ctx.start_step, "optimizer_steps": record.opt_count},
                        confidence=0.85)


@register
class BatchReplay(BlackBoxDetector):
    """Training batches trained on twice (their hashes, ``StepRecord.batches``). Right after a resume, a batch the
    run trained on before the checkpoint: the data position was not restored (checkpoint). Elsewhere, where the
    known-good runs never trained on a batch twice (``golden["repeats"]`` 0): ``MIN_REPEATS`` batches replayed,
    the data order repeats (the sampler's epoch does not advance)."""

    id = "bb_batch_replay"
    family = "data"
    description = "training batches replayed (after a resume, or an epoch order that repeats)"
    RESUME_STEPS = 3
    MIN_REPEATS = 2

    def __init__(self) -> None:
        super().__init__()
        self._repeats: list[dict] = []

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        if self.findings:
            return
        for h in record.batches:
            first = ctx.batches_seen.get(h, record.step)
            if first < record.step:
                self._repeats.append({"step": record.step, "first_seen": first})
        if not self._repeats:
            return
        first = self._repeats[0]
        before_resume = first["first_seen"] <= ctx.start_step
        if _resumed(ctx) and before_resume and first["step"] <= ctx.start_step + self.RESUME_STEPS:
            self.report(ctx, "checkpoint", "data loader",
                        f"right after the resume at step {ctx.start_step}, step {first['step']} trained on a batch the "
                        f"run had trained on at step {first['first_seen']}: the resumed run replays data (the "
                        "sampler's position, or the batches to skip, was not restored)",
                        {"repeats": self._repeats[:5], "resumed_at": ctx.start_step}, confidence=0.8)
            return
        golden = ctx.golden or {}
        if golden.get("repeats") == 0 and len(self._repeats) >= self.MIN_REPEATS:
            self.report(ctx, "data", "data loader",
                        f"{len(self._repeats)} training batches were trained on twice (first at step {first['step']}, "
                        f"seen at step {first['first_seen']}) where the known-good runs never repeated one: the data "
                        "order repeats (the sampler's epoch does not advance)", {"repeats": self._repeats[:5]},
                        confidence=0.6)


@register
class EvalOverlap(BlackBoxDetector):
    """Evaluation documents the run trained on (``StepRecord.evals``, counted by the watch on every forward without
    grad) against the known-good runs' share (``golden["eval_overlap"]``: a loop may evaluate its training split on
    purpose, as nanoGPT's estimate_loss does): at least ``MIN_ROWS`` such documents and a share above the golden's
    by ``MARGIN``. Short documents count (a run trains on few of the long ones early; a leaky split shares its
    duplicated short documents first)."""

    id = "bb_eval_overlap"
    family = "eval"
    description = "evaluation documents that the run trained on, beyond the known-good runs' share"
    MIN_ROWS = 3
    MARGIN = 0.02

    def on_start(self, ctx: WatchContext) -> None:
        if (ctx.golden or {}).get("eval_overlap") is None:
            raise NotApplicable("no golden envelope with the known-good runs' evaluations")

    def on_eval_forward(self, ctx: WatchContext, batch: dict, logits) -> None:
        if self.findings:
            return
        counts = [r.evals for r in ctx.history if r.evals]
        evaluated, seen = sum(c[0] for c in counts), sum(c[1] for c in counts)
        allowed = ctx.golden["eval_overlap"]
        if seen >= self.MIN_ROWS and seen / evaluated > allowed + self.MARGIN:
            self.report(ctx, "eval", "eval",
                        f"{seen} of the {evaluated} evaluated documents are documents the run trained on (the "
                        f"known-good runs: at most {allowed:.0%}): the validation split overlaps the training split, "
                        "so the eval metric measures memorized text",
                        {"overlap": seen, "evaluated": evaluated, "golden": allowed}, confidence=0.75)


@register
class EvalCoverage(BlackBoxDetector):
    """Each reported evaluation covers the documents the known-good runs' evaluation after the same step covered
    (``golden["eval_sizes"]``, where every known-good run agreed: the count is exact for a fixed split): fewer is a
    dropped last batch or shard, more is documents evaluated twice (a sharded split padded with repeats and gathered
    as they are). Documents are rows of two real tokens or more, counted by the watch (``StepRecord.eval_sizes``)."""

    id = "bb_eval_coverage"
    family = "eval"
    description = "documents per reported evaluation vs the known-good runs' (none dropped, none repeated)"

    def on_start(self, ctx: WatchContext) -> None:
        if not (ctx.golden or {}).get("eval_sizes"):
            raise NotApplicable("no golden envelope whose runs agree on the evaluations' sizes")

    def on_eval_loss(self, ctx: WatchContext, eval_loss: float, across_ranks: bool) -> None:
        record = ctx.history[-1] if ctx.history else None
        expected = ctx.golden["eval_sizes"].get(str(record.step)) if record and record.eval_sizes else None
        if not expected or len(record.eval_sizes) > len(expected):
            return
        size, want = record.eval_sizes[-1], expected[len(record.eval_sizes) - 1]
        if size != want:
            what = ("fewer: documents are dropped (a last partial batch, a shard, a length filter)" if size < want
                    else "more: documents are evaluated twice (a sharded split padded with repeats and gathered "
                    "as is, or a batch fed twice)")
            self.report_once("size", ctx, "eval", "eval",
                             f"the evaluation reported after step {record.step} covered {size} documents where the "
                             f"known-good runs' covered {want}, {what}", {"step": record.step, "documents": size,
                                                                         "golden": want}, confidence=0.7)


@register
class CrossRank(BlackBoxDetector):
    """Across ranks (world size > 1, torch.distributed initialized): at the first training forward of the watch and
    of steps 1, 2, 4, 8, ... after it, an all-gather of a parameter fingerprint, a fingerprint of the floating
    buffers and the batch's hash. Replicas whose parameters differ have desynchronized (gradients not averaged, a
    rank that did not load the checkpoint); buffers that differ make the ranks' forwards different functions; ranks
    training on the same batch do not shard the data."""

    id = "bb_cross_rank"
    family = "distributed"
    description = "replicas' parameters equal and batches different across ranks (all-gather)"
    REL = 1e-5

    def __init__(self) -> None:
        super().__init__()
        self._checked: int | None = None

    def on_start(self, ctx: WatchContext) -> None:
        dist = torch.distributed
        if ctx.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            raise NotApplicable("a single process (no initialized torch.distributed group of several ranks)")

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        local = ctx.step - ctx.start_step
        if self.findings or self._checked == ctx.step or (local and local & (local - 1)):
            return
        self._checked = ctx.step
        ids = batch.get("input_ids")
        params = [p.detach() for p in ctx.model.parameters()]
        if not params or not isinstance(ids, torch.Tensor):
            return
        device = params[0].device
        buffers = [b.detach() for b in ctx.model.buffers() if b.is_floating_point()]
        mine = torch.stack([_norms_print(params, device), _norms_print(buffers, device),
                            torch.tensor(int(row_hashes(ids, batch.get("attention_mask")).sum()), device=device)])
        gathered = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
        torch.distributed.all_gather(gathered, mine)
        prints = [float(g[0:1].view(torch.float64)[0]) for g in gathered]
        buffer_prints = [float(g[1:2].view(torch.float64)[0]) for g in gathered]
        hashes = [int(g[2]) for g in gathered]
        if _spread(buffer_prints) > self.REL * max(abs(p) for p in buffer_prints):
            self.report(ctx, "distributed", "ranks",
                        f"at step {ctx.step} the ranks' buffers differ (fingerprints "
                        f"{', '.join(f'{p:.6g}' for p in buffer_prints)}) while their forwards must be the same "
                        "function: a buffer computed per rank (from a rank-local value or seed) or not broadcast",
                        {"fingerprints": buffer_prints, "step": ctx.step}, confidence=0.75)
        if _spread(prints) > self.REL * max(abs(p) for p in prints):
            self.report(ctx, "distributed", "ranks",
                        f"at step {ctx.step} the ranks' parameters differ (fingerprints "
                        f"{', '.join(f'{p:.6g}' for p in prints)}): the replicas have desynchronized (gradients not "
                        "averaged across ranks, or a rank that did not "
                        "load the same weights)", {"fingerprints": prints, "step": ctx.step}, confidence=0.8)
        elif len(set(hashes)) < len(hashes):
            self.report(ctx, "distributed", "data loader",
                        f"at step {ctx.step} several ranks trained on the same batch: the data is not sharded by rank "
                        "(each rank should see its own part of the global batch)", {"step": ctx.step},
                        confidence=0.75)


def _norms_print(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """The sum of the tensors' norms in float64, as int64 bits (gathered with a batch hash in one tensor)."""
    norms = torch._foreach_norm([t.float() for t in tensors]) if tensors and device.type != "meta" else []
    fingerprint = torch.stack(norms).double().sum() if norms else torch.zeros((), dtype=torch.float64)
    return fingerprint.to(device).view(1).view(torch.int64)[0]


def _spread(values: list[float]) -> float:
    return max(values) - min(values)


@register
class GoldenLayout(BlackBoxDetector):
    """The training rows' layout against the known-good runs' (``golden["layout"]``, per run the fractions of
    batches.FRACTIONS): rows starting with BOS, with two BOS, ending with EOS; full-width rows (each batch's longest,
    and any cut at the length limit) ending with EOS; cells that are padding past their batch's longest row. A
    property every known-good row or cell kept (a span of exactly [0, 0] or [1, 1]) is an invariant of the loop's
    format, as a correct loop lays out every row alike: the first step that breaks it is reported. Any other
    fraction is reported outside its span by more than ``TOL`` once ``MIN_ROWS`` rows were seen."""

    id = "bb_golden_layout"
    against_golden = True
    family = "data"
    description = "BOS/EOS placement, truncated rows' ends, padding width in the training rows vs the known-good runs'"
    TOL = 0.05
    MIN_ROWS = 64
    _TOKENIZED = "the documents are tokenized or truncated differently (special tokens added, missing or cut off)"
    # key -> (subsystem, where, what the fraction counts, what a departure means)
    TEXT = {
        "bos": ("data", "tokenizer", "training rows starting with BOS", _TOKENIZED),
        "bos2": ("data", "tokenizer", "training rows starting with two BOS", _TOKENIZED),
        "eos": ("data", "tokenizer", "training rows ending with EOS", _TOKENIZED),
        "full_eos": ("data", "tokenizer", "full-width training rows (each batch's longest, and any cut at the length "
                     "limit) ending with EOS", "rows cut at the length limit lose their document's end (the EOS is "
                     "cut off with the text, not kept as the last token)"),
        "idle": ("collate", "batch", "positions the model ran on that are padding past their batch's longest row",
                 "the batches are padded beyond their longest row (to a fixed length?): the same loss for more "
                 "compute and memory"),
    }

    def __init__(self) -> None:
        super().__init__()
        self._totals: dict[str, int] = {}  # the layout counts summed over the steps so far

    def on_start(self, ctx: WatchContext) -> None:
        if not (ctx.golden or {}).get("layout"):
            raise NotApplicable("no golden envelope with the training rows' layout")

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        if self.findings or not record.layout:
            return
        for key, value in record.layout.items():
            self._totals[key] = self._totals.get(key, 0) + value
        fractions = layout_fractions([self._totals])
        for key, span in ctx.golden["layout"].items():
            if span is not None and key in fractions and key in self.TEXT and self._departs(fractions[key], span):
                self._report(ctx, key, fractions[key], span)
                return

    def _departs(self, frac: float, span: list) -> bool:
        """Whether ``frac`` leaves the golden ``span``: at once where the span is an invariant ([0, 0] or [1, 1]),
        else by more than TOL once MIN_ROWS rows were seen."""
        if span[0] == span[1] and span[0] in (0.0, 1.0):
            return frac != span[0]
        return self._totals["rows"] >= self.MIN_ROWS and not span[0] - self.TOL <= frac <= span[1] + self.TOL

    def _report(self, ctx: WatchContext, key: str, frac: float, span: list) -> None:
        subsystem, where, counted, meaning = self.TEXT[key]
        golden = f"{span[0]:.0%}" if span[0] == span[1] else f"{span[0]:.0%}..{span[1]:.0%}"
        self.report(ctx, subsystem, where, f"{frac:.1%} of the {counted} where the known-good runs had {golden}: "
                    f"{meaning}", {"key": key, "fraction": frac, "golden": span, "rows": self._totals["rows"]},
                    confidence=0.7)


@register
class RNGContinuity(BlackBoxDetector):
    """A resumed loop draws from the global RNG where the run stopped: torch's generator state before the resumed
    segment's first training forward equals its state after the previous segment's last optimizer step (a loop
    that restores its RNG with its checkpoint). Dropout masks and random sampling otherwise differ from the
    uninterrupted run."""

    id = "bb_rng_continuity"
    family = "checkpoint"
    description = "resumed loop: torch's RNG state continues from where the previous segment stopped"

    def __init__(self) -> None:
        super().__init__()
        self._checked = False

    def on_start(self, ctx: WatchContext) -> None:
        if not _resumed(ctx) or ctx.previous is None or ctx.previous.rng_at_step is None:
            raise NotApplicable("no watched segment before a resume (watch(..., step=N, previous=...))")

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        if self._checked or ctx.rng_at_start is None:
            return
        self._checked = True
        if not torch.equal(ctx.rng_at_start, ctx.previous.rng_at_step):
            self.report(ctx, "checkpoint", "checkpoint",
                        f"the resumed run (step {ctx.start_step}) draws from a torch RNG state other than the one the "
                        "run stopped with: the generator's state was not restored with the checkpoint, so dropout "
                        "masks and random draws differ from the uninterrupted run", {"resumed_at": ctx.start_step},
                        confidence=0.6)
