"""Eval detectors: the eval loop's contract and the train/val split.

``eval_contract`` probes the run's ``evaluate`` (documented: mean next-token cross-entropy per
predicted token over real targets, in eval mode, without grads, batch-size independent, the model's
mode restored afterwards). It calls ``evaluate`` with the model in train mode and watches the mode of
every forward it makes, then recomputes the same number from the run's own collate and model (same
batches, same autocast), so a difference can only come from the loop's aggregation; the run's loss
function is checked first so a broken loss is not blamed on the loop. During the real end-of-run
evaluation a forward pre-hook checks that the model is in eval mode.

``split_overlap`` checks that no validation document is also a training document, and probes the run's
``split_of`` (the seam that owns the split): the texts of the corpus's val documents must be assigned
to val and those of its train documents to train.
"""

from __future__ import annotations

import torch.nn.functional as F

from faultbench.detectors import probes
from faultbench.detectors.api import Detector, register

EVALUATE = "model.evaluate.evaluate"
COLLATE = "model.data.collate"
LM_LOSS = "model.loss.lm_loss"
COUNT_TARGETS = "model.loss.count_targets"
AUTOCAST = "model.precision.autocast_context"
PROBE_DOCS = 48
PROBE_BATCH = 16
REL_TOL = 1e-3


def replicate_eval(ctx, docs, batch_size: int) -> dict:
    """What ``evaluate`` must return on ``docs``: the summed cross-entropy of every non-ignored label over
    their count, from the run's collate and model in eval mode, and whether the run's lm_loss and
    count_targets agree with a plain cross-entropy on these batches. Call inside ``ctx.probe()``."""
    cfg, model = ctx.config, ctx.run.model
    tok = ctx.run.tokenizer
    collate, lm_loss, count_targets = ctx.seam(COLLATE), ctx.seam(LM_LOSS), ctx.seam(COUNT_TARGETS)
    ignore = probes.default_ignore_index(collate)
    ignore = -100 if ignore is None else ignore  # cross_entropy's default
    device = next(model.parameters()).device
    model.eval()
    total, count, loss_fn_ok, notes = 0.0, 0, True, []
    for i in range(0, len(docs), batch_size):
        batch = {k: v.to(device) for k, v in collate(list(docs[i : i + batch_size]), tok.pad_id,
                                                      cfg.data.pad_side).items()}
        with ctx.seam(AUTOCAST)(cfg.train.precision, device.type):
            logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        targets = batch["labels"][:, 1:]
        s = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                            ignore_index=ignore, reduction="sum").item()
        n = int((targets != ignore).sum())
        total, count = total + s, count + n
        theirs_n = count_targets(batch["labels"])
        theirs = float(lm_loss(logits, batch["labels"], n))
        if theirs_n != n or abs(theirs - s / max(n, 1)) > REL_TOL * max(1.0, abs(s / max(n, 1))):
            loss_fn_ok = False
            notes.append({"count_targets": theirs_n, "targets": n, "lm_loss": theirs, "cross_entropy": s / max(n, 1)})
    return {"loss": total / max(count, 1), "targets": count, "loss_fn_ok": loss_fn_ok, "loss_fn_notes": notes[:2]}


