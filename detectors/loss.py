"""Loss detectors: the next-token loss, its normalization, and the gradient it sends into the logits.

- ``loss_contract`` (on_start): the run's ``model.loss.lm_loss`` and ``model.loss.count_targets`` on
  crafted logits and a batch collated by the run: the loss must equal an independent next-token
  cross-entropy (shift by one, the collate ignore value honoured, sum / ``num_targets``); logits that
  put all mass on the next token give ~0, uniform logits give ln V per target whatever the batch.
- ``forward_loss_contract`` (on_start): the run's ``model.train.forward_loss`` must equal ``lm_loss``
  of the model's own logits for the batch it was given, and scale as 1 / ``num_targets``.
- ``logit_grad_scale`` (on_batch, on_backward; sampled steps): d(loss)/d(logits) of one target row has
  L1 norm 2 (1 - p_y) * scale / N <= 2 * scale / N (N: the step's target count, scale: the loss scale)
  and is zero on rows without a target. When the loss functions honour their contracts, an extra
  factor can only enter in the training step (``model.train.train_step``).
- ``loss_vs_floor`` (on_after_step, on_end): a train or validation loss far below the corpus's
  Bayes-optimal loss is impossible for a correct pipeline (a symptom: low confidence).
"""

from __future__ import annotations

import math

import torch

from faultbench.detectors import probes
from faultbench.detectors.api import Detector, register

FORWARD_LOSS = "model.train.forward_loss"


# ---------------------------------------------------------------------------------------------- helpers
def reference_loss(logits: torch.Tensor, labels: torch.Tensor, ignore: int, num_targets: float | None = None):
    """Independent next-token cross-entropy: position t scored against labels[t + 1], ``ignore`` skipped,
    summed and divided by ``num_targets`` (default: the number of scored positions)."""
    logp = logits[:, :-1].double().log_softmax(-1)
    target = labels[:, 1:]
    valid = target != ignore
    picked = logp.gather(-1, target.clamp(min=0, max=logits.size(-1) - 1).unsqueeze(-1)).squeeze(-1)
    total = -(picked * valid).sum()
    n = int(valid.sum()) if num_targets is None else num_targets
    return float(total / max(n, 1))


def probe_batch(ctx) -> dict | None:
    """A small batch collated by the run (documents of increasing, distinct lengths); None if collate fails or its
    labels hold no ignore value (every pad a target: the loss cannot be judged on them; collate's contract can)."""
    try:
        batch = probes.probe_batch(ctx)
    except Exception:
        return None
    ignore = probes.ignore_value(batch["labels"].cpu(), batch["attention_mask"].cpu())
    return None if 0 <= ignore < _vocab(ctx) else batch


def _vocab(ctx) -> int:
    return int(ctx.fact("vocab_size"))


def lm_loss_problems(ctx) -> dict | None:
    """Contract checks of the run's lm_loss; {} if it honours them, None if no probe batch could be built.

    Computed once per run (several detectors use the verdict to localize)."""
    return ctx.memo("loss.lm_loss_problems", lambda: _lm_loss_problems(ctx))


