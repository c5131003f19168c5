"""Practice mode: the interviewer's rubric, and exercises from new to check."""

import csv
import math
from pathlib import Path

import pytest

from detectors.api import SUBSYSTEMS
from faults.registry import all_faults
from harness.cli import main
from harness.practice import rubric

FAULTS = all_faults()
SECTIONS = ("## 1. Reproduce", "## 2. Isolate by subsystem", "## 3. Instrument", "## 4. Fix", "## 5. Prevent")


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
def test_rubric_covers_reproduce_isolate_instrument_fix_prevent(fault_id, results):
    spec = FAULTS[fault_id]
    text = rubric(fault_id, results=results)
    where = [text.find(s) for s in SECTIONS]
    assert -1 not in where and where == sorted(where), "sections missing or out of order"
    assert all(seam in text for seam in spec.seams) and spec.explanation in text and spec.fix in text
    assert all(f"- {ref}" in text for ref in spec.references)
    assert f"evidence of {fault_id}" in text
    assert "Detectors that localize it first on every bench seed: `always` (" in text
    assert f"A regression test that fails with this bug in place: `tests/model/test_x.py::test_{fault_id}`" in text


def test_rubric_without_results_still_has_the_answer(tmp_path):
    text = rubric("label_permute", results=tmp_path)
    assert "model.train.forward_loss" in text and "Detectors that localize" not in text


def test_rubric_cli_suggests_a_close_fault_id(capsys):
    assert main(["practice", "rubric", "--fault", "label_permut"]) == 2
    assert "did you mean 'label_permute'" in capsys.readouterr().err


# what would give the fault away: its id and title, and any trace of the fault machinery
LEAKS = (r"\bfaults\b", r"\binjected?\b", "FAULTBENCH_")


def _splice_back_the_clean_seams(exercise: Path, spec) -> None:
    """What a candidate's fix amounts to: each replaced seam's clean definition back in the copy."""
    from faults.inject import seam_function_source, splice_module

    for seam in spec.seams:
        _, module, qualname = seam.split(".", 2)  # model.<module>.<qualname>
        path = exercise / "model" / f"{module}.py"
        path.write_text(splice_module(path.read_text(), {qualname: seam_function_source(seam)}))


def _loss_mismatches(a: list[float], b: list[float], tol: float = 1e-6) -> list[int]:
    """Steps where two loss curves of one length differ: NaN against a number, or numbers ``tol`` apart."""
    def differ(x: float, y: float) -> bool:
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) != math.isnan(y)
        return x != y and not abs(x - y) <= tol  # x != y: equal infinities agree

    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if differ(x, y)]


@pytest.mark.parametrize("fault_id", sorted(FAULTS))
def test_exercise_round_trip(tmp_path, monkeypatch, fault_id):
    """new -> nothing gives the fault away -> the broken copy is the injected run and shows the symptom ->
    hints and grading -> splice the clean seam back -> check says repaired."""
    import re

    from harness import practice
    from harness.scenario import run_scenario

    monkeypatch.setenv("FAULTBENCH_PRACTICE_KEYS", str(tmp_path / "keys"))
    spec = FAULTS[fault_id]
    m = spec.manifest
    ex = practice.new_exercise(tmp_path / "ex", fault=fault_id)
    readme = (ex / "README.md").read_text()
    assert "python train.py" in readme and (ex / "loss.png").stat().st_size > 0
    text = "\n".join(p.read_text(errors="ignore") for p in ex.rglob("*") if p.is_file() and p.suffix in (".py", ".md"))
    for secret in (re.escape(fault_id), re.escape(spec.title), *LEAKS):
        assert not re.search(secret, text), secret

    broken = practice.scenario_outcome(ex, m)
    # the copy runs exactly as the injected reference (a DDP scenario starts a rank pool of its own)
    injected = run_scenario(m.scenario, m.variant, m.steps, m.seeds[0], (fault_id,)).to_dict()
    assert (broken["crash"] or {}).get("type") == (injected["crash"] or {}).get("type")
    assert (broken["crash"] or {}).get("step") == (injected["crash"] or {}).get("step")
    assert _loss_mismatches(broken["losses"], injected["losses"]) == []
    assert practice.repair_problems(broken, practice.reference_outcome(m), m), "the exercise shows no symptom"

    first = practice.hint(ex)
    assert "Hint 1" in first and "Hint 2" not in first
    assert spec.subsystem in practice.hint(ex) and spec.seams[0] in practice.hint(ex)
    assert practice.answer(ex, spec.subsystem, spec.seams[0]) == {"subsystem": "right", "seam": "right",
                                                                  "hints_used": 3}
    wrong = next(s for s in SUBSYSTEMS if s != spec.subsystem and s not in spec.also_acceptable)
    assert practice.answer(ex, wrong)["subsystem"] == "wrong"
    assert "What is wrong" in practice.reveal(ex) and spec.fix in practice.reveal(ex)

    _splice_back_the_clean_seams(ex, spec)
    assert practice.check(ex) == {"repaired": True, "problems": []}


def test_hidden_choice_is_seeded_and_filtered():
    from harness.practice import choose_fault, difficulty

    assert choose_fault(7, None, "mask", None) == choose_fault(7, None, "mask", None)
    # the seed picks among every match: other seeds reach other faults, always of the asked subsystem/level
    masks = {choose_fault(seed, None, "mask", None) for seed in range(20)}
    assert len(masks) > 1 and {all_faults()[f].subsystem for f in masks} == {"mask"}
    hard = {choose_fault(seed, None, None, "hard") for seed in range(20)}
    assert len(hard) > 1 and {difficulty(all_faults()[f]) for f in hard} == {"hard"}
    with pytest.raises(ValueError, match="no fault matches"):
        choose_fault(0, None, "no-such-subsystem", None)
    with pytest.raises(ValueError, match="difficulty must be one of"):
        choose_fault(0, None, None, "impossible")


def test_an_intermittent_crash_is_harder_than_an_immediate_nan():
    from harness.practice import DIFFICULTIES, difficulty

    faults = all_faults()
    rank = DIFFICULTIES.index
    assert rank(difficulty(faults["mask_dtype_unpadded"])) > rank(difficulty(faults["fp16_mask_constant"]))
