"""torcheck 1.0.1 (github.com/pengyan510/torcheck) as a peer baseline: the sanity checks its README sets up
before a training loop, scored on the bench's cases.

Setup, as the README's "Torcheck in 5 minutes" advises: register the optimizer, then on every trainable
parameter the changing, NaN and inf checks (``add_tensor``), NaN/inf checks on the output of the model and of
every submodule ("the final model output or intermediate output of a submodule"), and the README's negated
output-range check on the model (outputs not all within (0, 1): softmax must not be applied before the loss).
torcheck validates the parameters after every ``optimizer.step()`` and each checked module's output after its
forward, and raises a RuntimeError listing what failed: the run crashes there (so the detector is exclusive)
and ``on_crash`` turns the message into findings. A parameter that belongs to no optimizer makes ``add_tensor``
raise during setup; that is reported too.

Mapping (``MAPPING``: torcheck's message -> subsystem, an alternative, the seam):
- setup "doesn't belong to any optimizer": optimizer; no seam.
- "<param> should change" for every parameter: optimizer (the step changed nothing); no seam.
- "<param> should change" for some: model (no gradient reaches them), then optimizer; the seam of the module
  that owns them when they all share one below the root.
- "<param> contains NaN/inf" (the outputs were finite, as they are checked first): precision under AMP, else
  optimizer (the update wrote it), then model; no seam.
- "<module>'s output contains NaN/inf": precision under AMP, else model; the module's seam (the innermost
  checked module fails first, as its forward returns first).
- "output shouldn't all > 0 and < 1": model (it returns probabilities), then loss; the model's seam.
A module's seam is the ``forward`` of the innermost module class on its path that is a seam of the run
(``ctx.seams``); torcheck names modules and parameters, never seams, so no other seam is ever claimed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from faultbench.detectors.api import Detector, RunContext, register

MODEL_NAME = "model"  # the module_name torcheck's messages use for the whole model
AMP = ("fp16", "bf16")

_UNCHANGED = re.compile(r"Module (\S+)'s (\S+) should change\.")
_NONFINITE = re.compile(r"Module (\S+)'s (\S+) contains (NaN|inf)\.")
_PROBS = re.compile(r"Module (\S+)'s output shouldn't all > 0 and < 1")


@dataclass(frozen=True)
class Issue:
    """One failed torcheck check, parsed from its message."""

    kind: str  # "unchanged", "param_nonfinite", "output_nonfinite", "probabilities"
    module: str  # torcheck's module_name: "model" for parameters, the module's qualified name for outputs
    tensor: str  # the parameter's name, or "output"


# kind -> (subsystem, alternative subsystem or None, confidence); see the module docstring
MAPPING = {
    "not_in_optimizer": ("optimizer", None, 0.5),
    "unchanged_all": ("optimizer", None, 0.5),
    "unchanged_some": ("model", "optimizer", 0.4),
    "param_nonfinite": ("optimizer", "model", 0.35),
    "output_nonfinite": ("model", None, 0.4),
    "probabilities": ("model", "loss", 0.5),
}


def parse_issues(text: str) -> list[Issue]:
    """Every failed check named in torcheck's error text (its crash message or traceback), in order, once each."""
    issues = [Issue("unchanged", m, t) for m, t in _UNCHANGED.findall(text)]
    for module, tensor, _ in _NONFINITE.findall(text):
        issues.append(Issue("output_nonfinite" if tensor == "output" else "param_nonfinite", module, tensor))
    issues += [Issue("probabilities", m, "output") for m in _PROBS.findall(text)]
    return list(dict.fromkeys(issues))


def seam_named(name: str, seams: dict[str, str]) -> str | None:
    """The seam a live qualified name is: itself, or the seam it ends with when its package is installed
    under another (``faultbench.model.gpt.Block.forward`` is the seam ``model.gpt.Block.forward``)."""
    parts = name.split(".")
    return next((s for s in (".".join(parts[i:]) for i in range(len(parts))) if s in seams), None)


def module_seam(model, module_name: str, seams: dict[str, str]) -> str | None:
    """The seam of the innermost module on the path to ``module_name`` (``""``: the root) whose class's
    ``forward`` is a seam of the run; None when no module on the path is one."""
    found, module = None, model
    for part in [""] + ([p for p in module_name.split(".") if p] if module_name else []):
        module = getattr(module, part, None) if part else module
        if module is None:
            break
        cls = type(module)
        found = seam_named(f"{cls.__module__}.{cls.__qualname__}.forward", seams) or found
    return found


def shared_seam(model, param_names: Iterable[str], seams: dict[str, str]) -> str | None:
    """The one seam owning every named parameter below the root module (None if they do not share one)."""
    owners = {module_seam(model, name.rpartition(".")[0], seams) for name in param_names}
    root = module_seam(model, "", seams)
    return owners.pop() if len(owners) == 1 and None not in owners and root not in owners else None