def _lm_loss_problems(ctx) -> dict | None:
    batch = probe_batch(ctx)
    if batch is None:
        return None
    labels, mask = batch["labels"].cpu(), batch["attention_mask"].cpu()
    ignore = probes.ignore_value(labels, mask)
    lm_loss = ctx.role("loss")
    V = _vocab(ctx)
    B, T = labels.shape
    n = int((labels[:, 1:] != ignore).sum())
    gen = torch.Generator().manual_seed(1234)
    problems: dict = {}
    evidence = {"ignore_value": ignore, "targets": n, "vocab": V, "batch_shape": [B, T]}

    def call(logits, lab, num=None):
        return float(lm_loss(logits, lab, num) if num is not None else lm_loss(logits, lab))

    # 1) uniform logits: ln V per target (a token mean, whatever the batch size)
    try:
        uniform = call(torch.zeros(B, T, V), labels)
    except Exception as exc:  # crashes on the batch as collated: does it work without ignored labels?
        clean_labels = labels.clone()
        clean_labels[clean_labels == ignore] = 0
        try:
            call(torch.zeros(B, T, V), clean_labels)
            works_without = True
        except Exception:
            works_without = False
        problems["raises"] = (f"lm_loss raises on a batch collated by the run ({type(exc).__name__}: "
                              f"{str(exc)[:120]})" + (f"; it works once the ignore value {ignore} is replaced by "
                                                      "a real token id: it does not honour collate's ignore value"
                                                      if works_without else ""))
        evidence["works_without_ignored_labels"] = works_without
        return {"problems": problems, "evidence": evidence}
    evidence["uniform_loss"] = uniform
    if not probes.close(uniform, math.log(V), 1e-3):
        ratio = uniform / math.log(V)
        hint = ""
        if probes.close(ratio, n, 0.02):
            hint = f": the sum over the {n} targets, never divided by their count"
        problems["uniform"] = (f"uniform logits give {uniform:.4g}, expected ln V = {math.log(V):.4g} "
                               f"(x{ratio:.3g}){hint}")
    # 2) num_targets scales the result
    try:
        doubled = call(torch.zeros(B, T, V), labels, 2 * n)
        evidence["uniform_loss_num_targets_2n"] = doubled
        if not probes.close(doubled * 2, call(torch.zeros(B, T, V), labels, n), 1e-3):
            problems["num_targets"] = (f"num_targets={2 * n} gives {doubled:.4g}, expected half of the value at "
                                       f"num_targets={n}: the result does not scale as 1 / num_targets")
    except Exception as exc:
        problems["num_targets"] = f"lm_loss raises with num_targets given ({type(exc).__name__}: {str(exc)[:120]})"
    # 3) all mass on the next token -> ~0; all mass on the current token -> high
    next_tok = torch.full((B, T, V), -20.0)
    nxt = labels[:, 1:].clamp(min=0, max=V - 1)
    next_tok[:, :-1].scatter_(-1, nxt.unsqueeze(-1), 20.0)
    copy_tok = torch.full((B, T, V), -20.0)
    copy_tok.scatter_(-1, batch["input_ids"].cpu().clamp(0, V - 1).unsqueeze(-1), 20.0)
    l_next, l_copy = call(next_tok, labels), call(copy_tok, labels)
    evidence.update(next_token_logits_loss=l_next, copy_token_logits_loss=l_copy,
                    copy_token_reference=reference_loss(copy_tok, labels, ignore))
    if l_next > 1e-2:
        problems["shift"] = (f"logits that put all mass on the NEXT token give loss {l_next:.4g} (expected ~0)"
                             + (f", logits that copy the CURRENT token give {l_copy:.4g}: positions are scored "
                                "against the wrong label (the next-token shift is wrong)" if l_copy < l_next else ""))
    # 4) random logits vs the independent reference, with the default and an explicit num_targets
    rand = torch.randn(B, T, V, generator=gen) * 2
    for num in (None, 3 * n):
        try:
            got, want = call(rand, labels, num), reference_loss(rand, labels, ignore, num)
        except Exception as exc:
            problems.setdefault("random", f"lm_loss raises on random logits ({type(exc).__name__})")
            break
        evidence[f"random_{'default' if num is None else 'n3'}"] = [got, want]
        if not probes.close(got, want, 1e-4) and "random" not in problems:
            problems["random"] = (f"random logits: lm_loss = {got:.6g}, next-token cross-entropy / num_targets = "
                                  f"{want:.6g} (num_targets={num})")
    # 5) the logits of positions without a target must not matter
    perturbed = rand.clone()
    no_target = torch.cat([labels[:, 1:] == ignore, torch.ones(B, 1, dtype=torch.bool)], 1)
    perturbed[no_target] += torch.randn(int(no_target.sum()), V, generator=gen) * 5
    if not probes.close(call(perturbed, labels), call(rand, labels), 1e-5):
        problems["ignored_rows"] = "changing the logits of positions without a target changes the loss"
    # 6) reduced-precision logits are scored like their fp32 values
    half = rand.to(torch.bfloat16)
    got_half, want_half = call(half, labels), reference_loss(half.float(), labels, ignore)
    if not probes.close(got_half, want_half, 1e-2):
        problems["low_precision"] = (f"bf16 logits: lm_loss = {got_half:.5g}, fp32 cross-entropy of the same = "
                                     f"{want_half:.5g}")
    return {"problems": problems, "evidence": evidence}


