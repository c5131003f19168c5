"""SageMaker Debugger (smdebug 1.0.34) as a peer baseline: its real PyTorch hook saves the run's tensors, and
SageMaker Debugger's documented built-in rules are evaluated on them through smdebug's real trial and rule API.

What is real and what is re-implemented: ``smdebug.pytorch.Hook`` saves weights, biases, gradients and the
loss to a temporary out_dir during the run; at the end (or the crash) ``smdebug.trials.create_trial`` reads
them back and each rule, a subclass of ``smdebug.rules.Rule``, is invoked at every saved training step as
``smdebug.rules.invoke_rule`` does. The built-in rules' own code is NOT in any smdebug release on PyPI (0.4.14
to 1.0.34 ship only the Rule base class; AWS runs the built-ins in its rule containers), so their bodies here
are a RE-IMPLEMENTATION of the definitions and default parameters documented in the SageMaker developer guide
("List of Debugger Built-in Rules"):

Each rule: its documented definition and defaults -> subsystem (alternative); seam.
- VanishingGradient: mean(abs(gradient)) < threshold=1e-7 -> model (loss); the owning module's, if shared.
- ExplodingTensor: a NaN or inf in any saved tensor (only_nan=False) -> precision under AMP, else model
  (alternative: model under AMP, optimizer otherwise); no seam.
- LossNotDecreasing: every num_steps=10 steps the loss must have decreased (diff_percent=0), mode TRAIN ->
  optimizer (model); no seam.
- WeightUpdateRatio: mean abs update / (mean abs weight + epsilon=1e-9) between consecutive saved steps
  > large_threshold=10 or < small_threshold=1e-8 -> optimizer; no seam.
- UnchangedTensor: numpy.allclose over the last num_steps=3 saved steps (rtol=1e-5, atol=1e-8,
  equal_nan=False), on the collection "weights" -> optimizer (model); no seam.
- AllZero: threshold=100 % of a tensor's values are zero, on "weights" and "gradients" -> model on weights,
  loss on gradients only (model); the owning module's, if shared.

Not evaluated, and why: DeadRelu, PoorWeightInitialization and SaturatedActivation read ReLU/tanh/sigmoid
activations (this GPT has GELU only: their default regexes match nothing); TensorVariance has no default
thresholds; Overfit and Overtraining need a validation-loss curve (a case evaluates once, at the end);
ClassImbalance, Confusion, CheckInputImages, TreeDepth and FeatureImportanceOverweight are for classifiers,
images or XGBoost; NLPSequenceRatio is a padding-efficiency hint, not a bug check.

Steps: smdebug counts one step per forward of the registered model. Under gradient accumulation (k
micro-batches per optimizer step) the hook saves every k-th step, the first micro-batch of each optimizer
step, so that consecutive saved steps are consecutive optimizer steps, which is what the weight rules assume
(the loss collection is saved every step: the loss is recorded after the last micro-batch). Evaluation forwards
run in smdebug's EVAL mode and the rules read TRAIN steps only. A firing is reported at the optimizer step of
its first firing; tensor names (``GPT_blocks.0.attn.qkv.weight``) name parameters, and a seam is named only when
every firing tensor's owning module lies under one module class whose ``forward`` is a seam (not the root).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from faultbench.detectors.api import Detector, RunContext, register
from faultbench.peers.torcheck_peer import shared_seam

AMP = ("fp16", "bf16")
LOSS_NAME = "lm_loss"  # recorded as "lm_loss_output_0", which the losses collection's regex matches

# documented defaults (SageMaker developer guide, "List of Debugger Built-in Rules")
VANISHING_THRESHOLD = 1e-7
LOSS_NUM_STEPS, LOSS_DIFF_PERCENT = 10, 0.0
RATIO_LARGE, RATIO_SMALL, RATIO_EPSILON = 10.0, 1e-8, 1e-9
UNCHANGED_NUM_STEPS, UNCHANGED_RTOL, UNCHANGED_ATOL = 3, 1e-5, 1e-8
ALL_ZERO_PERCENT = 100.0


# --- the rules' definitions on plain arrays (what each Rule subclass below evaluates per step) ---

def vanishing(grads: dict[str, np.ndarray], threshold: float = VANISHING_THRESHOLD) -> list[str]:
    """Gradients whose mean absolute value is below ``threshold``."""
    return [n for n, g in grads.items() if float(np.mean(np.abs(g))) < threshold]


def exploding(tensors: dict[str, np.ndarray], only_nan: bool = False) -> list[str]:
    """Tensors holding a NaN (or, unless ``only_nan``, an infinity)."""
    bad = np.isnan if only_nan else (lambda a: ~np.isfinite(a))
    return [n for n, t in tensors.items() if bool(np.any(bad(t)))]


def all_zero(tensors: dict[str, np.ndarray], percent: float = ALL_ZERO_PERCENT) -> list[str]:
    """Tensors with at least ``percent`` % of their values exactly zero."""
    return [n for n, t in tensors.items() if t.size and 100.0 * np.count_nonzero(t == 0) / t.size >= percent]


def unchanged(history: list[np.ndarray], rtol: float = UNCHANGED_RTOL, atol: float = UNCHANGED_ATOL,
              equal_nan: bool = False) -> bool:
    """True when the last ``len(history)`` saved values are all close to each other (numpy.allclose)."""
    return len(history) >= 2 and all(np.allclose(history[0], h, rtol=rtol, atol=atol, equal_nan=equal_nan)
                                     for h in history[1:])


def update_ratio(previous: np.ndarray, current: np.ndarray, epsilon: float = RATIO_EPSILON) -> float:
    """Mean absolute update over mean absolute weight."""
    return float(np.mean(np.abs(current - previous)) / (np.mean(np.abs(previous)) + epsilon))


def ratio_out_of_range(ratio: float, large: float = RATIO_LARGE, small: float = RATIO_SMALL) -> bool:
    return not small <= ratio <= large  # a NaN ratio is out of range too


def loss_not_decreasing(losses: list[tuple[int, float]], num_steps: int = LOSS_NUM_STEPS,
                        diff_percent: float = LOSS_DIFF_PERCENT) -> list[int]:
    """Steps at which the loss has not decreased (by ``diff_percent`` %) since the step checked last, at least
    ``num_steps`` steps before; ``losses`` are (step, loss) in step order."""
    fired, base = [], None
    for step, loss in losses:
        if base is None:
            base = (step, loss)
        elif step - base[0] >= num_steps:
            if not loss < base[1] * (1.0 - diff_percent / 100.0):
                fired.append(step)
            base = (step, loss)
    return fired


# --- from rule firings to findings ---

@dataclass(frozen=True)
class Firing:
    """A rule that fired: at which smdebug (global) steps, on which tensors (of its first firing)."""

    rule: str
    steps: tuple[int, ...]
    tensors: tuple[str, ...]


# rule -> (subsystem, alternative or None, confidence); ExplodingTensor and AllZero depend on the tensors
MAPPING = {
    "VanishingGradient": ("model", "loss", 0.4),
    "ExplodingTensor": ("model", "optimizer", 0.35),
    "LossNotDecreasing": ("optimizer", "model", 0.3),
    "WeightUpdateRatio": ("optimizer", None, 0.4),
    "UnchangedTensor": ("optimizer", "model", 0.4),
    "AllZero": ("model", "loss", 0.4),
}
SEAMED_RULES = ("VanishingGradient", "AllZero")  # rules about the values one module's parameters receive


def param_name(tensor: str, root: str) -> str | None:
    """The model's parameter behind a saved tensor name (``gradient/GPT_wte.weight`` -> ``wte.weight``)."""
    name = tensor.removeprefix("gradient/")
    return name[len(root) + 1:] if name.startswith(root + "_") else None


