"""The fault sets side by side (results/sets.md, the leaderboard's section) and the mutant set's breakdown per
operator and subsystem, on hand-made summaries and rows."""

import json

from faultbench.harness.sets import breakdown, breakdown_markdown, read_rows, sets_rows, sets_section, write_sets


def _summary(detection: float, faults: int) -> dict:
    scores = {"fault_cases": 3, "detection_rate": detection, "top1_subsystem": detection / 2, "top1_seam": 0.25,
              "false_positive_rate": 0.0}
    return {"seeds": [0], "targets": {"ref": {"faults": faults, "suite": scores, "blackbox": {**scores,
                                                                                              "fault_cases": 0}}}}


def test_each_set_is_read_from_its_folder_and_the_registry_can_be_the_summary_being_written(tmp_path):
    (tmp_path / "mutants").mkdir()
    (tmp_path / "mutants" / "summary.json").write_text(json.dumps(_summary(0.5, 400)))
    (tmp_path / "summary.json").write_text(json.dumps(_summary(1.0, 58)))
    rows = sets_rows(tmp_path)
    assert [(r["set"], r["track"], r["faults"], r["detection_rate"]) for r in rows] == [
        ("registry", "white-box", 58, 1.0), ("mutants", "white-box", 400, 0.5)]  # a track with no case is left out
    fresher = sets_rows(tmp_path, registry=_summary(0.9, 60))
    assert fresher[0]["detection_rate"] == 0.9
    section = "\n".join(sets_section(tmp_path, _summary(0.9, 60)))
    assert "| ref | white-box | registry | 60 x 1 | 0.900 | 0.450 | 0.250 | 0.000 |" in section
    assert "| ref | white-box | mutants | 400 x 1 | 0.500 |" in section
    assert sets_section(tmp_path / "mutants", _summary(0.9, 60)) == []  # one set alone: no section
    text = write_sets(tmp_path).read_text()
    assert "| ref | white-box | mutants | 400 x 1 |" in text


def test_the_breakdown_counts_shown_cases_per_operator_and_subsystem(tmp_path):
    meta = {"m1": {"operator": "off_by_one", "subsystem": "loss"}, "m2": {"operator": "off_by_one",
                                                                         "subsystem": "mask"}}
    header = "case,target,fault,detector,detected,top1_subsystem,top1_seam,manifested,latency\n"
    lines = ["a,ref,m1,suite,True,True,False,True,0", "b,ref,m2,suite,True,False,False,True,",
             "c,ref,m2,suite,False,False,False,False,",  # did not show: not scored
             "d,ref,m1,blackbox,False,False,False,,", "e,ref,,suite,True,False,False,,",
             "f,ref,m1,lr_probe,True,True,True,True,0"]
    (tmp_path / "bench.csv").write_text(header + "\n".join(lines) + "\n")
    rows = breakdown(read_rows(tmp_path / "bench.csv"), meta)
    by = {(r["track"], r["by"], r["key"]): r for r in rows}
    assert by["white-box", "operator", "off_by_one"] == {
        "target": "ref", "track": "white-box", "by": "operator", "key": "off_by_one", "cases": 2, "detected": 1.0,
        "top1_subsystem": 0.5, "top1_seam": 0.0, "median_latency": 0.0}
    assert by["black-box", "subsystem", "loss"]["cases"] == 1 and by["black-box", "subsystem", "loss"]["detected"] == 0
    assert ("white-box", "subsystem", "mask") in by and len(rows) == 5
    assert "| ref | white-box | off_by_one | 2 | 1.000 | 0.500 | 0.000 | 0.000 |" in breakdown_markdown(rows,
                                                                                                 "mutants-v1")


def test_a_plugins_scores_are_set_beside_the_registrys_with_the_ratio():
    from faultbench.harness.sets import generalization, generalization_lines

    rows = generalization(_summary(0.6, 16), _summary(0.8, 58))
    by = {(r["track"], r["metric"]): r for r in rows}
    assert set(by) == {("white-box", m) for m in ("detection", "top-1 subsystem", "top-1 seam", "FP")}
    assert by["white-box", "detection"]["ratio"] == 0.6 / 0.8
    assert by["white-box", "FP"]["ratio"] is None  # a rate of zero has no meaningful ratio
    assert "| ref | white-box | detection | 0.600 | 0.800 | 0.750 |" in generalization_lines(rows)
    assert generalization(_summary(0.6, 16), {"targets": {}}) == []  # nothing to compare with


def test_a_blind_sets_published_summary_holds_aggregates_only():
    from faultbench.harness.sets import aggregates_only

    full = {**_summary(0.5, 17), "cases": 150, "faults": 17}
    full["targets"]["ref"]["per_fault"] = {"blind_x": {"detected": 0}}
    full["targets"]["ref"]["detectors"] = {"bb_eval_loss": {}}
    published = aggregates_only(full)
    assert "blind_x" not in json.dumps(published) and "bb_eval_loss" not in json.dumps(published)
    assert published["targets"]["ref"]["suite"] == full["targets"]["ref"]["suite"]
