"""Scoring: localization ranks, latency, false positives and overhead from hand-made findings."""

import pytest

from faultbench.harness.score import BLACKBOX, aggregate, case_rows, score_findings

FAULT = {"subsystem": "collate", "also_acceptable": ["mask"], "seams": ["model.data.collate"], "trigger": "always"}


def finding(subsystem, seam=None, step=0, detector="d"):
    return {"detector": detector, "step": step, "subsystem": subsystem, "seam": seam, "message": "", "evidence": {},
            "confidence": 0.5}


def test_top1_when_the_first_finding_names_the_subsystem_and_seam():
    row = score_findings([finding("collate", "model.data.collate", step=0), finding("loss")], FAULT, 0)
    assert row["detected"] and row["top1_subsystem"] and row["top1_seam"]
    assert row["rr_subsystem"] == row["rr_seam"] == 1.0
    assert row["latency"] == 0


def test_ranks_count_distinct_locations_and_also_acceptable_subsystems():
    findings = [finding("loss", "model.loss.lm_loss"), finding("loss", "model.loss.lm_loss"),
                finding("optimizer", None), finding("mask", "model.attention.attend", step=3)]
    row = score_findings(findings, FAULT, 0)
    assert not row["top1_subsystem"] and row["top3_subsystem"]
    assert row["rr_subsystem"] == pytest.approx(1 / 3)  # loss, optimizer, then mask (acceptable)
    assert row["rr_seam"] == 0.0 and not row["top3_seam"]  # no finding names the fault's seam
    assert row["latency"] == 3


def test_nothing_found_scores_zero_and_no_latency():
    row = score_findings([], FAULT, 0)
    assert not row["detected"] and row["rr_subsystem"] == 0.0 and row["latency"] is None


def test_latency_counts_from_the_checkpoint_step_for_on_resume_faults():
    fault = {**FAULT, "trigger": "on-resume"}
    record = {"case": {"faults": ["f"], "recipe": "resume", "seed": 0, "detectors": ["d"]}, "name": "f/resume/s0",
              "findings": [finding("collate", step=8)], "crash": None, "resumed_at": 9, "train_s": 1.0,
              "step_seconds": {"d": 0.01}, "other_seconds": {}, "detector_errors": {}}
    (row,) = case_rows(record, {"f": fault}, suite_ids=[])
    assert row["latency"] == 0
    # a finding pinned on an event before the trigger (an offline checker's attribution) is not earlier than it
    (row,) = case_rows({**record, "findings": [finding("collate", step=0)]}, {"f": fault}, suite_ids=[])
    assert row["latency"] == 0


def test_aggregate_separates_clean_and_faulty_cases_and_measures_overhead():
    timing = {"detector": "d", "train_s": 1.0, "loop_s": 0.98, "step_s": 0.02, "other_s": 0.0}
    perfect = {f"{m}_{level}": v for level in ("subsystem", "seam")
               for m, v in (("top1", True), ("top3", True), ("rr", 1.0))}
    rows = [
        {**timing, "fault": "f", "detected": True, "latency": 0, "error": "", **perfect},
        {**timing, "fault": "", "detected": True, "error": ""},
        {**timing, "fault": "", "detected": False, "error": "boom"},
    ]
    s = aggregate(rows, {"d": True})
    assert s["detection_rate"] == 1.0 and s["false_positive_rate"] == 0.5
    assert s["top1_subsystem"] == 1.0 and s["median_latency_steps"] == 0
    assert s["overhead_ratio"] == pytest.approx(1 / 0.98)
    assert s["errors"] == 1


