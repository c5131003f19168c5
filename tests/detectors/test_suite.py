"""The detector suite on the bench's cases: every fault found and localized, every clean recipe silent.

One seed here (the bench runs three). A documented blind spot is an ``xfail(strict=True)``: when a
detector starts catching it, the test fails until the entry is removed.
"""

import pytest

from detectors.api import resolve_ids
from faults.registry import all_faults
from harness.case import RECIPES, Case, execute, recipe_for
from harness.golden import load_golden

BLIND_SPOTS: dict[str, str] = {}


def _run(recipe: str, faults, pool) -> dict:
    golden = load_golden([recipe], pool if RECIPES[recipe].world_size > 1 else None)[recipe]
    case = Case(recipe, 0, tuple(faults), tuple(resolve_ids(["suite"])))
    return execute(case, golden, pool if RECIPES[recipe].world_size > 1 else None)


def _params():
    for fault_id, spec in sorted(all_faults().items()):
        marks = [pytest.mark.xdist_group("ddp_suite")] if RECIPES[recipe_for(spec.manifest)].world_size > 1 else []
        if fault_id in BLIND_SPOTS:
            marks.append(pytest.mark.xfail(strict=True, reason=BLIND_SPOTS[fault_id]))
        yield pytest.param(fault_id, marks=marks, id=fault_id)


@pytest.fixture
def pool_for(request):
    def get(recipe):
        return request.getfixturevalue("suite_pool") if RECIPES[recipe].world_size > 1 else None
    return get


@pytest.mark.parametrize("fault_id", list(_params()))
def test_suite_finds_and_localizes_the_fault(fault_id, pool_for):
    spec = all_faults()[fault_id]
    recipe = recipe_for(spec.manifest)
    record = _run(recipe, (fault_id,), pool_for(recipe))
    assert not record["detector_errors"], record["detector_errors"]
    assert record["findings"], f"no detector fired on {fault_id} ({recipe})"
    top = record["findings"][0]
    acceptable = {spec.subsystem, *spec.also_acceptable}
    assert top["subsystem"] in acceptable, f"top finding names {top['subsystem']} ({top['message']}), not {acceptable}"


@pytest.mark.parametrize("recipe", [
    pytest.param(r, marks=[pytest.mark.xdist_group("ddp_suite")] if RECIPES[r].world_size > 1 else [], id=r)
    for r in RECIPES])
def test_suite_is_silent_on_clean_runs(recipe, pool_for):
    record = _run(recipe, (), pool_for(recipe))
    assert record["crash"] is None
    assert not record["detector_errors"], record["detector_errors"]
    assert record["findings"] == [], [f"{f['detector']}: {f['message']}" for f in record["findings"]]