def token_loss_problem(ctx) -> str | None:
    """The run's token_loss role on random (N, V) logits with some targets ignored, against the cross-entropy computed
    here: summed / num_targets when given, the targets' mean otherwise; None when it keeps that contract."""
    gen = torch.Generator().manual_seed(21)
    V = _vocab(ctx)
    logits = torch.randn(24, V, generator=gen) * 2
    targets = torch.randint(0, V, (24,), generator=gen)
    targets[::4] = IGNORE_PROBE
    kept = targets != IGNORE_PROBE
    nll = -logits.double().log_softmax(-1)[kept].gather(-1, targets[kept, None]).squeeze(-1)
    fn = ctx.role("token_loss")
    for num, want in ((None, float(nll.mean())), (40, float(nll.sum() / 40))):
        try:
            got = float(fn(logits, targets, num))
        except Exception as exc:  # noqa: BLE001 - raising on documented input breaks the contract
            return f"the token loss raises ({type(exc).__name__})"
        if not probes.close(got, want, 1e-4):
            return (f"the token loss gives {got:.5g} where the cross-entropy "
                    f"{'mean' if num is None else f'sum / {num}'} is {want:.5g}")
    return None


IGNORE_PROBE = -100  # the ignore value of the token-loss probe: the one PyTorch's cross_entropy defaults to


def forward_loss_problems(ctx) -> dict | None:
    """Contract checks of the run's forward_loss against the run's lm_loss (computed once per run)."""
    return ctx.memo("loss.forward_loss_problems", lambda: _forward_loss_problems(ctx))


def _forward_loss_problems(ctx) -> dict | None:
    batch = probe_batch(ctx)
    if batch is None:
        return None
    run = ctx.run
    model = run.model
    precision = ctx.config.train.precision
    ignore = probes.ignore_value(batch["labels"].cpu(), batch["attention_mask"].cpu())
    n = int((batch["labels"][:, 1:] != ignore).sum())
    lm_loss = ctx.role("loss")
    forward_loss = ctx.seam(FORWARD_LOSS)
    autocast = ctx.seam("model.precision.autocast_context")
    device_type = batch["input_ids"].device.type
    problems: dict = {}
    evidence: dict = {"targets": n, "precision": precision}
    with ctx.probe():
        for prec in dict.fromkeys(("fp32", precision)):
            try:
                with autocast(prec, device_type):
                    logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
                    again = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
                want = {k: float(lm_loss(logits, batch["labels"], k)) for k in (n, 3 * n)}
            except Exception:
                return None  # lm_loss or the model itself is broken: other contracts report it
            if not (bool(torch.isfinite(logits).all()) and torch.equal(logits, again)
                    and all(math.isfinite(v) for v in want.values())):
                return None  # non-finite or non-deterministic logits: the model's problem, not forward_loss's
            try:
                got = {k: float(forward_loss(model, batch, k, prec)) for k in (n, 3 * n)}
            except Exception as exc:
                problems[prec] = f"forward_loss raises ({type(exc).__name__}: {str(exc)[:120]})"
                continue
            evidence[prec] = {"forward_loss": [got[n], got[3 * n]], "lm_loss_of_logits": [want[n], want[3 * n]]}
            rel = 1e-4 if prec == "fp32" else 1e-3
            if not probes.close(got[n], want[n], rel):
                problems[prec] = (f"forward_loss = {got[n]:.6g} but lm_loss of the model's logits for the same batch "
                                  f"= {want[n]:.6g} (num_targets={n})"
                                  f"{_row_diagnosis(forward_loss, model, batch, n, prec, got[n], rel)}")
            elif not probes.close(got[3 * n] * 3, got[n], rel):
                problems[prec] = (f"forward_loss does not scale as 1/num_targets: {got[n]:.5g} at {n}, "
                                  f"{got[3 * n]:.5g} at {3 * n} (expected {got[n] / 3:.5g})")
            if problems:
                break
    return {"problems": problems, "evidence": evidence}