def test_the_overhead_is_over_the_loop_alone_not_over_a_train_time_that_holds_other_hooks():
    """A probing detector's and the other track's seconds inside the steps are not the loop's time: counted in the
    base, they would flatter the passive detectors' ratio."""
    record = {"case": {"faults": [], "recipe": "fp32", "seed": 0, "detectors": ["w", "b", "probe"]},
              "name": "clean/fp32/s0", "findings": [], "crash": None, "train_s": 1.3, "detector_errors": {},
              "step_seconds": {"w": 0.05, "b": 0.05, "probe": 0.1, "watch": 0.1}, "other_seconds": {}}
    rows = {r["detector"]: r for r in case_rows(record, {}, suite_ids=["w"], blackbox_ids=["b", "probe"],
                                                 passive={"probe": False})}
    assert rows["b"]["loop_s"] == pytest.approx(1.0)  # 1.3 s less every in-step hook of both tracks
    assert rows[BLACKBOX]["step_s"] == pytest.approx(0.15)  # the passive member and the watch, not the probe
    scores = aggregate([rows[BLACKBOX]], {})
    assert scores["overhead_ratio"] == pytest.approx(1.15)  # not 1.3 / (1.3 - 0.15)
    assert aggregate([rows["w"]], {})["overhead_ratio"] == pytest.approx(1.05)


def test_an_exclusive_detector_is_charged_its_whole_slowdown_against_the_paired_suite_case():
    from faultbench.harness.score import SUITE, exclusive_overhead

    rows = [{"case": "c", "detector": SUITE, "train_s": 1.1, "loop_s": 1.0, "step_s": 0.1, "crash": ""},
            {"case": "c", "detector": "anomaly", "train_s": 3.0, "loop_s": 3.0, "step_s": 0.0, "crash": ""}]
    assert exclusive_overhead(rows, "anomaly") == pytest.approx(3.0)


def test_goals_are_judged_only_when_the_suite_ran():
    from faultbench.harness.bench import GOALS
    from faultbench.harness.report import goal_lines

    goals = {track: {k: list(v) for k, v in g.items()} for track, g in GOALS.items()}
    assert goal_lines({"suite": None, "blackbox": None}, goals) == [
        "No suite detector ran in this bench, so the suites' goals do not apply."]
    suite = {"detection_rate": 0.9, "false_positive_rate": 0.0}
    lines = goal_lines({"suite": suite}, goals)
    assert "| white-box | suite.detection_rate | >= 0.95 | 0.900 | NO |" in lines
    assert "| white-box | suite.false_positive_rate | <= 0.0 | 0.000 | yes |" in lines
    assert not any("black-box" in line for line in lines)  # that track did not run
    lines = goal_lines({"suite": None, "blackbox": suite}, goals)  # its own, lower bar
    assert "| black-box | blackbox.detection_rate | >= 0.9 | 0.900 | yes |" in lines


def test_scores_count_only_cases_where_the_fault_showed_and_report_the_others_beside():
    from faultbench.harness.score import SUITE, per_fault

    perfect = {f"{m}_{level}": v for level in ("subsystem", "seam") for m, v in (("top1", True), ("top3", True),
                                                                                 ("rr", 1.0))}
    missed = {f"{m}_{level}": v for level in ("subsystem", "seam") for m, v in (("top1", False), ("top3", False),
                                                                                ("rr", 0.0))}
    base = {"detector": SUITE, "fault": "f", "train_s": 1.0, "loop_s": 1.0, "step_s": 0.0, "other_s": 0.0, "error": "",
            "crash": ""}
    rows = [{**base, "recipe": "fp32", "manifested": True, "detected": True, "latency": 0, **perfect},
            {**base, "recipe": "resume", "manifested": False, "detected": False, "latency": None, **missed},
            {**base, "recipe": "fp32", "manifested": None, "detected": False, "latency": None, **missed}]
    s = aggregate(rows, {})
    assert s["fault_cases"] == 2 and s["not_shown_cases"] == 1  # a case with no clean twin counts as shown
    assert s["detection_rate"] == 0.5 and s["top1_subsystem"] == 0.5
    entry = per_fault(rows, {"f": FAULT})["f"]
    assert entry["recipes"] == ["fp32", "resume"] and entry["cases"] == 3 and entry["not_shown"] == 1
    assert entry["detected"] == 1 and entry["top1_seam"] == 1


def test_a_case_row_carries_whether_its_fault_showed():
    record = {"case": {"faults": ["f"], "recipe": "fp32", "seed": 0, "detectors": ["d"]}, "name": "f/fp32/s0",
              "findings": [], "crash": None, "train_s": 1.0, "step_seconds": {}, "other_seconds": {},
              "detector_errors": {}, "manifested": False}
    (row,) = case_rows(record, {"f": FAULT}, suite_ids=[])
    assert row["manifested"] is False
