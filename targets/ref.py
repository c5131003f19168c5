"""The reference target (``model/``) behind the ``Target`` interface, over ``harness.case`` unchanged."""

from __future__ import annotations

from model import seams as _seams
from targets import Target


def _recipes() -> dict:
    from harness.case import RECIPES

    return RECIPES


def _run_case(recipe: str, seed: int, detectors=(), golden: dict | None = None, rank: int = 0,
              workdir: str | None = None) -> dict:
    """``harness.case.run_case`` of a case without faults (the caller injects them around this call)."""
    from harness.case import Case, run_case

    record = run_case(Case(recipe, seed, (), tuple(detectors)), golden, rank, workdir)
    record["case"]["target"] = "ref"
    return record


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
)