def _row_diagnosis(forward_loss, model, batch: dict, n: int, prec: str, got: float, rel: float) -> str:
    """': ...' when forward_loss of the batch (``got``) is not the sum of its rows' losses, each row scored
    alone with the same ``num_targets`` (a token-sum loss is additive over rows), or changes when the
    rows are reordered at random; '' otherwise."""
    rows = batch["input_ids"].shape[0]

    def pick(index) -> dict:
        return {k: (v[index] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v)
                for k, v in batch.items()}

    try:
        alone = sum(float(forward_loss(model, pick(slice(r, r + 1)), n, prec)) for r in range(rows))
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(5)).to(batch["input_ids"].device)
        shuffled = float(forward_loss(model, pick(order), n, prec))
    except Exception:  # noqa: BLE001 - the mismatch itself is the finding
        return ""
    if not probes.close(alone, got, rel):
        return (f": the batch's loss is not the sum of its rows' losses scored alone ({alone:.6g}): rows are not "
                "scored independently (inputs, logits and labels of different rows no longer line up)")
    if not probes.close(shuffled, got, rel):
        return f": it changes when the batch's rows are reordered ({shuffled:.6g})"
    return ""


# -------------------------------------------------------------------------------------------- detectors
@register
class LossContract(Detector):
    id = "loss_contract"
    needs_facts = ("train_docs", "seq_len", "pad_id", "vocab_size", "pad_side", "device")
    needs_roles = ("collate", "loss", "count_targets")
    family = "loss"
    passive = False
    description = ("lm_loss / count_targets on crafted logits and a collated batch: next-token shift, ignore value, "
                   "token-mean normalization, num_targets scaling")

    def on_start(self, ctx) -> None:
        batch = probe_batch(ctx)
        if batch is None:
            return
        labels, mask = batch["labels"].cpu(), batch["attention_mask"].cpu()
        ignore = probes.ignore_value(labels, mask)
        want = int((labels[:, 1:] != ignore).sum())
        try:
            got = int(ctx.role("count_targets")(labels))
        except Exception as exc:
            got = f"raises {type(exc).__name__}"
        if got != want:
            self.report(ctx, "loss", ctx.role_seam("count_targets"),
                        f"count_targets = {got} on a collated batch with {want} labels != {ignore} after the shift",
                        {"got": got, "expected": want, "ignore_value": ignore}, confidence=0.9)
        result = lm_loss_problems(ctx)
        if result and result["problems"]:
            part = token_loss_problem(ctx) if "token_loss" in ctx.roles else None
            self.report(ctx, "loss", ctx.role_seam("token_loss" if part else "loss"),
                        "the loss breaks its contract: " + "; ".join(result["problems"].values())
                        + (f"; {part}" if part else ""),
                        {**result["evidence"], "failed": sorted(result["problems"])}, confidence=0.9)


@register
class ForwardLossContract(Detector):
    id = "forward_loss_contract"
    needs_run = ("corpus.train", "tokenizer.pad_id")
    needs_config = ("model.vocab_size", "train.precision", "train.device")
    needs_roles = ("collate", "loss")
    needs_seams = (FORWARD_LOSS,)
    family = "loss"
    passive = False
    description = "forward_loss(model, batch, n) == lm_loss(model logits, batch labels, n), and scales as 1/n"

    def on_start(self, ctx) -> None:
        contract = lm_loss_problems(ctx)
        if contract is None or contract["problems"]:
            return  # lm_loss itself is broken: forward_loss cannot be judged by it (loss_contract reports)
        result = forward_loss_problems(ctx)
        if result and result["problems"]:
            self.report(ctx, "loss", FORWARD_LOSS,
                        "forward_loss breaks its contract: " + "; ".join(result["problems"].values()),
                        result["evidence"], confidence=0.9)


