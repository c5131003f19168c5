"""The whole detector suite on a clean HF case: it runs as it is, with no HF special case.

Every detector either works on the run through what the context offers every target (its general facts, its
roles, its own seam table) or says once, with its reason, that it does not apply; none raises and none fires.
"""

from __future__ import annotations

import pytest

from faultbench import targets
from faultbench.detectors.api import all_detectors, white_box_ids
from faultbench.harness.case import execute
from faultbench.harness.launch import RankPool
from faultbench.harness.record import Case

# detectors that read only what any target offers (facts, batches, records, the model's parameters)
GENERAL = {"batch_special_ids", "loss_vs_floor", "padding_waste", "graph_retention", "init_envelope",
           "rank_agreement", "loss_curve", "crash_triage"}
# detectors that probe roles (detectors.api.ROLES) the HF target offers (targets/hf/roles.py)
BY_ROLE = {"corpus_invariants", "collate_contract", "mask_contract", "causality_probe", "padding_invariance",
           "loss_contract", "optimizer_config", "lr_schedule", "grad_hygiene", "split_overlap", "attend_contract",
           "shift_invariance", "kv_cache_consistency", "logit_grad_scale", "eval_contract", "batch_order"}


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, preload=targets.get("hf").preload) as ranks:
        yield ranks


@pytest.mark.parametrize("recipe", ["fp32", "ddp"])
def test_the_suite_on_a_clean_hf_case_is_silent_and_says_what_does_not_apply(recipe, request):
    ids = tuple(i for i in white_box_ids() if not all_detectors()[i].exclusive)  # the black-box track: tests/watch
    ranks = request.getfixturevalue("pool") if recipe == "ddp" else None
    record = execute(Case(recipe, 0, (), ids, target="hf"), None, ranks)
    assert record["crash"] is None
    assert record["detector_errors"] == {}
    assert record["findings"] == [], [f"{f['detector']}: {f['message']}" for f in record["findings"]]
    reasons = {d: s["not_applicable"] for d, s in record["summaries"].items() if "not_applicable" in s}
    assert not (GENERAL | BY_ROLE) & set(reasons), {d: reasons[d] for d in (GENERAL | BY_ROLE) & set(reasons)}
    # the reference's probes name what this run lacks: a seam outside its table, a config section, a component
    assert "seam model.train.forward_loss" in reasons["forward_loss_contract"]
    assert "config.train.precision" in reasons["scaler_monitor"]
    assert "run.corpus.train" in reasons["module_composition"]
    assert all(r.startswith("on_") and "this run has no" in r for r in reasons.values()), reasons
    # every other detector is judged at its first hook; resume_continuity's fire only around a checkpoint
    assert set(ids) - GENERAL - BY_ROLE - set(reasons) == {"resume_continuity"}