@register
class EvalContract(Detector):
    id = "eval_contract"
    needs_facts = ("val_docs", "pad_id", "seq_len", "pad_side", "precision")
    family = "eval"
    passive = False
    description = ("evaluate runs the model in eval mode, restores its mode, and returns the token-mean loss over "
                   "real targets (recomputed from the run's collate/model); the end-of-run eval runs in eval mode")

    def __init__(self) -> None:
        super().__init__()
        self._handle = None
        self._eval_modes: list[bool] = []
        self._probe_modes: list[bool] | None = None
        self._reported_mode = False
        self._reported_kinds: set[str] = set()
        self._probe: dict = {}

    def summary(self) -> dict:
        return self._probe

    # -- the mode watch: a forward pre-hook on the run's model ------------------------------------
    def _watch(self, ctx) -> None:
        if self._handle is not None:
            self._handle.remove()

        def pre_hook(module, args):
            if self._probe_modes is not None:
                self._probe_modes.append(module.training)
            elif ctx.phase == "eval":
                self._eval_modes.append(module.training)

        self._handle = ctx.run.model.register_forward_pre_hook(pre_hook)

    def check_applicable(self, ctx) -> None:
        super().check_applicable(ctx)
        if not ctx.known_seam(EVALUATE):  # the reference's evaluate, or a stack's evaluate role and the forward's
            self.require(ctx, roles=("evaluate", "collate", "forward"))

    def on_checkpoint_load(self, ctx, path) -> None:
        self._watch(ctx)

    def on_start(self, ctx) -> None:
        self._watch(ctx)
        self._check_evaluation(ctx, "start")

    def _check_evaluation(self, ctx, moment: str) -> None:
        if ctx.known_seam(EVALUATE):
            self.require(ctx, run=("corpus.val", "tokenizer.pad_id"), config=("data.seq_len", "train.precision"),
                         seams=(COLLATE, LM_LOSS, COUNT_TARGETS, AUTOCAST))
            self._probe_evaluate(ctx, moment)
        else:
            self._probe_by_role(ctx, moment)

    def on_end(self, ctx, metrics) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if any(self._eval_modes) and not self._reported_mode:
            self._reported_mode = True
            self.report(ctx, "eval", ctx.known_seam(EVALUATE) or ctx.role_seam("evaluate"),
                        f"the end-of-run evaluation ran {sum(self._eval_modes)} of {len(self._eval_modes)} forwards "
                        "with the model in train mode (dropout and other train-mode behaviour stay on)",
                        {"forwards": len(self._eval_modes), "in_train_mode": sum(self._eval_modes)}, confidence=0.9)
        if not self.findings:  # again with the trained model: aggregation errors can hide behind uniform logits
            self._check_evaluation(ctx, "end")

    def _probe_evaluate(self, ctx, moment: str) -> None:
        """Call the run's evaluate (model in train mode) and compare it with its contract."""
        cfg, tok = ctx.config, ctx.run.tokenizer
        docs = [d for d in ctx.run.corpus.val if 2 <= len(d) <= cfg.data.seq_len][:PROBE_DOCS]
        if len(docs) < 4:
            return
        evaluate = ctx.seam(EVALUATE)
        model = ctx.run.model
        with ctx.probe(train_mode=True):
            self._probe_modes = []
            try:
                value = float(evaluate(model, docs, tok.pad_id, PROBE_BATCH, cfg.train.precision, cfg.data.pad_side))
                error = None
            except Exception as exc:  # noqa: BLE001
                value, error = None, f"{type(exc).__name__}: {exc}"
            finally:
                modes, self._probe_modes = self._probe_modes, None
            restored = model.training
            try:
                ref = replicate_eval(ctx, docs, PROBE_BATCH)
            except Exception as exc:  # noqa: BLE001 - the model or collate cannot run these docs: not eval's fault
                ref = {"error": f"{type(exc).__name__}: {exc}"}
        evidence = {"moment": moment, "evaluate": value, "evaluate_error": error, "reference": ref,
                    "forwards": len(modes), "forwards_in_train_mode": sum(modes), "mode_restored": restored,
                    "docs": len(docs), "batch_size": PROBE_BATCH}
        self._probe[moment] = {"evaluate": value, "reference": ref.get("loss"), "forwards_in_train_mode": sum(modes)}
        problems = []
        if any(modes):
            problems.append(f"evaluate ran {sum(modes)} of {len(modes)} forwards with the model in train mode "
                            "(dropout and other train-mode behaviour stay on)")
            self._reported_mode = True
        if not restored:
            problems.append("evaluate left a model that was training in eval mode (mode not restored)")
        if "error" not in ref:
            if error is not None:
                problems.append(f"evaluate raised {error} on documents the model and collate handle")
            elif ref["loss_fn_ok"] and abs(value - ref["loss"]) > REL_TOL * max(1.0, abs(ref["loss"])):
                problems.append(f"evaluate returned {value:.4f} but the mean loss over the {ref['targets']} real "
                                f"targets of the same batches is {ref['loss']:.4f}")
        if problems:
            self.report(ctx, "eval", EVALUATE, "evaluate breaks its contract: " + "; ".join(problems), evidence,
                        confidence=0.9)

    def _probe_by_role(self, ctx, moment: str) -> None:
        """The evaluate role (model in train mode) against the mean loss per target of the same documents, collated
        by the collate role and scored by the forward role in eval mode: exact on one rank in fp32; over ranks the
        stack may weight their shares by documents (within 10%)."""
        docs = [d for d in ctx.fact("val_docs") if 2 <= len(d) <= ctx.fact("seq_len")][:PROBE_DOCS]
        if len(docs) < 4:
            return
        model = ctx.run.model
        with ctx.probe(train_mode=True):
            self._probe_modes = []
            try:
                value, error = float(ctx.role("evaluate")(docs)), None
            except Exception as exc:  # noqa: BLE001
                value, error = None, f"{type(exc).__name__}: {exc}"
            finally:
                modes, self._probe_modes = self._probe_modes, None
            try:
                reference, again = self._token_mean(ctx, docs), self._token_mean(ctx, docs)
            except Exception:  # noqa: BLE001 - the model or collate cannot run these docs: not the evaluation's fault
                reference = again = None
            model.train()
        if reference is not None and reference != again and "nondeterministic" not in self._reported_kinds:
            self._reported_kinds.add("nondeterministic")  # the model itself: dropout or sampling left on in eval mode
            self.report(ctx, "model", ctx.role_seam("forward"), f"{moment}: two eval-mode forwards of the same "
                        f"documents give different losses ({reference:.6f}, {again:.6f}): the model's eval-mode "
                        "forward is not a function of its inputs (dropout or sampling still on)",
                        {"moment": moment, "losses": [reference, again]}, confidence=0.85)
        self._probe[moment] = {"evaluate": value, "reference": reference, "forwards_in_train_mode": sum(modes)}
        problems = []
        if any(modes):
            problems.append(f"the evaluation ran {sum(modes)} of {len(modes)} forwards with the model in train mode "
                            "(dropout and other train-mode behaviour stay on)")
            self._reported_mode = True
        tolerance = REL_TOL if ctx.run.world_size == 1 else 0.1
        if reference is not None and error is not None:
            problems.append(f"the evaluation raised {error} on documents the model and collate handle")
        elif reference is not None and ctx.fact("precision") == "fp32" and abs(value - reference) > tolerance * max(
                1.0, abs(reference)):
            problems.append(f"the evaluation returned {value:.4f} but the mean loss per target of the same documents "
                            f"is {reference:.4f}")
        if problems:
            step = self._eval_step_problem(ctx, docs, reference) if not any(modes) and reference is not None else None
            self.report(ctx, "eval", ctx.role_seam("eval_step" if step else "evaluate"),
                        "the evaluation breaks its contract: " + "; ".join(problems) + (f"; {step}" if step else ""),
                        {"moment": moment, **self._probe[moment], "docs": len(docs)}, confidence=0.9)

    @staticmethod
    def _eval_step_problem(ctx, docs, want: float) -> str | None:
        """Where the run offers its evaluation's per-batch step as a role: its loss of the documents as one batch,
        against ``want``, their mean loss per target computed here (None when they agree, or without the role)."""
        if "eval_step" not in ctx.roles:
            return None
        with ctx.probe():
            try:
                got = ctx.role("eval_step")(probes.collate(ctx, docs))
            except Exception as exc:  # noqa: BLE001
                return f"its per-batch step raises {type(exc).__name__}"
        return (f"its per-batch step gives {got:.4f} for one batch whose mean loss per target is {want:.4f}"
                if abs(got - want) > REL_TOL * max(1.0, abs(want)) else None)

    @staticmethod
    def _token_mean(ctx, docs) -> float:
        """The mean next-token cross-entropy per target of ``docs`` in one batch, in eval mode, computed here."""
        batch = probes.collate(ctx, docs)
        ctx.run.model.eval()
        logits = probes.logits(ctx, batch["input_ids"], batch["attention_mask"], batch.get("position_ids"))
        ignore = probes.ignore_value(batch["labels"].cpu(), batch["attention_mask"].cpu())
        targets = batch["labels"][:, 1:]
        total = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=ignore,
                                reduction="sum")
        return float(total) / max(int((targets != ignore).sum()), 1)

    def on_crash(self, ctx, crash) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