@register
class LogitGradScale(Detector):
    id = "logit_grad_scale"
    needs_facts = ("train_docs", "pad_id", "vocab_size", "precision", "device")
    needs_roles = ("collate", "loss", "train_step")
    family = "loss"
    passive = True
    description = ("d(loss)/d(logits) per target row has L1 <= 2*scale/N (N: the step's targets) and is zero on rows "
                   "without a target; on one rank it is exactly scale * (softmax - onehot) / N")

    def __init__(self) -> None:
        super().__init__()
        self._labels: list = []
        self._targets = 0
        self._sampled = False
        self._seen = 0
        self._ratios: list[float] = []
        self._nonfinite = 0
        self._reported: set[str] = set()
        self._ignore: int | None = None
        self._logits: list = []

    ROWS = 8  # rows of each micro-batch checked (the bound holds row by row)

    def on_start(self, ctx) -> None:
        self._verdicts(ctx)  # the verdicts used to localize, computed outside the training steps

    @staticmethod
    def _verdicts(ctx) -> tuple[dict | None, dict | None]:
        """The loss role's verdict and, where the run has the reference's forward_loss, that one's."""
        fl = forward_loss_problems(ctx) if ctx.known_seam(FORWARD_LOSS) else {"problems": {}}
        return lm_loss_problems(ctx), fl

    def on_batch(self, ctx, micro_batches) -> None:
        self._sampled = probes.sampled(ctx.step, first=2, every=16) and len(self._reported) < 2
        self._logits = []
        if not self._sampled:
            return
        if self._ignore is None:
            mb = micro_batches[0]
            self._ignore = probes.ignore_value(mb["labels"], mb["attention_mask"])
        self._labels = [mb["labels"] for mb in micro_batches]
        self._inputs = [mb["input_ids"] for mb in micro_batches]
        self._targets = int(sum(int((lab[:, 1:] != self._ignore).sum()) for lab in self._labels))
        self._seen = 0
        self._logits = []

    def on_forward(self, ctx, batch, logits) -> None:
        if self._sampled:
            self._logits.append(logits.detach())  # a reference only: checked if its gradient turns out non-finite

    def on_backward(self, ctx, batch, grad_logits) -> None:
        if not self._sampled or self._targets == 0:
            return
        index = self._seen
        self._seen += 1
        scale = float(ctx.run.scaler.get_scale()) if ctx.run.scaler.is_enabled() else 1.0
        rows = min(grad_logits.size(0), self.ROWS)
        row_l1 = grad_logits.detach()[:rows].float().abs().sum(-1)  # (rows, T): a sample of the batch's rows
        bound = 2.0 * scale / self._targets
        worst = float(row_l1.max())  # NaN propagates through max
        finite = math.isfinite(worst)
        worst = worst if finite else math.inf
        ratio = worst / bound
        tolerance = 1.5 if ctx.run.world_size == 1 else 2.5  # other ranks' counts are not known here
        evidence = {"max_row_l1": worst, "bound_2scale_over_N": bound, "ratio": ratio, "targets_N": self._targets,
                    "loss_scale": scale, "micro_batch": index, "accum": len(self._labels),
                    "world_size": ctx.run.world_size}
        logits = self._logits[index] if index < len(self._logits) else None
        if ratio > tolerance and "scale" not in self._reported:
            self._reported.add("scale")
            if finite or (scale > 1 and logits is not None and bool(torch.isfinite(logits).all())):
                # (non-finite gradients of non-finite logits are a forward problem: nonfinite_origin's business)
                self._report_scale(ctx, ratio, finite, evidence)
        elif finite and ctx.run.world_size == 1 and logits is not None and index < len(self._labels) \
                and "scale" not in self._reported:
            exact = self._exact_ratio(grad_logits[:rows], logits[:rows], self._labels[index][:rows]) / scale
            if abs(exact - 1) > (0.02 if ctx.fact("precision") == "fp32" else 0.1):
                self._reported.add("scale")
                self._report_scale(ctx, exact, True, {**evidence, "exact_ratio": exact}, exact=True)
        # rows whose next label is ignored (and the last column) must get no gradient
        if finite and ctx.step < 2 and index < len(self._labels) and "ignored" not in self._reported:
            labels = self._labels[index]
            same_input = batch["input_ids"] is self._inputs[index] or (
                batch["input_ids"].shape == self._inputs[index].shape and torch.equal(batch["input_ids"],
                                                                                      self._inputs[index]))
            if same_input and labels[:rows].shape == row_l1.shape:
                labels = labels[:rows]
                no_target = torch.cat([labels[:, 1:] == self._ignore,
                                       torch.ones_like(labels[:, :1], dtype=torch.bool)], 1)
                leak = row_l1[no_target]
                if leak.numel() and bool((leak != 0).any()):
                    self._reported.add("ignored")
                    self.report(ctx, "loss", None,
                                f"{int((leak != 0).sum())} positions without a target (next label = {self._ignore} or "
                                "the last column) receive a gradient in the logits",
                                {**evidence, "max_leak_l1": float(leak.abs().max())}, confidence=0.5)

    def _exact_ratio(self, grad: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> float:
        """<grad, g> / <g, g> for g = (softmax(logits) - onehot(next label)) / N on the target positions: the gradient
        of the window's token-mean loss over its N targets (rows x T)."""
        next_labels = labels[:, 1:].to(logits.device)
        valid = next_labels != self._ignore
        p = logits[:, :-1].double().softmax(-1)
        p.scatter_add_(-1, next_labels.clamp(min=0).unsqueeze(-1), -torch.ones_like(p[..., :1]))
        g = p * valid.unsqueeze(-1) / self._targets
        live = grad[:, :-1].double()
        norm = float((g * g).sum())
        return float((live * g).sum()) / norm if norm > 0 else 1.0

    def _report_scale(self, ctx, ratio, finite, evidence, exact: bool = False) -> None:
        lm, fl = self._verdicts(ctx)
        if lm is None or fl is None or lm["problems"] or fl["problems"]:
            return  # the loss functions break their contracts: their own detectors localize it
        if exact:
            what = (f"d(loss)/d(logits) is {ratio:.3g}x the gradient of the window's token-mean loss over its "
                    f"{evidence['targets_N']} targets")
        else:
            what = (f"d(loss)/d(logits) is {ratio:.3g}x the largest value a token-mean loss allows"
                    if finite else "d(loss)/d(logits) overflows to inf/NaN although a token-mean loss bounds it by "
                                   f"{evidence['bound_2scale_over_N']:.3g}")
        seam = ctx.role_seam("accumulation") or ctx.role_seam("train_step")
        self.report(ctx, ctx.seams.get(seam, "optimizer"), seam,
                    f"{what}; the loss functions honour their contracts, so the extra factor enters in the "
                    "training step (how it normalizes or scales the micro-batch losses)", evidence,
                    confidence=0.75 if finite else 0.6)


@register
class LossVsFloor(Detector):
    id = "loss_vs_floor"
    family = "loss"
    passive = True
    description = "train/val loss far below the corpus's Bayes-optimal loss (impossible for a correct pipeline)"

    FRACTION = 0.6  # a loss below this share of the floor (nats per token) cannot come from a correct run

    def __init__(self) -> None:
        super().__init__()
        self._below = 0
        self._train_below = False

    def on_after_step(self, ctx, record) -> None:
        floor = ctx.fact("loss_floor")
        loss = float(record.loss)
        if math.isfinite(loss) and loss < self.FRACTION * floor:
            self._below += 1
        else:
            self._below = 0
        if self._below >= 2 and not self._train_below:
            self._train_below = True
            self.report(ctx, "loss", None,
                        f"train loss {loss:.3f} is far below the corpus's Bayes-optimal loss {floor:.3f} nats per "
                        "token (two steps in a row): the targets leak into the inputs or the loss is not a next-token "
                        "cross-entropy over real tokens", {"loss": loss, "loss_floor": floor, "step": record.step},
                        confidence=0.35)

    def on_end(self, ctx, metrics) -> None:
        floor = ctx.fact("loss_floor")
        val = metrics.get("val_loss")
        if val is None or not math.isfinite(val) or val >= 0.9 * floor or self._train_below:
            return
        recent = [float(r.loss) for r in ctx.run.history[-4:] if math.isfinite(float(r.loss))]
        train = sum(recent) / len(recent) if recent else math.nan
        evidence = {"val_loss": val, "loss_floor": floor, "recent_train_loss": train}
        if math.isfinite(train) and val < 0.5 * train:
            # a correct evaluation of a model trained this briefly gives about its recent train loss
            self.report(ctx, "eval", ctx.known_seam("model.evaluate.evaluate"),
                        f"val loss {val:.3f} is below the corpus's Bayes-optimal loss {floor:.3f} and less than half "
                        f"the recent train loss {train:.3f}: the evaluation does not measure next-token cross-entropy "
                        "over real tokens", evidence, confidence=0.4)
        else:
            self.report(ctx, "loss", None,
                        f"val loss {val:.3f} is below the corpus's Bayes-optimal loss {floor:.3f} (recent train loss "
                        f"{train:.3f}): the scored targets are easier than real next tokens (e.g. pads scored, or "
                        "targets visible in the inputs)", evidence, confidence=0.3)