def mapping_for(firing: Firing, precision: str) -> tuple[str, str | None, float]:
    subsystem, alternative, confidence = MAPPING[firing.rule]
    if firing.rule == "ExplodingTensor" and precision in AMP:
        return "precision", "model", confidence
    if firing.rule == "AllZero" and all(t.startswith("gradient/") for t in firing.tensors):
        return "loss", "model", confidence
    return subsystem, alternative, confidence


def findings_for(firings: list[Firing], precision: str, model, seams: dict[str, str], step_of) -> list[dict]:
    """Findings (kwargs of ``Detector.report``) for the rules that fired: one per rule, at its first step, plus
    one at a lower confidence for the rule's alternative subsystem. ``step_of``: smdebug step -> optimizer step."""
    root = model._get_name()
    out = []
    for firing in firings:
        subsystem, alternative, confidence = mapping_for(firing, precision)
        params = [param_name(t, root) for t in firing.tensors]
        seam = (shared_seam(model, params, seams) if firing.rule in SEAMED_RULES and params and None not in params
                else None)
        step = step_of(firing.steps[0])
        shown = ", ".join(firing.tensors[:4]) + (", ..." if len(firing.tensors) > 4 else "")
        message = f"smdebug {firing.rule} fired at step {step} ({len(firing.steps)} saved steps in all) on {shown}"
        evidence = {"rule": firing.rule, "smdebug_steps": list(firing.steps[:20]), "tensors": list(firing.tensors[:20])}
        out.append({"subsystem": subsystem, "seam": seam, "message": message, "evidence": evidence,
                    "confidence": confidence, "step": step})
        if alternative is not None:
            out.append({"subsystem": alternative, "seam": None, "message": message + f" (alternative: {alternative})",
                        "evidence": evidence, "confidence": confidence * 0.6, "step": step})
    return out