@register
class SplitOverlap(Detector):
    id = "split_overlap"
    needs_facts = ("train_docs", "val_docs")
    family = "eval"
    passive = False
    description = ("no validation document is a training document; the run's split_of assigns the corpus's val "
                   "texts to val and its train texts to train")

    def __init__(self) -> None:
        super().__init__()
        self._summary: dict = {}

    def summary(self) -> dict:
        return self._summary

    def on_start(self, ctx) -> None:
        train_docs, val_docs = ctx.fact("train_docs"), ctx.fact("val_docs")
        train = set(map(tuple, train_docs))
        overlap = sum(tuple(doc) in train for doc in val_docs)
        evidence = {"val_docs": len(val_docs), "val_docs_in_train": overlap, "train_docs": len(train_docs)}
        wrong, wrong_count, checked = self._split_of_disagreements(ctx, train_docs, val_docs)
        evidence.update(split_of_checked=checked, wrong_split=wrong, wrong_count=wrong_count)
        self._summary = {k: evidence[k] for k in ("val_docs_in_train", "split_of_checked", "wrong_count")}
        if wrong_count >= 3:
            self.report(ctx, "eval", ctx.role_seam("split_of"),
                        f"split_of disagrees with the corpus's split on {wrong_count} of {checked} documents; "
                        f"{overlap} of {len(val_docs)} val documents are also in train", evidence, confidence=0.8)
        elif overlap >= max(2, 0.01 * len(val_docs)):
            self.report(ctx, "eval", None,
                        f"{overlap} of {len(val_docs)} val documents are also training documents"
                        + (" although split_of looks deterministic" if checked else ""), evidence, confidence=0.5)

    @staticmethod
    def _split_of_disagreements(ctx, train_docs, val_docs) -> tuple[list[dict], int, int]:
        """(examples, count, checked): documents the run's split_of role assigns to the other split, of those whose
        text round-trips through the run's tokenizer; nothing checked without the role."""
        if "split_of" not in ctx.roles:
            return [], 0, 0
        tok, cfg = ctx.run.tokenizer, ctx.config
        fraction = cfg.data.val_fraction
        split_of = ctx.role("split_of")
        seq_len = ctx.fact("seq_len")
        wrong, wrong_count, checked = [], 0, 0
        with ctx.probe():  # split_of may draw random numbers: the probe restores the RNGs
            for split, docs in (("val", val_docs[:200]), ("train", train_docs[:200])):
                for doc in docs:
                    if not 3 <= len(doc) < seq_len:
                        continue
                    text = tok.decode(doc)
                    if not text or list(tok.encode(text))[1:-1] != [i for i in doc if i not in
                                                                     (tok.bos_id, tok.eos_id, tok.pad_id)]:
                        continue  # the text does not round-trip: its split cannot be compared
                    answer = split_of(text, fraction)
                    checked += 1
                    if answer != split:
                        wrong_count += 1
                        if len(wrong) < 3:
                            wrong.append({"text": text[:40], "split_of": answer, "corpus_split": split})
        return wrong, wrong_count, checked
