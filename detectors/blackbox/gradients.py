"""What the gradient w.r.t. the logits says about a loop's loss (black-box track).

A token-level cross-entropy, however a loop computes it (in the model or outside, mean or sum, one
micro-batch or a window of them, ignore_index or a weight mask), has the gradient

    d loss / d logits[b, t] = w[b, t] * (softmax(logits[b, t]) - onehot(y[b, t])),   w >= 0

(times the loss scale under a GradScaler; the watch divides it out). From the logits and that gradient
(``BlackBoxDetector.on_backward``) every position gives back the label y it was trained towards (the only
negative entry), the weight w the loss gave it (0: ignored), and so the loss itself, sum(w * nll), with no
assumption on the code that computed it. The detectors here compare that with the batch the model saw:

- ``bb_implied_labels``: the labels are the next input tokens (not the token itself, not the one after next,
  not another row's, not shifted by the padding);
- ``bb_loss_padding``: no weight on targets that are padding, and no real token ignored because its id is the
  pad id (pad == EOS);
- ``bb_loss_normalization``: a mean loss over the step's targets: the weights of one optimizer step (all its
  micro-batches; with ranks, all ranks' times the factor the backward's sync applies) sum to 1 and do not depend
  on which micro-batch a token was in.
A loss that is not a softmax cross-entropy of these logits (label smoothing, a temperature, distillation) is
recognized by the gradient's shape and these detectors say "not applicable". Beside them, on the gradients the
backward leaves: ``bb_reported_grad_norm``, the norm the loop reports (clips) is no larger than that.
"""

from __future__ import annotations

import collections
import functools
import math
import statistics
import weakref
from dataclasses import dataclass

import torch

from faultbench.detectors.api import NotApplicable, register
from faultbench.detectors.blackbox.api import BlackBoxDetector, StepRecord, WatchContext, guarded
from faultbench.detectors.blackbox.batches import shown_pad_id

MIN_POSITIONS = 8  # labelled positions a micro-batch needs before its labels say anything
SATURATED = 1e-4  # 1 - p(label) below this: the weight is not measurable (the loss is ~0 there anyway)


@dataclass
class Implied:
    """Per position (B, T) of one micro-batch: ``labelled`` (the gradient has a negative entry: the position is
    a target), ``y`` (that entry: the label), ``w`` (the weight; NaN where saturated, 0 where unweighted),
    ``nll`` (-log p(y)); ``y`` and ``nll`` mean something at labelled positions only; ``loss``: sum(w * nll), this
    micro-batch's share of the loss the backward differentiated; ``residual``: the gradient's distance from
    w * (softmax - onehot) on a sample of positions (relative; ~1e-6 in fp32, ~1e-2 from bf16 gradients; large for
    a loss that is not a softmax cross-entropy), when ``shape_checked`` (else None: not measured). A labels-only
    analysis (``implied(labels_only=True)``) has ``w``, ``nll`` and ``loss`` None."""

    labelled: torch.Tensor
    y: torch.Tensor
    w: torch.Tensor | None
    nll: torch.Tensor | None
    loss: float | None
    residual: float | None
    shape_checked: bool = True

    def weights(self) -> tuple[torch.Tensor, float, float]:
        """(the measurable labelled positions' weights, their median, the sum of every labelled position's weight:
        each saturated one counted with the median); (empty, 0, 0) when none is measurable."""
        known = self.w[self.labelled & ~self.w.isnan()]
        if known.numel() == 0:
            return known, 0.0, 0.0
        median = float(known.median())
        return known, median, float(known.sum()) + (int(self.labelled.sum()) - known.numel()) * median


# the last analysed gradient, weakly held (the watch and the detectors of one backward share it)
_cache: tuple[weakref.ref, Implied] | None = None


def _labels(g: torch.Tensor, g_y: torch.Tensor, guess: torch.Tensor | None) -> torch.Tensor:
    """The index of each position's minimum gradient entry (its label). ``guess``: (B, T) candidate labels,
    checked first: where the gradient's minimum sits at the candidate, that is the label (a cross-entropy gradient
    has one negative entry); only the other positions are searched (a full argmin costs ~10x one gather)."""
    if guess is None or guess.shape != g_y.shape:
        return g.argmin(-1)
    guess = guess.to(g.device).clamp(0, g.shape[-1] - 1)
    miss = g.gather(-1, guess.unsqueeze(-1)).squeeze(-1) != g_y
    if not bool(miss.any()):
        return guess
    y = guess.clone()
    y[miss] = g[miss].argmin(-1)
    return y


def _core(z: torch.Tensor, g_y: torch.Tensor, y: torch.Tensor):
    """(labelled, nll, 1 - p(y)) per position of float logits ``z``, given each position's minimum gradient entry
    ``g_y`` and its index ``y``."""
    nll = (-torch.log_softmax(z, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)).clamp(min=0)
    return g_y < 0, nll, -torch.expm1(-nll)