# --- the rules as smdebug Rule subclasses (built on first use: smdebug is imported only when the peer runs) ---

def rule_classes() -> dict:
    """The six rules as ``smdebug.rules.Rule`` subclasses; each records the tensors it fired on per step."""
    from smdebug.rules import Rule

    class _Rule(Rule):
        collections: tuple[str, ...] = ()

        def __init__(self, base_trial):
            super().__init__(base_trial, action_str="")
            self.fired: dict[int, list[str]] = {}

        def names(self) -> list[str]:
            return sorted({n for c in self.collections for n in self.base_trial.tensor_names(collection=c)})

        def values(self, step: int) -> dict[str, np.ndarray]:
            out = {}
            for name in self.names():
                tensor = self.base_trial.tensor(name)
                if step in tensor.steps():
                    out[name] = np.asarray(tensor.value(step), dtype=np.float64)
            return out

        def window(self, name: str, step: int, length: int) -> list[int] | None:
            """The last ``length`` saved steps of ``name`` ending at ``step`` (None: too few saved yet)."""
            steps = [s for s in self.base_trial.tensor(name).steps() if s <= step][-length:]
            return steps if len(steps) == length and steps[-1] == step else None

        def verdict(self, step: int, names: list[str]) -> bool:
            if names:
                self.fired[step] = names
            return bool(names)

    class VanishingGradient(_Rule):
        collections = ("gradients",)

        def invoke_at_step(self, step):
            return self.verdict(step, vanishing(self.values(step)))

    class ExplodingTensor(_Rule):
        collections = ("weights", "biases", "gradients", "losses")

        def invoke_at_step(self, step):
            return self.verdict(step, exploding(self.values(step)))

    class AllZero(_Rule):
        collections = ("weights", "gradients")

        def invoke_at_step(self, step):
            return self.verdict(step, all_zero(self.values(step)))

    class UnchangedTensor(_Rule):
        collections = ("weights",)

        def invoke_at_step(self, step):
            windows = {name: self.window(name, step, UNCHANGED_NUM_STEPS) for name in self.names()}
            return self.verdict(step, [name for name, steps in windows.items() if steps and unchanged(
                [self.base_trial.tensor(name).value(s) for s in steps])])

    class WeightUpdateRatio(_Rule):
        collections = ("weights",)

        def invoke_at_step(self, step):
            windows = {name: self.window(name, step, 2) for name in self.names()}
            return self.verdict(step, [name for name, steps in windows.items() if steps and ratio_out_of_range(
                update_ratio(*(self.base_trial.tensor(name).value(s) for s in steps)))])

    class LossNotDecreasing(_Rule):
        collections = ("losses",)

        def invoke_at_step(self, step):
            names = []
            for name in self.names():
                tensor = self.base_trial.tensor(name)
                losses = [(s, float(tensor.value(s))) for s in tensor.steps() if s <= step]
                if step in loss_not_decreasing(losses):
                    names.append(name)
            return self.verdict(step, names)

    return {cls.__name__: cls for cls in (VanishingGradient, ExplodingTensor, LossNotDecreasing, WeightUpdateRatio,
                                          UnchangedTensor, AllZero)}


