"""The HF target: a tiny ``LlamaForCausalLM`` trained by transformers' ``Trainer`` on the reference's corpus.

Importing it forbids any hub access for the process (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``),
so an accidental download fails loudly instead of fetching a model; everything is built locally.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from faultbench.targets import Target  # noqa: E402
from faultbench.targets.hf import seams as _seams  # noqa: E402


def _recipes() -> dict:
    from faultbench.targets.hf.recipes import RECIPES

    return RECIPES


def _run_case(*args, **kwargs) -> dict:
    from faultbench.targets.hf.case import run_case

    return run_case(*args, **kwargs)


def _warm_up(recipe: str) -> None:
    from faultbench.targets.hf.case import warm_up

    warm_up(recipe)


def _roles() -> dict:
    from faultbench.targets.hf.roles import ROLES

    return dict(ROLES)


def _matcher():
    from faultbench.targets.hf import matcher

    return matcher


TARGET = Target(
    name="hf",
    seams=lambda: dict(_seams.SEAMS),
    resolve=_seams.resolve,
    recipes=_recipes,
    run_case=_run_case,
    clean_guarantees=("tests.hf.test_generate", "tests.hf.test_padding", "tests.hf.test_accumulation",
                      "tests.hf.test_resume", "tests.hf.test_ddp", "tests.hf.test_convergence"),
    needs=lambda manifest: _matcher().needs(manifest),
    has=lambda recipe, need: _matcher().has(recipe, need),
    features=lambda recipe: _matcher().features(recipe),
    preload=("faultbench.targets.hf.case", "faultbench.targets.hf.scenario"),
    warm_up=_warm_up,
    roles=_roles,
)