def _min_labels(g: torch.Tensor, guess: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each position's minimum gradient entry, its index: the label)."""
    g_y = g.amin(-1)
    return g_y, _labels(g, g_y, guess)


def next_tokens(batch: dict, logits: torch.Tensor) -> torch.Tensor | None:
    """(B, T) each position's next input token (the last column wraps around): the labels a causal LM's loss
    usually has, the candidates ``implied`` checks first; None when the batch's ids do not match the logits."""
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or tuple(ids.shape) != tuple(logits.shape[:2]):
        return None
    return ids.roll(-1, 1)


def _loss(g_y: torch.Tensor, nll: torch.Tensor, q: torch.Tensor) -> float:
    """sum(w * nll) = sum(-g_y * nll / q) over the labelled positions (g_y < 0): nll / q -> 1 where p(y) -> 1, and
    0 / 0 only where p(y) is exactly 1."""
    return -float((g_y.clamp(max=0) * torch.nan_to_num(nll / q, nan=1.0)).sum())


def _shaped(logits: torch.Tensor, grad: torch.Tensor) -> bool:
    return logits.dim() == 3 and grad.shape == logits.shape and logits.is_floating_point()


def implied(logits: torch.Tensor, grad: torch.Tensor, batch: dict | None = None,
            check_shape: bool = True, labels_only: bool = False) -> Implied | None:
    """The labels, weights and loss implied by ``grad`` = d loss / d ``logits`` (B, T, V), or None for other
    shapes. ``batch``: the forward's, whose next tokens are checked first as labels (a shortcut that changes no
    result); ``check_shape``: measure the residual too; ``labels_only`` (without ``check_shape``): the labels
    alone, no log-softmax. Cost: one min and one log-softmax over the logits (cached for the same ``grad``
    object)."""
    global _cache
    labels_only = labels_only and not check_shape  # the residual needs the weights
    cached = _cache[1] if _cache is not None and _cache[0]() is grad else None
    if cached is not None and (labels_only or cached.w is not None):
        if check_shape and not cached.shape_checked:
            with torch.no_grad():
                measurable = cached.labelled & ~cached.w.isnan()
                cached.residual = _residual(logits.detach().float(), grad.detach().float(), cached.y, cached.w,
                                            measurable)
            cached.shape_checked = True
        return cached
    if not _shaped(logits, grad):
        return None
    with torch.no_grad():
        z, g = logits.detach().float(), grad.detach().float()
        # the labels: those of a labels-only analysis of this gradient, now completed, else found
        g_y, y = (g.amin(-1), cached.y) if cached is not None else _min_labels(g, next_tokens(batch or {}, z))
        if labels_only:
            _cache = (weakref.ref(grad), Implied(g_y < 0, y, None, None, None, None, False))
            return _cache[1]
        labelled, nll, q = _core(z, g_y, y)
        measurable = labelled & (q > SATURATED)
        w = (-g_y / q.clamp(min=SATURATED)).masked_fill_(~measurable, 0.0)
        w.masked_fill_(labelled & ~measurable, math.nan)
        residual = _residual(z, g, y, w, measurable) if check_shape else None
        result = Implied(labelled, y, w, nll, _loss(g_y, nll, q), residual, check_shape)
    _cache = (weakref.ref(grad), result)
    return result


def implied_loss(logits: torch.Tensor, grad: torch.Tensor, batch: dict | None = None) -> float | None:
    """``implied(logits, grad, batch).loss``: the analysis of the same backward when a detector made it, else one
    without the residual."""
    result = implied(logits, grad, batch, check_shape=False)
    return None if result is None else result.loss


def _residual(z, g, y, w, measurable, sample: int = 32) -> float | None:
    """Relative distance of the gradient from w * (softmax - onehot(y)) over up to ``sample`` positions, evenly
    spread over the measurable ones."""
    idx = measurable.reshape(-1).nonzero()[:, 0]
    if idx.numel() == 0:
        return None
    idx = idx[:: -(-idx.numel() // sample)]
    vocab = z.shape[-1]
    gf = g.reshape(-1, vocab)[idx]
    expected = torch.softmax(z.reshape(-1, vocab)[idx], -1)
    expected.scatter_add_(1, y.reshape(-1)[idx, None], torch.full((idx.numel(), 1), -1.0, device=z.device))
    expected *= w.reshape(-1)[idx, None]
    return float(torch.dist(gf, expected, 1) / gf.norm(1).clamp(min=1e-30))


class _GradientDetector(BlackBoxDetector):
    """Shared: the implied targets of each training backward, after a check that the loss is a softmax
    cross-entropy of the logits the model returned (else not applicable)."""

    MAX_RESIDUAL = 0.03  # fp32: ~1e-6, bf16/fp16 gradients: ~1e-2 at most; label smoothing 0.2: ~0.08
    CHECKS = 2  # backwards whose gradient must not have the cross-entropy shape before giving up
    SHAPE_CONFIRM = 2  # backwards with the cross-entropy shape after which the loss is taken to be one

    def __init__(self) -> None:
        super().__init__()
        self._off_shape = 0
        self._on_shape = 0

    def implied_of(self, batch: dict, logits, grad, labels_only: bool = False) -> Implied | None:
        """The analysis of this backward (``labels_only``: its labels alone, once the loss's shape is confirmed), or
        None while the gradient does not have the cross-entropy shape."""
        if logits is None or grad is None:
            return None
        result = implied(logits, grad, batch, check_shape=self._on_shape < self.SHAPE_CONFIRM,
                         labels_only=labels_only)
        if result is None:
            raise NotApplicable("the model's output is not per-position logits (batch, positions, vocabulary)")
        if result.residual is not None and result.residual <= self.MAX_RESIDUAL:
            self._on_shape += 1
        if result.residual is not None and result.residual > self.MAX_RESIDUAL:
            self._off_shape += 1
            if self._off_shape >= self.CHECKS:
                raise NotApplicable(
                    f"the loss's gradient w.r.t. the logits is not w * (softmax - onehot) (relative residual "
                    f"{result.residual:.2g}): not a plain softmax cross-entropy of these logits (label smoothing, "
                    "a temperature, distillation?)")
            return None
        return result


def _tokens(batch: dict, implied_: Implied) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(input_ids, attention_mask or None) of the batch when they are laid out like the logits."""
    ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    if ids is None or ids.dim() != 2 or tuple(ids.shape) != tuple(implied_.y.shape):
        return None
    ids = ids.to(implied_.y.device)
    if mask is not None and tuple(mask.shape) != tuple(ids.shape):
        mask = None
    return ids, (None if mask is None else mask.to(ids.device).bool())


def next_token_rate(result: Implied, ids: torch.Tensor) -> float | None:
    """Share of the labelled positions (with a next input token) whose label is that next token; None when too
    few positions are labelled."""
    lab = result.labelled[:, :-1]
    if int(lab.sum()) < MIN_POSITIONS:
        return None
    return float(((result.y[:, :-1] == ids[:, 1:]) & lab).sum()) / float(lab.sum())


def _left_pads(mask: torch.Tensor | None, rows: int) -> list[int]:
    """Leading masked positions of each row (0 without a mask)."""
    if mask is None:
        return [0] * rows
    return [int(m.int().argmax()) if bool(m.any()) else int(m.numel()) for m in mask]


def _row_offsets(ids: torch.Tensor, y: torch.Tensor, labelled: torch.Tensor, min_rate: float = 0.8) -> list:
    """Per row: the offset k (-T < k < T) such that y[t] == ids[t + k] on at least ``min_rate`` of the row's
    labelled positions (the best one), or None (too few labelled positions, or no offset explains them)."""
    B, T = ids.shape
    best: list = [None] * B
    rates = [0.0] * B
    need = [max(3, int(n) // 2) for n in labelled.sum(1)]  # an offset must explain half of the row at least
    for k in range(-T + 1, T):
        lo, hi = max(0, -k), min(T, T - k)
        if hi <= lo:
            continue
        lab = labelled[:, lo:hi]
        hits = ((y[:, lo:hi] == ids[:, lo + k:hi + k]) & lab).sum(1)
        counts = lab.sum(1)
        for b in range(B):
            if int(counts[b]) >= need[b]:
                rate = float(hits[b]) / float(counts[b])
                if rate >= min_rate and rate > rates[b] + 1e-9:
                    best[b], rates[b] = k, rate
    return best


def _row_sources(ids: torch.Tensor, y: torch.Tensor, labelled: torch.Tensor, min_rate: float = 0.8) -> list:
    """Per row: the row r whose next tokens (ids[r, t + 1]) are this row's labels on at least ``min_rate`` of its
    labelled positions (the best one), or None."""
    lab = labelled[:, :-1]
    same = (y[:, None, :-1] == ids[None, :, 1:]) & lab[:, None, :]  # (B, B, T-1)
    counts = lab.sum(1).clamp(min=1)
    rates = same.sum(-1).float() / counts[:, None].float()
    best = rates.max(1)
    return [int(r) if float(v) >= min_rate and int(lab[b].sum()) >= 3 else None
            for b, (v, r) in enumerate(zip(best.values, best.indices, strict=True))]


@register
class ImpliedLabels(_GradientDetector):
    """The labels the loss trained each position towards (from the gradient w.r.t. the logits) are the next
    input tokens. When they are not, what explains them is reported: every row's own token (labels not
    shifted), the token after next (shifted twice), another row's next tokens (rows permuted), an offset that
    grows with each row's left padding (labels written at the wrong padding offset: collate). Labels that no
    offset or row explains are reported at a low confidence. A loop whose batch carries ``labels`` that are
    already wrong against its input ids is named at the batch (collate), else at the loss."""

    id = "bb_implied_labels"
    family = "loss"
    description = "labels implied by the logits' gradient vs the batch's next tokens (shift, permutation, padding)"
    ALIGNED = 0.9  # labelled positions whose label is the next token: at or above, the micro-batch is aligned
    MISALIGNED = 0.5  # below: the micro-batch's labels are not the next tokens
    CONFIRM = 2  # micro-batches in which the same explanation must hold
    CHECKS = 3  # micro-batches examined at most (the labels a loop builds do not change with training)

    def __init__(self) -> None:
        super().__init__()
        self.examined = 0
        self.verdicts: list[tuple[str, dict]] = []

    def on_backward(self, ctx: WatchContext, batch: dict, logits, grad_logits) -> None:
        self._examine(ctx, batch, logits, grad_logits)
        if self.examined >= self.CHECKS or self.findings:
            self.retire("on_backward")

    def _examine(self, ctx: WatchContext, batch: dict, logits, grad_logits) -> None:
        result = self.implied_of(batch, logits, grad_logits, labels_only=True)
        tokens = None if result is None else _tokens(batch, result)
        if tokens is None:
            return
        ids, mask = tokens
        rate = next_token_rate(result, ids)
        if rate is None:
            return
        self.examined += 1
        if rate >= self.ALIGNED:
            self.verdicts.clear()
            return
        verdict = self._explain(ids, mask, result, batch.get("labels"))
        if verdict[0] == "unexplained" and rate >= self.MISALIGNED:
            return
        verdict[1]["next_token_rate"] = round(rate, 3)
        verdict[1]["step"] = ctx.step
        self.verdicts.append(verdict)
        kinds = [v[0] for v in self.verdicts[-self.CONFIRM:]]
        if len(kinds) == self.CONFIRM and len(set(kinds)) == 1:
            self._report(ctx, *verdict)

    def _explain(self, ids, mask, result: Implied, labels) -> tuple[str, dict]:
        y, labelled = result.y, result.labelled
        offsets = _row_offsets(ids, y, labelled)
        pads = _left_pads(mask, ids.shape[0])
        explained = [(b, k) for b, k in enumerate(offsets) if k is not None]
        wrong = [(b, k) for b, k in explained if k != 1]
        evidence = {"rows": len(offsets), "row_offsets": offsets[:16], "left_pads": pads[:16]}
        if wrong and len(explained) >= max(2, len(offsets) // 2):
            if all(k - 1 == pads[b] for b, k in wrong) and any(pads[b] for b, _ in wrong) \
                    and all(k == 1 + pads[b] for b, k in explained):
                return "padding_offset", evidence
            k, n = collections.Counter(k for _, k in explained).most_common(1)[0]
            if k != 1 and n >= 0.8 * len(explained):
                return f"offset_{k}", evidence
        sources = _row_sources(ids, y, labelled)
        moved = [(b, r) for b, r in enumerate(sources) if r is not None and r != b]
        if moved and sum(r is not None for r in sources) >= max(2, len(sources) // 2):
            evidence["row_sources"] = sources[:16]
            evidence["labels_in_batch_permuted"] = _labels_permuted(ids, labels)
            return "permuted", evidence
        return "unexplained", evidence

    def _report(self, ctx: WatchContext, kind: str, evidence: dict) -> None:
        rate = evidence["next_token_rate"]
        first = self.verdicts[-self.CONFIRM][1]["step"]  # the step of the first of the agreeing micro-batches
        report = functools.partial(self.report, step=first)
        if kind == "padding_offset":
            report(ctx, "collate", "batch",
                        f"the loss trained each position towards the token (1 + the row's left padding) positions "
                        f"ahead, not the next one (only {rate:.0%} of the targets are next tokens; unpadded rows are "
                        "right): the labels are written at the wrong padding offset", evidence, confidence=0.85)
        elif kind.startswith("offset_"):
            k = int(kind.split("_")[1])
            what = {0: "its OWN input token: the labels are not shifted",
                    2: "the token after next: the labels are shifted twice"}.get(
                k, f"the token {k} positions ahead (or behind): the labels are shifted by {k - 1} too many")
            report(ctx, "loss", "loss",
                        f"the loss trained each position towards {what} (only {rate:.0%} of the targets the gradient "
                        "implies are the next input token)", evidence, confidence=0.9)
        elif kind == "permuted":
            in_batch = evidence.get("labels_in_batch_permuted")
            report(ctx, "collate" if in_batch else "loss", "batch" if in_batch else "loss",
                        f"the loss trained the rows towards the next tokens of OTHER rows of the batch (rows "
                        f"{evidence['row_sources'][:8]}): inputs and labels were reordered differently"
                        + (" (the batch's own labels already disagree with its input ids)" if in_batch else ""),
                        evidence, confidence=0.85)
        else:
            report(ctx, "loss", "loss",
                        f"the labels the gradient implies are not the next input tokens (only {rate:.0%} are) and no "
                        "shift or row order explains them", evidence, confidence=0.5)


def _labels_permuted(ids: torch.Tensor, labels) -> bool:
    """Whether the batch's ``labels`` (aligned with the ids, or shifted by one) belong to other rows' ids."""
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(ids.shape):
        return False
    labels = labels.to(ids.device)
    keep = labels >= 0
    own = [float(((labels == ids) & keep).sum()), float(((labels[:, :-1] == ids[:, 1:]) & keep[:, :-1]).sum())]
    if max(own) >= 0.9 * float(keep.sum()):
        return False
    shift = 0 if own[0] >= own[1] else 1
    lab, src = (labels, ids) if shift == 0 else (labels[:, :-1], ids[:, 1:])
    kept = lab >= 0
    rates = ((lab[:, None] == src[None]) & kept[:, None]).sum(-1).float() / kept.sum(1).clamp(min=1)[:, None]
    best = rates.argmax(1)
    moved = bool((best != torch.arange(len(best), device=best.device)).any())
    return moved and bool((rates.max(1).values >= 0.8).all())


@register
class LossPadding(_GradientDetector):
    """The loss gives no weight to targets that are padding (the next position's attention_mask is 0), and every
    real target (attention_mask 1) of the classes no correct loop masks by id gets weight: the EOS (the model must
    learn to stop, in pretraining and in fine-tuning alike) and the pad id where it is a real token (pad == EOS, and
    the collator masked every occurrence). Other real targets may be masked on purpose (a fine-tuning loop's prompt
    tokens), so a class is judged only while 90% of the other real targets get weight. The pad id is the declared
    one, else the id the batches hold where attention_mask is 0. Needs an attention_mask with padding, or a
    tokenizer."""

    id = "bb_loss_padding"
    family = "collate"
    description = "loss weights on padded targets; real EOS or pad-id targets ignored by id (pad == EOS)"
    MIN_SHARE = 0.02  # of the weighted targets: fewer on padding is left alone
    CONFIRM = 2
    CHECKS = 3  # aligned micro-batches examined at most

    def __init__(self) -> None:
        super().__init__()
        self.examined = 0

    def on_backward(self, ctx: WatchContext, batch: dict, logits, grad_logits) -> None:
        self._examine(ctx, batch, logits, grad_logits)
        if self.examined >= self.CHECKS:
            self.retire("on_backward")

    def _examine(self, ctx: WatchContext, batch: dict, logits, grad_logits) -> None:
        result = self.implied_of(batch, logits, grad_logits, labels_only=True)
        tokens = None if result is None else _tokens(batch, result)
        if tokens is None or tokens[1] is None:
            return
        ids, mask = tokens
        rate = next_token_rate(result, ids)
        # labels aligned with the next tokens first: a misaligned loss is bb_implied_labels' finding
        if rate is None or rate < ImpliedLabels.ALIGNED:
            return
        self.examined += 1
        lab, real_next = result.labelled[:, :-1], mask[:, 1:]
        on_pads = int((lab & ~real_next).sum())
        if on_pads >= max(2, self.MIN_SHARE * float(lab.sum())):
            self._hit(ctx, "on_pads", {"step": ctx.step, "weighted_pad_targets": on_pads,
                                       "weighted_targets": int(lab.sum())})
        # the token classes no correct loop masks by id: the pad id where it is a real token (pad == EOS) and EOS
        classes = dict.fromkeys(t for t in (_pad_id(ctx, ids, mask), ctx.conventions.eos_id) if t is not None)
        real = real_next & mask[:, :-1]
        for token in classes:
            real_class = real & (ids[:, 1:] == token)
            others = real & (ids[:, 1:] != token)
            n = int(real_class.sum())
            others_kept = float((lab & others).sum()) >= 0.9 * float(others.sum())
            if n >= 2 and not bool((lab & real_class).any()) and others_kept:
                self._hit(ctx, "token_ignored", {"step": ctx.step, "token": token, "ignored_real_targets": n,
                                                 "eos": token == ctx.conventions.eos_id})
                break

    def _hit(self, ctx: WatchContext, kind: str, evidence: dict) -> None:
        hits = self.tally(kind, evidence, self.CONFIRM)
        if not hits:
            return
        first = hits[0]
        if kind == "on_pads":
            self.report_once(kind, ctx, "collate", "batch",
                             f"the loss gives weight to {first['weighted_pad_targets']} of {first['weighted_targets']} "
                             "targets that are padding (the next position's attention_mask is 0): pad labels are not "
                             "ignored, the model is trained to predict padding", {"micro_batches": hits[:4]},
                             confidence=0.85, step=first["step"])
        else:
            self.report_once(kind, ctx, "collate", "batch",
                             f"every real target whose id is {first['token']} "
                             f"({'the EOS' if first['eos'] else 'the pad id'}; {first['ignored_real_targets']} in the "
                             "batch, attention_mask 1) gets no weight in the loss while the other real targets do: "
                             "the labels are masked by id (a pad id that is also a real token, or the EOS itself), so "
                             "the model never learns it" + (" and never learns to stop" if first["eos"] else ""),
                             {"micro_batches": hits[:4]}, confidence=0.8, step=first["step"])


def _pad_id(ctx: WatchContext, ids: torch.Tensor, mask: torch.Tensor) -> int | None:
    """The declared pad id (detectors.blackbox.conventions), else the single id the batch holds where attention_mask
    is 0."""
    return ctx.conventions.pad_id if ctx.conventions.pad_id is not None else shown_pad_id(ids, mask)


def _process_group() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _at_backward_end(fn, errors: list) -> None:
    """Call ``fn`` when the running backward has finished, after every callback it queued (a DDP reducer's, which
    writes the ranks' reduced gradients): a callback queued from a callback runs after them. Call from a hook
    that fires inside the backward."""
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(guarded(fn, errors)))


class _SyncProjection:
    """What a data-parallel backward does to the gradients it accumulated, on one random projection v (the same on
    every rank): ``local`` = sum over parameters of <gradient as the backward accumulated it, v> (read as each is
    accumulated, before a DDP-style sync writes the reduced one), ``synced`` = the same projection once the backward
    and the callbacks it queued (the sync's) have run. Without a sync inside the backward the two are equal."""

    def __init__(self, params: list[torch.Tensor]):
        gen = torch.Generator().manual_seed(0)
        self.params = params
        self.v = {id(p): torch.randn(p.shape, generator=gen).to(p.device) for p in params}
        self._dots: dict[int, torch.Tensor] = {}
        self.local: float | None = None
        self.synced: float | None = None
        self.errors: list[str] = []
        self._handles = [p.register_post_accumulate_grad_hook(guarded(self._accumulated, self.errors)) for p in params]

    def _dot(self, p: torch.Tensor) -> torch.Tensor:
        return (p.grad.detach().float() * self.v[id(p)]).sum()

    def _accumulated(self, p: torch.Tensor) -> None:
        self._dots[id(p)] = self._dot(p)

    def queue(self) -> None:
        """Read both projections at the end of the running backward (``_at_backward_end``)."""
        _at_backward_end(self._backward_done, self.errors)

    def _backward_done(self) -> None:
        touched = [p for p in self.params if id(p) in self._dots and p.grad is not None]
        if touched:
            self.local = float(sum(self._dots[id(p)] for p in touched))
            self.synced = float(sum(self._dot(p) for p in touched))
        self._dots = {}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@register
class LossNormalization(_GradientDetector):
    """A mean loss over the step's targets: the weights the loss gave the targets of one optimizer step, over
    all its micro-batches, sum to 1 (any correct normalization does: a window token count, a micro-batch mean
    divided by the accumulation steps when micro-batches are equal, Trainer's num_items_in_batch), and a token's
    weight does not depend on its micro-batch. Reported: a sum far from 1 (a summed loss, a per-micro-batch
    mean summed over the window, a double division, a count of the wrong targets; a sum equal to the loss
    scale: the loss scaled twice), and micro-batches with uniform but different weights (each averaged over its
    own tokens). With ranks the contract holds for the global batch, whatever each rank's share of the targets:
    the ranks' weight sums are all-gathered and multiplied by the factor the backward's sync applies to the sum of
    the ranks' gradients (measured on a random projection: 1 / world size for DDP's mean; a backward that syncs
    nothing counts as a mean taken later). A sum off 1 with that factor off the mean is a sync that does not
    average (gradients reduced twice, summed): named at the ranks. A golden envelope that recorded other sums
    is the user's convention."""

    id = "bb_loss_normalization"
    family = "loss"
    description = "sum of the loss's per-token weights over an optimizer step (mean loss: 1) and their uniformity"
    TOL = 0.03  # relative
    SYNC_TOL = 0.02  # relative: the sync's factor x world size against 1 (a mean over ranks)
    UNIFORM_TOL = 0.05  # relative spread of one micro-batch's weights to call them uniform
    CHECK_STEPS = 2  # steps checked at most (a loop's normalization does not change); with ranks: steps gathered

    def __init__(self) -> None:
        super().__init__()
        self._micro: list[dict] = []
        self._skips_seen = 0
        self._gathers = 0
        self._sync: _SyncProjection | None = None
        self._unfit: str | None = None  # with ranks: why this rank's loss is not a cross-entropy (decided together)
        self.sums: list[dict] = []
        self.uneven: list[dict] = []

    def _done(self, ctx: WatchContext) -> bool:
        return (self._gathers if ctx.world_size > 1 else len(self.sums)) >= self.CHECK_STEPS

    def on_start(self, ctx: WatchContext) -> None:
        if ctx.world_size > 1 and not _process_group():
            raise NotApplicable("several ranks without an initialized torch.distributed group: the ranks' weights "
                                "cannot be added up")

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        if ctx.world_size > 1 and self._sync is None and not self._done(ctx):
            self._sync = _SyncProjection([p for p in ctx.optimizer_params() if p.requires_grad])

    def on_backward(self, ctx: WatchContext, batch: dict, logits, grad_logits) -> None:
        if self._done(ctx):
            return
        if self._sync is not None:
            self._sync.queue()
        try:
            result = self.implied_of(batch, logits, grad_logits)
        except NotApplicable as e:
            if ctx.world_size == 1:
                raise
            self._unfit = str(e)  # the ranks give up together, at the next gather: each rank must take part in it
            result = None
        tokens = None if result is None else _tokens(batch, result)
        rate = None if tokens is None else next_token_rate(result, tokens[0])
        if result is None or (rate is not None and rate < ImpliedLabels.ALIGNED):
            self._micro.append({"unknown": True})  # misaligned labels are bb_implied_labels' finding
            return
        known, med, weight_sum = result.weights()
        entry = {"sum": weight_sum, "targets": int(result.labelled.sum()),
                 "scale": float(ctx.scaler.get_scale()) if ctx.scaler_enabled else None}
        if known.numel() >= MIN_POSITIONS:
            entry["median"] = med
            entry["uniform"] = bool(med > 0 and float((known - med).abs().max()) <= self.UNIFORM_TOL * med)
        self._micro.append(entry)

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        self._step(ctx, record)
        if self._done(ctx):  # on every rank at the same step
            for hook in ("on_forward", "on_backward", "on_after_step"):
                self.retire(hook)

    def _step(self, ctx: WatchContext, record: StepRecord) -> None:
        micro, self._micro = self._micro, []
        skipped, self._skips_seen = ctx.skipped_steps != self._skips_seen, ctx.skipped_steps
        if self._done(ctx):
            return
        valid = bool(micro) and not (skipped or record.skipped) and not any(m.get("unknown") for m in micro)
        point = {"step": record.step, "weight_sum": sum(m["sum"] for m in micro) if valid else 0.0,
                 "micro_batches": len(micro), "targets": sum(m["targets"] for m in micro) if valid else 0,
                 "scale": micro[-1]["scale"] if valid else None}
        if ctx.world_size > 1:
            valid = self._gather(ctx, point, valid)  # a collective: every rank calls it at the same steps
        if not valid or point["targets"] < MIN_POSITIONS:
            return
        self.sums.append(point)
        medians = [m["median"] for m in micro if m.get("uniform")]
        if len(micro) > 1 and len(medians) == len(micro) and max(medians) > (1 + 4 * self.UNIFORM_TOL) * min(medians):
            self.uneven.append({**point, "weights": medians})
        self._judge(ctx, point)

    def _gather(self, ctx: WatchContext, point: dict, valid: bool) -> bool:
        """All ranks' weight sums and sync projections of the step (an all-gather): ``point`` becomes the global
        batch's (weight_sum: the ranks' sums x the sync's factor; targets: all ranks'; sync: that factor x world
        size, 1 for a mean). False when a rank could not measure the step."""
        self._gathers += 1
        sync, world = self._sync, ctx.world_size
        local, synced = (sync.local, sync.synced) if sync is not None and sync.local is not None else (0.0, 0.0)
        valid = valid and sync is not None and sync.local is not None  # unread: the callback failed
        if sync is not None:
            sync.local = sync.synced = None
            if self._done(ctx):
                sync.remove()
        rows = ctx.all_gather([valid, self._unfit is not None, point["weight_sum"], point["targets"], local, synced])
        if any(r[1] for r in rows):
            if sync is not None:
                sync.remove()
            raise NotApplicable(self._unfit or "the loss's gradient w.r.t. the logits on another rank is not a plain "
                                               "softmax cross-entropy")
        if not all(r[0] for r in rows):
            return False
        local_sum, synced_mean = sum(r[4] for r in rows), sum(r[5] for r in rows) / world
        # a backward that left every rank's gradients as it accumulated them syncs nothing: a mean is taken later
        in_backward = any(r[4] != r[5] for r in rows) and local_sum != 0
        factor = synced_mean / local_sum if in_backward else 1 / world
        point.update(rank_sums=[r[2] for r in rows], weight_sum=factor * sum(r[2] for r in rows),
                     targets=int(sum(r[3] for r in rows)), sync=factor * world if in_backward else None)
        return math.isfinite(point["weight_sum"])

    def on_end(self, ctx: WatchContext) -> None:
        if self._sync is not None:
            self._sync.remove()
            if self._sync.errors:  # after the last collective: the watch reports it as this detector's error
                raise RuntimeError(f"reading the gradients at the end of a backward: {self._sync.errors[0]}")

    def on_crash(self, ctx: WatchContext, crash: dict) -> None:
        self.on_end(ctx)

    def _judge(self, ctx: WatchContext, point: dict) -> None:
        total = point["weight_sum"]
        off = abs(total - 1) > self.TOL
        if off and self._golden_allows(ctx, total):
            off = False
        if off:
            self._report_sum(ctx, point, total)
        elif self.uneven and len(self.uneven) >= 2:
            first = self.uneven[0]
            self.report_once("uneven", ctx, "loss", "loss",
                             f"the micro-batches of one optimizer step weigh their tokens differently (per-token "
                             f"weights {', '.join(f'{w:.3g}' for w in first['weights'])}): each micro-batch is "
                             "averaged over its own tokens, so accumulation is not one big batch (normalize by the "
                             "window's target count)", {"steps": self.uneven[:4]}, confidence=0.6,
                             step=first["step"] - 1)

    def _golden_allows(self, ctx: WatchContext, total: float) -> bool:
        """A golden envelope with recorded weight sums (the user's known-good convention) that covers ``total``."""
        spans = [s.get("weight_sum") for s in (ctx.golden or {}).get("steps", []) if s.get("weight_sum")]
        if not spans:
            return False
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
        return lo * (1 - self.TOL) <= total <= hi * (1 + self.TOL)

    def _report_sum(self, ctx: WatchContext, point: dict, total: float) -> None:
        k, targets, scale, sync = point["micro_batches"], point["targets"], point["scale"], point.get("sync")
        if sync is not None and abs(sync - 1) > self.SYNC_TOL:
            world = ctx.world_size
            what = "their SUM" if abs(sync / world - 1) < 0.1 else f"{sync:.3g} x their mean"
            subsystem, where, why = "distributed", "ranks", (
                f"the sync across the {world} ranks leaves the gradients at {what}, not the mean of the ranks' "
                f"gradients, while the ranks' losses are normalized for a mean (their weights sum to "
                f"{sum(point['rank_sums']):.3g}): every gradient is {total:.3g} x the mean loss's (reduced twice, "
                "or summed and not averaged)")
        elif scale and scale > 1 and abs(total / scale - 1) < 0.1:
            subsystem, where, why = "precision", "scaler", (f"the loss scale ({scale:g}): the loss is multiplied by "
                                                            "the scale twice")
        elif k > 1 and abs(total / k - 1) < 0.1:
            subsystem, where, why = "loss", "loss", (f"the number of micro-batches ({k}): each micro-batch is "
                                                     "averaged over its own targets and the means are summed")
        elif k > 1 and abs(total * k - 1) < 0.1:
            subsystem, where, why = "loss", "loss", (f"1 / the number of micro-batches ({k}): the loss is divided by "
                                                     "the accumulation steps twice")
        elif total > 2 and abs(total / targets - 1) < 0.5:
            subsystem, where, why = "loss", "loss", (f"about the number of targets ({targets}): the loss is summed "
                                                     "over the tokens, not averaged")
        else:
            subsystem, where, why = "loss", "loss", ("not 1: the loss is normalized by a count other than the "
                                                     "number of its targets")
        self.report_once("sum", ctx, subsystem, where,
                         f"the per-token weights of the loss over optimizer step {point['step']} sum to {total:.4g} "
                         f"instead of 1 (a mean over the step's {targets} targets): {why}",
                         {"steps": self.sums[:4], "world_size": ctx.world_size}, confidence=0.8,
                         step=point["step"] - 1)


@register
class ReportedGradNorm(BlackBoxDetector):
    """The gradient norm a loop reports for a step (``Watch.observe(grad_norm=...)``; the HF callback hands
    Trainer's ``grad_norm``, the norm it clipped) is at most the norm of the gradients the step's backwards left:
    measured once the step's last backward has finished (after every callback it queued, a DDP sync among them),
    divided by an enabled scaler's scale. Clipping and reporting a clipped norm only lower it; with ranks the bound
    is the largest rank's (a mean over ranks taken after the backward is no larger). A larger reported norm means
    the gradients grew between the backward and the clipping: reduced across the ranks once more (by the world
    size: named at the ranks), or multiplied by something else (named at the optimizer)."""

    id = "bb_reported_grad_norm"
    family = "optimizer"
    description = "the loop's reported (clipped) gradient norm vs the norm its backward left"
    TOL = 0.02  # relative: the loop's norm and ours differ by float summation order only
    CHECK_STEPS = 3  # steps measured (one norm at the end of each backward) and, with ranks, gathered
    CONFIRM = 2

    def __init__(self) -> None:
        super().__init__()
        self._measured: float | None = None
        self._bounds: dict[int, float] = {}  # step -> the norm its backwards left (the largest rank's)
        self._reports: dict[int, float] = {}  # step -> the norm the loop reported for it
        self._reported = False
        self._errors: list[str] = []  # of the measurements at the end of backwards

    def on_start(self, ctx: WatchContext) -> None:
        if ctx.world_size > 1 and not _process_group():
            raise NotApplicable("several ranks without an initialized torch.distributed group: no bound over ranks")

    def _checking(self, ctx: WatchContext) -> bool:
        return ctx.step - ctx.start_step < self.CHECK_STEPS

    def on_backward(self, ctx: WatchContext, batch: dict, logits, grad_logits) -> None:
        if self._checking(ctx):
            _at_backward_end(functools.partial(self._measure, ctx), self._errors)

    def _measure(self, ctx: WatchContext) -> None:
        grads = [p.grad.detach() for p in ctx.optimizer_params() if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else math.nan
        self._measured = norm / float(ctx.scaler.get_scale()) if ctx.scaler_enabled else norm

    def on_after_step(self, ctx: WatchContext, record: StepRecord) -> None:
        self._bound(ctx)
        if ctx.step - ctx.start_step >= self.CHECK_STEPS:  # every step to measure was: on every rank alike
            self.retire("on_backward")
            self.retire("on_after_step")

    def _bound(self, ctx: WatchContext) -> None:
        measured, self._measured = (math.nan if self._measured is None else self._measured), None
        if ctx.world_size > 1:  # a collective: every rank takes part at the same steps
            measured = max(row[0] for row in ctx.all_gather([measured]))
        self._bounds[ctx.step] = measured
        self._compare(ctx, ctx.step)

    def on_grad_norm(self, ctx: WatchContext, grad_norm: float) -> None:
        self._reported = True
        # reported after the backward and before the optimizer step (where a loop clips), or after the step
        step = ctx.step + 1 if self._measured is not None else ctx.step
        if step - ctx.start_step > self.CHECK_STEPS:
            return
        self._reports[step] = grad_norm
        self._compare(ctx, step)

    def _compare(self, ctx: WatchContext, step: int) -> None:
        if step not in self._bounds or step not in self._reports:
            return
        bound, reported = self._bounds.pop(step), self._reports.pop(step)
        if not (math.isfinite(bound) and math.isfinite(reported) and bound > 0) or reported <= (1 + self.TOL) * bound:
            return
        hits = self.tally("grown", {"step": step, "reported": reported, "backward": bound, "ratio": reported / bound},
                          self.CONFIRM)
        if hits is not None and len(hits) == self.CONFIRM:
            self._report(ctx, hits)

    def _report(self, ctx: WatchContext, hits: list[dict]) -> None:
        first, world = hits[0], ctx.world_size
        ratio = statistics.median(h["ratio"] for h in hits)
        if world > 1 and abs(ratio / world - 1) < 0.1:
            subsystem, where, why = "distributed", "ranks", (f"by the world size ({world}): the gradients the ranks' "
                                                             "sync already averaged are reduced (summed) once more "
                                                             "before the clipping")
        else:
            subsystem, where, why = "optimizer", "optimizer", ("between the backward and the clipping something "
                                                               "multiplies the gradients")
        self.report(ctx, subsystem, where,
                    f"the loop reports a gradient norm of {first['reported']:.4g} at step {first['step']} where its "
                    f"backward left gradients of norm {first['backward']:.4g} ({ratio:.3g} x, {len(hits)} steps): "
                    f"{why}; the clipping, the optimizer and the log see gradients {ratio:.3g} x too large",
                    {"steps": hits, "world_size": world}, confidence=0.7, step=first["step"] - 1)

    def on_end(self, ctx: WatchContext) -> None:
        if self._errors:  # after the last collective: the watch reports it as this detector's error
            raise RuntimeError(f"measuring the gradients at the end of a backward: {self._errors[0]}")
        if not self._reported:
            raise NotApplicable("the loop reported no gradient norm (Watch.observe(grad_norm=...))")
