"""The fault registry: frozen metadata next to each buggy replacement of a reference seam.

A fault module defines the buggy function(s) with the ``@fault`` decorator (and ``@also_replaces``
for a fault that spans a second seam). Builtin faults live in one module per subsystem and are
loaded on first lookup; plugins register through the same decorators (``load_plugin``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from model.seams import SEAMS, SUBSYSTEMS, resolve

TRIGGERS = ("always", "rare-batch", "after-step", "on-resume", "multi-rank", "amp-only", "eval-only")
SYMPTOMS = (
    # crash-state: an object in an invalid state (None where a tensor was expected, a scaler used twice)
    "crash-shape", "crash-dtype", "crash-index", "crash-state", "nan", "divergence", "stall", "silent-quality",
    "eval-metric", "desync", "hang",
    # performance faults break no number but waste the machine
    "slowdown", "memory-growth",
)
SCENARIOS = ("train", "resume", "generate", "ddp", "ddp_resume")
BUILTIN_MODULES = (
    "faults.data", "faults.collate", "faults.mask", "faults.position", "faults.model", "faults.loss",
    "faults.optimizer", "faults.precision", "faults.checkpoint", "faults.distributed", "faults.eval",
)
ENTRY_POINT_GROUP = "faultbench.plugins"


@dataclass(frozen=True)
class Manifest:
    """How the proof test makes the fault show: a scenario, a run variant, and the check that must hold.

    ``variant`` overrides config sections (``{"data": {"pad_side": "left"}, "train": {...}}``);
    ``check`` names a check in ``harness.manifest.CHECKS`` and ``params`` are its thresholds.
    """

    check: str
    steps: int = 30
    scenario: str = "train"
    variant: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    seeds: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class FaultSpec:
    id: str
    title: str
    subsystem: str
    seams: tuple[str, ...]
    trigger: str
    symptoms: tuple[str, ...]
    explanation: str
    fix: str
    references: tuple[str, ...]
    manifest: Manifest
    also_acceptable: tuple[str, ...] = ()
    replacements: dict[str, Callable] = field(default_factory=dict, compare=False, repr=False)

    def metadata(self) -> dict:
        """Everything but the replacement functions, JSON-able."""
        d = dataclasses.asdict(self)
        d.pop("replacements")
        return d


FAULTS: dict[str, FaultSpec] = {}
_loaded_builtin = False


class FaultError(ValueError):
    """An invalid fault definition, or an unknown fault id."""


def _check_function(seam: str, fn: Callable) -> None:
    """Same signature as the seam, a docstring, and only globals the seam's module also has."""
    # same names, kinds and defaults: the spliced copy keeps the seam's header
    want = [(p.name, p.kind, p.default) for p in inspect.signature(inspect.unwrap(resolve(seam))).parameters.values()]
    got = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    if want != got:
        raise FaultError(f"{fn.__name__} must have the signature of {seam} (names and defaults): {want}, got {got}")
    if not inspect.getdoc(fn):
        raise FaultError(f"{fn.__module__}.{fn.__name__} needs a docstring saying what is wrong")
    # spliced into the seam's module, the function sees that module's globals, not its own
    seam_globals = vars(sys.modules[inspect.unwrap(resolve(seam)).__module__])
    missing = [n for n in inspect.getclosurevars(fn).globals if n not in seam_globals]
    if missing:
        raise FaultError(f"{fn.__name__} uses {missing}, which {seam}'s module does not define; import them "
                         "inside the function")


def _validate(spec: FaultSpec) -> None:
    problems = []
    if spec.subsystem not in SUBSYSTEMS:
        problems.append(f"unknown subsystem {spec.subsystem!r}")
    problems += [f"unknown also_acceptable subsystem {s!r}" for s in spec.also_acceptable if s not in SUBSYSTEMS]
    problems += [f"unknown seam {s!r}" for s in spec.seams if s not in SEAMS]
    if spec.trigger not in TRIGGERS:
        problems.append(f"unknown trigger {spec.trigger!r}; expected one of {TRIGGERS}")
    problems += [f"unknown symptom {s!r}" for s in spec.symptoms if s not in SYMPTOMS]
    if not spec.symptoms:
        problems.append("no symptoms")
    if not spec.references:
        problems.append("no references: cite the real bug or checklist item it models")
    if spec.manifest.scenario not in SCENARIOS:
        problems.append(f"unknown scenario {spec.manifest.scenario!r}; expected one of {SCENARIOS}")
    if problems:
        raise FaultError(f"fault {spec.id!r}: " + "; ".join(problems))


def fault(id: str, *, seam: str, title: str, subsystem: str, trigger: str, symptoms, explanation: str,
          fix: str, references, manifest: Manifest, also_acceptable=()):
    """Register the decorated function as fault ``id``'s replacement for ``seam``."""

    def register(fn: Callable) -> Callable:
        if id in FAULTS:
            raise FaultError(f"fault id {id!r} is registered twice")
        spec = FaultSpec(id=id, title=title, subsystem=subsystem, seams=(seam,), trigger=trigger,
                         symptoms=tuple(symptoms), explanation=explanation, fix=fix,
                         references=tuple(references), manifest=manifest,
                         also_acceptable=tuple(also_acceptable), replacements={seam: fn})
        _validate(spec)
        _check_function(seam, fn)
        FAULTS[id] = spec
        return fn

    return register


def also_replaces(id: str, seam: str):
    """Add the decorated function to the already registered fault ``id`` as its replacement for ``seam``."""

    def register(fn: Callable) -> Callable:
        spec = FAULTS.get(id)
        if spec is None:
            raise FaultError(f"also_replaces({id!r}): register the fault with @fault first")
        if seam in spec.replacements:
            raise FaultError(f"fault {id!r} already replaces {seam}")
        _check_function(seam, fn)
        updated = dataclasses.replace(spec, seams=spec.seams + (seam,),
                                      replacements={**spec.replacements, seam: fn})
        _validate(updated)
        FAULTS[id] = updated
        return fn

    return register


def load_builtin() -> None:
    global _loaded_builtin
    if not _loaded_builtin:
        _loaded_builtin = True
        for name in BUILTIN_MODULES:
            importlib.import_module(name)
        _load_entry_points()


def _load_entry_points() -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()


def load_plugin(path_or_module: str) -> None:
    """Import a plugin (a .py file or a module name) that registers faults (or detectors)."""
    path = Path(path_or_module)
    if path.suffix == ".py":
        if not path.exists():
            raise FaultError(f"plugin file {path} does not exist")
        name = f"faultbench_plugin_{path.stem}"
        if name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        importlib.import_module(path_or_module)


def all_faults() -> dict[str, FaultSpec]:
    load_builtin()
    return FAULTS


def get_fault(fault_id: str) -> FaultSpec:
    """The fault ``fault_id``; an unknown id raises ``FaultError`` with the closest ids."""
    faults = all_faults()
    if fault_id not in faults:
        close = difflib.get_close_matches(fault_id, faults, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise FaultError(f"unknown fault id {fault_id!r}{hint} (`faultbench faults` lists them)")
    return faults[fault_id]
