"""The reference target: the stack of ``model/`` behind the ``Target`` interface (recipes, runner, roles)."""

from __future__ import annotations

from faultbench.model import seams as _seams
from faultbench.targets import Target


def _recipes() -> dict:
    from faultbench.targets.ref.recipes import RECIPES

    return RECIPES


def _run_case(*args, **kwargs) -> dict:
    from faultbench.targets.ref.case import run_case

    return run_case(*args, **kwargs)


def _roles() -> dict:
    from faultbench.targets.ref.roles import ROLES

    return dict(ROLES)


def _warm_up(recipe: str) -> None:
    """One optimizer step of the recipe (the first optimizer imports torch._dynamo: 1.4 s per process)."""
    from faultbench.model.run import build_run
    from faultbench.model.train import next_micro_batches, train_step

    run = build_run(_recipes()[recipe].config(0))
    train_step(run, next_micro_batches(run))


def _matcher(name: str):
    """The reference's matcher function ``name`` (``targets.ref.recipes``), imported on first call."""
    def call(*args):
        from faultbench.targets.ref import recipes

        return getattr(recipes, name)(*args)

    return call


TARGET = Target(
    name="ref",
    seams=lambda: dict(_seams.SEAMS),
    resolve=_seams.resolve,
    recipes=_recipes,
    run_case=_run_case,
    clean_guarantees=tuple(f"tests.model.{m}" for m in (
        "test_accumulation", "test_amp", "test_causality", "test_convergence", "test_eval", "test_kv_cache",
        "test_label_alignment", "test_mask_precision", "test_optim", "test_padding", "test_resume", "test_rope",
        "test_sampler", "test_tokenizer")) + ("tests.distributed.test_ddp", "tests.distributed.test_resume"),
    needs=_matcher("needs"),
    has=_matcher("has"),
    features=_matcher("features"),
    preload=("faultbench.model.run", "faultbench.model.train", "faultbench.model.checkpoint",
             "faultbench.targets.ref.case"),
    roles=_roles,
    captures=True,
    warm_up=_warm_up,
)
