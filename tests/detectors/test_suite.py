"""The detector suite on the bench's cases: every fault found and localized, every clean recipe silent.

Localized means both headline scores of the bench: the top-ranked finding names an acceptable subsystem
(Top-1 subsystem), and the first seam of the ranked findings is one the fault replaces (Top-1 seam, as
``harness.score`` counts it: findings without a seam skipped). One seed per fault here, 0 and 1 taken in turn
over the sorted fault ids (the bench runs every fault on three). A documented blind spot is an
``xfail(strict=True)`` keyed by fault id: when a detector starts catching it, the test fails until the entry is
removed.
"""

import pytest

from faultbench.detectors.api import resolve_ids
from faultbench.faults.registry import all_faults
from faultbench.harness.case import execute
from faultbench.harness.golden import load_golden
from faultbench.harness.matcher import recipe_for
from faultbench.harness.record import Case
from faultbench.targets.ref.recipes import RECIPES

SEEDS = (0, 1)
BLIND_SPOTS: dict[str, str] = {}


def _run(recipe: str, faults, pool, seed: int = 0) -> dict:
    golden = load_golden([recipe], pool if RECIPES[recipe].world_size > 1 else None)[recipe]
    case = Case(recipe, seed, tuple(faults), tuple(resolve_ids(["suite"])))
    return execute(case, golden, pool if RECIPES[recipe].world_size > 1 else None)


def _params():
    for i, (fault_id, spec) in enumerate(sorted(all_faults().items())):
        marks = [pytest.mark.xdist_group("rank_pool")] if RECIPES[recipe_for(spec.manifest)].world_size > 1 else []
        if fault_id in BLIND_SPOTS:
            marks.append(pytest.mark.xfail(strict=True, reason=BLIND_SPOTS[fault_id]))
        seed = SEEDS[i % len(SEEDS)]
        yield pytest.param(fault_id, seed, marks=marks, id=f"{fault_id}-s{seed}")


def top_seam(findings: list[dict]) -> str | None:
    """The first seam of the ranked findings (findings without a seam skipped), as the scorer's Top-1 seam."""
    return next((f["seam"] for f in findings if f["seam"] is not None), None)


@pytest.fixture
def pool_for(request):
    def get(recipe):
        return request.getfixturevalue("rank_pool") if RECIPES[recipe].world_size > 1 else None
    return get


@pytest.mark.parametrize(("fault_id", "seed"), list(_params()))
def test_suite_finds_and_localizes_the_fault(fault_id, seed, pool_for):
    spec = all_faults()[fault_id]
    recipe = recipe_for(spec.manifest)
    record = _run(recipe, (fault_id,), pool_for(recipe), seed)
    assert not record["detector_errors"], record["detector_errors"]
    assert record["findings"], f"no detector fired on {fault_id} ({recipe}, seed {seed})"
    top = record["findings"][0]
    acceptable = {spec.subsystem, *spec.also_acceptable}
    assert top["subsystem"] in acceptable, (f"top finding ({top['detector']}) names {top['subsystem']} "
                                            f"({top['message']}), not {acceptable}")
    seam = top_seam(record["findings"])
    assert seam in spec.seams, f"the first seam of the ranked findings is {seam}, not one of {spec.seams}"


@pytest.mark.parametrize("recipe", [
    pytest.param(r, marks=[pytest.mark.xdist_group("rank_pool")] if RECIPES[r].world_size > 1 else [], id=r)
    for r in RECIPES])
def test_suite_is_silent_on_clean_runs(recipe, pool_for):
    record = _run(recipe, (), pool_for(recipe))
    assert record["crash"] is None
    assert not record["detector_errors"], record["detector_errors"]
    # on its own target every detector applies: none gives itself a way out
    assert not [s["not_applicable"] for s in record["summaries"].values() if "not_applicable" in s]
    assert record["findings"] == [], [f"{f['detector']}: {f['message']}" for f in record["findings"]]
