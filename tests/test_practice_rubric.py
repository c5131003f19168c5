"""The interviewer's rubric: dimensions in a strong answer's order, tailored checks, follow-ups, red flags,
score bands and a time budget, for every reference fault."""

import csv
from pathlib import Path

import pytest

from faultbench.faults.registry import all_faults
from faultbench.harness.cli import main
from faultbench.harness.practice_level import difficulty, hints
from faultbench.harness.rubric import (
    DIMENSIONS,
    RED_FLAG_BY_TRIGGER,
    SUBSYSTEM_CHECKS,
    TIME_BUDGET_MIN,
    follow_ups,
    rubric,
)
from faultbench.harness.runsheet import CLOSE_MIN, follow_up_answers, runsheet

FAULTS = all_faults("ref")
SECTIONS = ("## 1. Reproduce with seed control", "## 2. Isolate by subsystem", "## 3. Instrument", "## 4. Fix",
            "## 5. Prevent with a regression test", "## 6. Minimal reproducible example", "## Follow-up questions",
            "## Red flags", "## Time budget", "## The real bug it models")
RUNSHEET_SECTIONS = ("## What to say at the start", "## Minute plan", "## Hints, word for word",
                     "## Follow-up questions and model answers", "## Scoring: what each band looks like",
                     "## Red flags", "## Closing")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """A results folder made for the rubric, every fault in it: in bench.csv `always` localizes it first on
    every seed, `sometimes` on one seed of two (so not listed), and the suite is never listed; faults.md and
    mutation.md rows carry a per-fault evidence and a per-fault failing test."""
    out = tmp_path_factory.mktemp("results")
    with (out / "bench.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["case", "fault", "seed", "detector", "rr_subsystem"])
        writer.writeheader()
        for fault_id in FAULTS:
            for seed, rr in enumerate((1.0, 0.5)):
                for detector, value in (("always", 1.0), ("sometimes", rr), ("suite", 1.0)):
                    writer.writerow({"case": f"{fault_id}/s{seed}", "fault": fault_id, "seed": seed,
                                     "detector": detector, "rr_subsystem": value})
    rows = "".join(f"| `{f}` | x | evidence of {f} |\n" for f in FAULTS)
    (out / "faults.md").write_text(f"| fault | subsystem | evidence |\n| --- | --- | --- |\n{rows}")
    rows = "".join(f"| `{f}` | killed | tests/model/test_x.py::test_{f} |\n" for f in FAULTS)
    (out / "mutation.md").write_text(f"| fault | result | first failing test |\n| --- | --- | --- |\n{rows}")
    return out


@pytest.mark.parametrize("fault_id", sorted(FAULTS))
def test_rubric_covers_the_dimensions_in_order_with_bands(fault_id, results):
    spec = FAULTS[fault_id]
    text = rubric(fault_id, results=results)
    where = [text.find(s) for s in SECTIONS]
    assert -1 not in where and where == sorted(where), "sections missing or out of order"
    assert text.count("- Score: 1: missing or wrong; 2: ") == 6  # a 1-4 band under each of the six dimensions
    assert all(seam in text for seam in spec.seams) and spec.explanation in text and spec.fix in text
    assert all(f"- {ref}" in text for ref in spec.references)
    assert f"evidence of {fault_id}" in text and SUBSYSTEM_CHECKS[spec.subsystem] in text
    assert "Detectors that localize it first on every bench seed: `always` (" in text
    assert f"A regression test that fails with this bug in place: `tests/model/test_x.py::test_{fault_id}`" in text
    assert f"- {TIME_BUDGET_MIN[difficulty(spec, results)]} minutes (" in text
    assert 2 <= len(follow_ups(spec)) <= 3 and all(q in text for q in follow_ups(spec))
    assert spec.trigger == "always" or RED_FLAG_BY_TRIGGER[spec.trigger] in text


def test_follow_ups_follow_the_trigger():
    assert "only after a resume" in follow_ups(FAULTS["sampler_state_not_restored"])[0]
    assert "under DDP" in follow_ups(FAULTS["no_sync_on_last_micro_batch"])[0]
    assert "traceback" in follow_ups(FAULTS["ignore_index_mismatch"])[0]  # always: the symptom's question first


def test_rubric_without_results_still_has_the_answer(tmp_path):
    text = rubric("label_permute", results=tmp_path)
    assert "model.train.forward_loss" in text and "Detectors that localize" not in text


def test_rubric_cli_suggests_a_close_fault_id(capsys):
    assert main(["practice", "rubric", "--fault", "label_permut"]) == 2
    assert "did you mean 'label_permute'" in capsys.readouterr().err


# ---- the run-sheet -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fault_id", sorted(FAULTS))
def test_runsheet_runs_the_slot_from_one_page(fault_id, results):
    """A 45-minute interview from the sheet alone: the opening words, a minute plan that fits the slot, each hint
    word for word, a model answer under every follow-up question, anchored bands on all six dimensions, the
    close; in plain words (none of the machinery's)."""
    spec = FAULTS[fault_id]
    text = runsheet(fault_id, 45, "Ada", results=results)
    where = [text.find(s) for s in RUNSHEET_SECTIONS]
    assert -1 not in where and where == sorted(where), "sections missing or out of order"
    plan = [int(line.split("|")[1]) for line in text.split("## Minute plan")[1].split("## Hints")[0].splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert plan[0] == 0 and plan == sorted(set(plan)) and plan[-1] <= 45 - CLOSE_MIN
    assert all(h.split(": ", 1)[-1][1:] in text for h in hints(spec))
    pairs = follow_up_answers(spec)
    assert [q for q, _ in pairs] == follow_ups(spec) and all(f"**{q}**\n\n{a}\n" in text for q, a in pairs)
    bands = [line for line in text.splitlines() if line.startswith("| ") and line.split("|")[1].strip() in DIMENSIONS]
    assert [b.split("|")[1].strip() for b in bands] == list(DIMENSIONS) and all(b.count("|") == 6 for b in bands)
    assert spec.fix in text and "with Ada" in text
    plain = text.replace(spec.explanation, "").replace(spec.fix, "").lower()  # the sheet's own words, that is
    plain = plain.replace("check.py --seams", "")  # the folder's own option, named in hint 2
    for jargon in ("seam", "manifest", "detector", "fault id", "registry"):
        assert jargon not in plain, jargon


def test_runsheet_refuses_a_slot_too_short_and_scales_the_plan(results, capsys):
    with pytest.raises(ValueError, match="at least 24 minutes"):
        runsheet("missing_zero_grad", 20, results=results)
    short, long = (runsheet("missing_zero_grad", m, results=results) for m in (30, 90))
    assert "| 19 | Stop debugging" in short and "| 19 | Stop debugging" not in long
    assert main(["practice", "runsheet", "--fault", "missing_zero_grad", "--minutes", "10"]) == 2
    assert "at least 24 minutes" in capsys.readouterr().err
