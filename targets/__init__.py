"""Targets: the training stacks the bench can break, each behind one small interface.

A target is a package of its own (``model/`` for ``ref``, ``targets/hf/`` for ``hf``) that hands the
harness a ``Target``: its seam table, its clean recipes, a way to run one case and the modules that
test its clean guarantees. The harness and the scorer reach a target only through this object.

``get(name)`` imports a target on demand: the HF stack costs seconds to import, and a process that
only runs the reference should not pay for it (a forked bench imports it once, before forking).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from dataclasses import dataclass

# name -> module defining TARGET; a third stack (e.g. Lightning) adds one line here and one package
_MODULES = {"ref": "faultbench.targets.ref", "hf": "faultbench.targets.hf"}


@dataclass(frozen=True)
class Target:
    """One training stack.

    name:             "ref" | "hf"
    seams:            () -> {qualified name: subsystem}, the localization vocabulary, in table order
    resolve:          qualified name -> the live function (or class) it designates; ValueError if unknown
    recipes:          () -> {recipe name: recipe}; a recipe has ``.name``, ``.steps``, ``.world_size``
                      and ``.resume_at`` (the clean-matrix variants of this stack)
    run_case:         (recipe, seed, detectors=(), golden=None, rank=0, workdir=None) -> case record,
                      faults already injected by the caller; never raises (a crash is recorded). The
                      record has the keys of ``harness.record.empty_record``: history (one dict per
                      optimizer step: step, loss, grad_norm, lr, scale, skipped, tokens, seconds,
                      tokens_per_s), crash, val_loss, findings, detector_errors, step_seconds, ...
    clean_guarantees: the test modules that prove the clean stack's invariants
    needs:            manifest -> {(section, key): value}: what a recipe must have for the fault's code to run
                      (the manifest's essential keys, a switch as on/off; tuning keys left out)
    has:              (recipe, (section, key)) -> the recipe's value for one of ``needs``'s keys
    features:         recipe -> how many code paths it switches on beyond the plain run (the plainest
                      fitting recipe is a fault's home)
    preload:          modules a process forked or forkserved for this target's cases imports first
    warm_up:          recipe name -> None: build (and step) a run of it once in a process that forks cases, so
                      every child starts with the lazy imports done and the corpus caches filled
    roles:            () -> {role: detectors.api.Role}: the stack's component for each role of
                      ``detectors.api.ROLES`` it has (what white-box detectors probe), each naming its seam
    captures:         whether ``run_case`` takes ``capture_dir`` (every step's state and batch, for a repro
                      bundle: ``harness.bundle``)
    """

    name: str
    seams: Callable[[], dict[str, str]]
    resolve: Callable[[str], Callable]
    recipes: Callable[[], dict]
    run_case: Callable[..., dict]
    clean_guarantees: tuple[str, ...]
    needs: Callable[[object], dict]
    has: Callable[[object, tuple[str, str]], object]
    features: Callable[[object], int]
    preload: tuple[str, ...] = ()
    roles: Callable[[], dict] = dict
    captures: bool = False
    warm_up: Callable[[str], None] = lambda recipe: None


def names() -> tuple[str, ...]:
    return tuple(_MODULES)


def get(name: str) -> Target:
    """The target called ``name`` (imported on first use); an unknown name raises ``ValueError``."""
    if name not in _MODULES:
        close = difflib.get_close_matches(name, _MODULES, n=1, cutoff=0.4)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown target {name!r}{hint} (known: {', '.join(_MODULES)})")
    return importlib.import_module(_MODULES[name]).TARGET