def findings_for(issues: list[Issue], watched: int, precision: str, model, seams: dict[str, str]) -> list[dict]:
    """The findings (kwargs of ``Detector.report``) for torcheck's failed checks, most specific first.

    ``watched``: how many parameters carry the changing check (all of them unchanged: the step did nothing).
    """
    out: list[dict] = []
    unchanged = [i.tensor for i in issues if i.kind == "unchanged"]
    if unchanged:
        kind = "unchanged_all" if len(unchanged) >= watched else "unchanged_some"
        seam = shared_seam(model, unchanged, seams) if kind == "unchanged_some" else None
        out += _mapped(kind, seam, f"torcheck: {len(unchanged)} of {watched} parameters did not change in the "
                       f"optimizer step ({', '.join(unchanged[:4])}{', ...' if len(unchanged) > 4 else ''})",
                       {"parameters": unchanged[:20]})
    for issue in issues:
        if issue.kind == "output_nonfinite":
            subsystem = "precision" if precision in AMP else "model"
            seam = module_seam(model, "" if issue.module == MODEL_NAME else issue.module, seams)
            out.append({"subsystem": subsystem, "seam": seam, "confidence": MAPPING[issue.kind][2],
                        "message": f"torcheck: the output of module {issue.module!r} is not finite",
                        "evidence": {"module": issue.module}})
        elif issue.kind == "probabilities":
            out += _mapped(issue.kind, module_seam(model, "", seams),
                           "torcheck: the model's outputs all lie in (0, 1): probabilities, not logits",
                           {"module": issue.module})
    nonfinite = [i.tensor for i in issues if i.kind == "param_nonfinite"]
    if nonfinite:
        message = f"torcheck: parameters became NaN/inf in the optimizer step ({', '.join(nonfinite[:4])})"
        if precision in AMP:
            out.append({"subsystem": "precision", "seam": None, "confidence": 0.35, "message": message,
                        "evidence": {"parameters": nonfinite[:20]}})
        out += _mapped("param_nonfinite", None, message, {"parameters": nonfinite[:20]},
                       scale=0.8 if precision in AMP else 1.0)
    return out


def _mapped(kind: str, seam: str | None, message: str, evidence: dict, scale: float = 1.0) -> list[dict]:
    """The finding of a mapping row, and one for its alternative subsystem at a lower confidence."""
    subsystem, alternative, confidence = MAPPING[kind]
    out = [{"subsystem": subsystem, "seam": seam, "confidence": confidence * scale, "message": message,
            "evidence": evidence}]
    if alternative is not None:
        out.append({"subsystem": alternative, "seam": None, "confidence": confidence * scale * 0.6,
                    "message": message + f" (alternative: {alternative})", "evidence": evidence})
    return out


@register
class Torcheck(Detector):
    id = "torcheck"
    family = "baseline"
    baseline = True
    exclusive = True  # torcheck wraps optimizer.step and the modules' forward, and raises: the run stops there
    passive = True
    description = ("peer tool torcheck 1.0.1: its README's checks (every parameter changes and stays finite, "
                   "every module's output finite, model outputs not all in (0, 1)); a failed check stops the "
                   "run and its message is mapped to a subsystem (a seam only for the module it names)")

    def __init__(self) -> None:
        super().__init__()
        self._registry = None
        self._watched = 0

    def on_start(self, ctx: RunContext) -> None:
        from torcheck.registry import Registry  # the class behind torcheck.register & co.

        # a registry of our own, not torcheck's module-level one: rank-pool workers outlive a case
        self._registry = Registry()
        self._watch(ctx)

    def on_checkpoint_load(self, ctx: RunContext, path) -> None:
        self._watch(ctx)  # the resumed run has a new model and optimizer

    def _watch(self, ctx: RunContext) -> None:
        registry, model = self._registry, ctx.run.model
        registry.register(ctx.run.optimizer)
        orphans = []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            try:
                registry.add_tensor(param, tensor_name=name, module_name=MODEL_NAME, changing=True,
                                    check_nan=True, check_inf=True)
            except RuntimeError as exc:  # "The tensor doesn't belong to any optimizer."
                orphans.append((name, str(exc)))
        self._watched = sum(p.requires_grad for p in model.parameters()) - len(orphans)
        self._add_output_checks(model)
        if orphans:
            subsystem, _, confidence = MAPPING["not_in_optimizer"]
            names = [n for n, _ in orphans]
            self.report_once("orphans", ctx, subsystem, None, f"torcheck: {len(orphans)} trainable parameters "
                             f"belong to no optimizer ({', '.join(names[:4])})",
                             {"parameters": names[:20], "error": orphans[0][1]}, confidence)

    def _add_output_checks(self, model) -> None:
        """NaN/inf checks on the output of the model and of every submodule that is called (not the containers),
        and the negated (0, 1) range check on the model's output.

        ``_add_output_check`` is the output half of torcheck's ``add_module_nan_check``/``add_module_inf_check``;
        their parameter half is added per tensor in ``_watch``, where a parameter outside the optimizer is
        reported instead of aborting the setup.
        """
        for name, module in model.named_modules():
            if type(module).__name__ not in ("ModuleList", "ModuleDict"):
                self._registry._add_output_check(module, module_name=name or MODEL_NAME, check_nan=True,
                                                 check_inf=True)
        self._registry.add_module_output_range_check(model, output_range=(0, 1), negate_range=True,
                                                     module_name=MODEL_NAME)

    def on_crash(self, ctx: RunContext, crash: dict) -> None:
        # the message is cut at 500 characters; the traceback's tail holds it whole
        issues = parse_issues(crash.get("traceback") or crash.get("message", ""))
        if not issues or ctx.run is None:
            return  # not torcheck's error: the fault crashed the run by itself
        for finding in findings_for(issues, self._watched, ctx.config.train.precision, ctx.run.model, ctx.seams):
            self.report(ctx, finding["subsystem"], finding["seam"], finding["message"], finding["evidence"],
                        finding["confidence"], step=crash.get("step"))
