"""The evaluation metric a loop reports, against the evaluation forwards the watch saw (black-box track).

A loop's evaluation loss is the mean next-token cross-entropy over the real target tokens of the documents it
evaluated. The watch sees each evaluation forward's batch and logits, so it can compute that NLL itself and compare
it with the value the loop reports (``Watch.observe(eval_loss=...)``; the HF callback hands Trainer's ``eval_loss``
over). Legitimate conventions differ in how batches are combined, not in what a token's loss is: a token mean over
the whole evaluation, the mean of per-batch token means (nanoGPT's estimate_loss), or per-batch means weighted by
rows (Trainer's gathered losses), over the evaluation's forwards since the last training forward (a loop may
evaluate several splits and report one: any contiguous run of them).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from faultbench.detectors.api import NotApplicable, register
from faultbench.detectors.blackbox.api import BlackBoxDetector, WatchContext
from faultbench.detectors.blackbox.probes import token_nll


def _labels_preshifted(ids: torch.Tensor, labels: torch.Tensor) -> bool:
    """Whether the labels are already the next tokens (``labels[t] == ids[t + 1]``, nanoGPT's targets) rather than
    aligned with the inputs for the model to shift (``labels[t] == ids[t]``, Hugging Face's)."""
    labelled = labels >= 0
    aligned = (labels == ids)[labelled].float().mean()
    shifted = (labels[:, :-1] == ids[:, 1:])[labelled[:, :-1]].float().mean()
    return bool(shifted > aligned)


def target_nll(batch: dict, logits: torch.Tensor | None) -> tuple[float, int] | None:
    """(summed -log p(target), number of targets) of one evaluation forward, where position t predicts the next
    token. Targets: the labels the loop passed (negative ones ignored), shifted unless they already are; without
    labels, the next input token where both positions are real (attention_mask). None when the forward has no
    (B, T, V) logits over its (B, T) tokens (a decoding step, last-position logits) or no target."""
    ids, labels, mask = batch.get("input_ids"), batch.get("labels"), batch.get("attention_mask")
    if not (isinstance(ids, torch.Tensor) and isinstance(logits, torch.Tensor) and ids.dim() == 2
            and logits.dim() == 3 and logits.shape[:2] == ids.shape and ids.shape[1] > 1):
        return None
    if isinstance(labels, torch.Tensor) and labels.shape == ids.shape:
        scores, targets = (logits, labels) if _labels_preshifted(ids, labels) else (logits[:, :-1], labels[:, 1:])
    else:
        has_mask = isinstance(mask, torch.Tensor) and mask.shape == ids.shape
        real = mask != 0 if has_mask else torch.ones_like(ids, dtype=torch.bool)
        scores, targets = logits[:, :-1], torch.where(real[:, :-1] & real[:, 1:], ids[:, 1:], -1)
    total, count = token_nll(scores, targets)
    return (total, count) if count else None


def spans(batches: np.ndarray, contiguous: bool) -> np.ndarray:
    """From per-forward (nll sum, targets, rows) ``batches``: per span of them, the sums each convention needs
    (nll, targets, per-batch token means, batches, rows x means, rows), over the whole of them or (``contiguous``)
    over every contiguous run of them: (spans, 6)."""
    sums, counts, rows = batches.T
    means = sums / counts
    terms = np.stack([sums, counts, means, np.ones_like(means), rows * means, rows], 1)
    prefix = np.vstack([np.zeros(6), np.cumsum(terms, 0)])
    n = len(batches)
    starts, ends = np.triu_indices(n + 1, 1) if contiguous else (np.array([0]), np.array([n]))
    return prefix[ends] - prefix[starts]


def conventions(span: np.ndarray) -> np.ndarray:
    """The evaluation losses a correct loop may report from ``spans``' sums: the token mean, the mean of per-batch
    token means, and their mean weighted by rows."""
    return np.concatenate([span[:, 0] / span[:, 1], span[:, 2] / span[:, 3], span[:, 4] / span[:, 5]])


@register
class EvalLoss(BlackBoxDetector):
    """The evaluation loss the loop reports equals the mean next-token NLL of its evaluation forwards, computed from
    their logits and batches (module doc: the conventions accepted), within ``REL``. Not applicable to a loop that
    reports no evaluation loss."""

    id = "bb_eval_loss"
    family = "eval"
    description = "the reported evaluation loss vs the next-token NLL of the evaluation forwards' logits"
    REL = 0.005  # the same logits give the loop's value to ~1e-7; margin for samples a gather drops or repeats

    def __init__(self) -> None:
        super().__init__()
        self._batches: list[tuple[float, int, int]] = []  # evaluation forwards since the last training forward
        self._reported = False

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        self._batches.clear()  # training resumed: the next evaluation starts afresh

    def on_eval_forward(self, ctx: WatchContext, batch: dict, logits) -> None:
        nll = target_nll(batch, logits)
        if nll is not None:
            self._batches.append((*nll, batch["input_ids"].shape[0]))

    def on_eval_loss(self, ctx: WatchContext, eval_loss: float, across_ranks: bool) -> None:
        self._reported = True
        batches = np.array(self._batches, dtype=np.float64).reshape(-1, 3)
        whole = spans(batches, contiguous=False)
        if across_ranks and ctx.world_size > 1 and torch.distributed.is_initialized():
            whole = np.array(ctx.all_gather(whole[0].tolist())).sum(0, keepdims=True)  # a collective: before any return
        if self.findings or not whole[0, 1] or not np.isfinite(whole).all():
            return
        candidates = conventions(whole if across_ranks else spans(batches, contiguous=True))
        if math.isfinite(eval_loss) and np.any(np.abs(candidates - eval_loss) <= self.REL * np.abs(candidates)):
            return
        whole = whole[0]
        token_mean = whole[0] / whole[1]
        self.report(ctx, "eval", "eval",
                    f"the reported evaluation loss {eval_loss:.4f} is not the mean next-token cross-entropy of the "
                    f"evaluation's forwards: {token_mean:.4f} over their {int(whole[1])} real target tokens (ratio "
                    f"{eval_loss / token_mean:.3f}): the eval metric is averaged over the wrong positions, scaled, or "
                    "not computed from the evaluated batches",
                    {"reported": eval_loss, "token_mean": token_mean, "batch_means": whole[2] / whole[3],
                     "targets": int(whole[1]), "forwards": int(whole[3]), "across_ranks": across_ranks},
                    confidence=0.75)

    def on_end(self, ctx: WatchContext) -> None:
        if not self._reported and not ctx.evaluations_follow:
            raise NotApplicable("the loop reported no evaluation loss (Watch.observe(eval_loss=...))")