def evaluate_rules(out_dir: str) -> list[Firing]:
    """Every rule invoked at every saved TRAIN step of the trial in ``out_dir`` (as ``invoke_rule`` does)."""
    from smdebug.core.modes import ModeKeys
    from smdebug.exceptions import (
        RuleEvaluationConditionMet,
        StepUnavailable,
        TensorUnavailable,
        TensorUnavailableForStep,
    )
    from smdebug.trials import create_trial

    trial = create_trial(out_dir)
    steps = sorted(trial.global_step(ModeKeys.TRAIN, s) for s in trial.steps(mode=ModeKeys.TRAIN))
    firings = []
    for name, cls in rule_classes().items():
        rule = cls(trial)
        for step in steps:
            try:
                rule.invoke(step)
            except (RuleEvaluationConditionMet, TensorUnavailableForStep, StepUnavailable, TensorUnavailable):
                continue
        if rule.fired:
            first = min(rule.fired)
            firings.append(Firing(name, tuple(sorted(rule.fired)), tuple(rule.fired[first])))
    return firings


@register
class SageMakerDebugger(Detector):
    id = "smdebug"
    family = "baseline"
    baseline = True
    exclusive = True  # the hook writes every tensor to disk at every saved step: a run of its own
    passive = True
    description = ("peer tool SageMaker Debugger: smdebug 1.0.34's PyTorch hook saves weights, gradients and "
                   "the loss; six documented built-in rules (re-implemented: their code is not public) run on "
                   "smdebug's trial at the end, mapped to a subsystem (a seam only for one module's tensors)")

    def __init__(self) -> None:
        super().__init__()
        self._hook = None
        self._out_dir: str | None = None
        self._starts: list[tuple[int, int]] = []  # (smdebug step of a window's first forward, optimizer step)

    def on_start(self, ctx: RunContext) -> None:
        import smdebug.pytorch as smd
        from smdebug.core.logger import get_logger

        get_logger().setLevel(logging.ERROR)  # its INFO lines would flood the bench's log (set once, at first use)

        self._out_dir = tempfile.mkdtemp(prefix="faultbench-smdebug-")
        save = smd.SaveConfig(save_interval=ctx.config.train.accum)  # the first micro-batch of each step
        self._hook = smd.Hook(out_dir=self._out_dir, save_config=save,
                              include_collections=["weights", "biases", "gradients", "losses"])
        self._hook.get_collection("losses").save_config = smd.SaveConfig(save_interval=1)
        self._register(ctx, ctx.run.model)

    def on_checkpoint_load(self, ctx: RunContext, path) -> None:
        self._register(ctx, ctx.run.model)  # the resumed run's model is a new module

    def _register(self, ctx: RunContext, model) -> None:
        import smdebug.pytorch as smd

        hook = self._hook
        # as a training loop calls hook.set_mode before its train and eval loops (from the loop's phase, not
        # from model.training, which a bug can leave wrong); registered before smdebug's pre-hook, which
        # counts the step
        model.register_forward_pre_hook(lambda m, args: hook.set_mode(smd.modes.TRAIN if ctx.phase == "train"
                                                                       else smd.modes.EVAL))
        hook.register_module(model)

    def on_batch(self, ctx: RunContext, micro_batches: list[dict]) -> None:
        self._starts.append((self._hook.step + 1, ctx.step))

    def on_after_step(self, ctx: RunContext, record) -> None:
        import torch

        self._hook.record_tensor_value(LOSS_NAME, torch.tensor(float(record.loss)))

    def step_of(self, smdebug_step: int) -> int | None:
        """The optimizer step whose window holds this smdebug step."""
        i = bisect_right([s for s, _ in self._starts], smdebug_step) - 1
        return self._starts[i][1] if i >= 0 else None

    def on_end(self, ctx: RunContext, metrics: dict) -> None:
        self._conclude(ctx)

    def on_crash(self, ctx: RunContext, crash: dict) -> None:
        self._conclude(ctx)

    def _conclude(self, ctx: RunContext) -> None:
        if self._hook is None:
            return
        self._hook.close()  # flushes the last step and marks the training as ended, so the trial never waits
        self._hook = None
        try:
            firings = evaluate_rules(self._out_dir) if _has_data(self._out_dir) else []
        finally:
            shutil.rmtree(self._out_dir, ignore_errors=True)
        for f in findings_for(firings, ctx.config.train.precision, ctx.run.model, ctx.seams, self.step_of):
            self.report(ctx, f["subsystem"], f["seam"], f["message"], f["evidence"], f["confidence"], step=f["step"])


def _has_data(out_dir: str) -> bool:
    """Whether the hook wrote any tensors (a non-chief rank writes none under include_workers="one")."""
    return os.path.isdir(os.path.join(out_dir, "index"))
