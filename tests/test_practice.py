"""Practice mode: the interviewer's rubric."""

from pathlib import Path

import pytest

from faults.registry import all_faults
from harness.cli import main
from harness.practice import rubric

SECTIONS = ("## 1. Reproduce", "## 2. Isolate by subsystem", "## 3. Instrument", "## 4. Fix", "## 5. Prevent")


@pytest.mark.parametrize("fault_id", sorted(all_faults()))
def test_rubric_covers_reproduce_isolate_instrument_fix_prevent(fault_id):
    spec = all_faults()[fault_id]
    text = rubric(fault_id)
    assert [s for s in SECTIONS if s in text] == list(SECTIONS)
    assert all(seam in text for seam in spec.seams) and spec.fix in text and spec.references[0] in text
    assert "Detectors that localize it first" in text  # the committed bench localized every fault
    assert "A regression test that fails with this bug in place" in text  # and a unit test kills each one


def test_rubric_without_results_still_has_the_answer(tmp_path):
    text = rubric("label_permute", results=tmp_path)
    assert "model.train.forward_loss" in text and "Detectors that localize" not in text


def test_rubric_cli_suggests_a_close_fault_id(capsys):
    assert main(["practice", "rubric", "--fault", "label_permut"]) == 2
    assert "did you mean 'label_permute'" in capsys.readouterr().err


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("fault_id", ["label_permute", "kv_cache_wrong_index"])
def test_exercise_round_trip(tmp_path, monkeypatch, fault_id):
    """new -> the symptom shows, nothing gives the fault away -> hints and grading -> splice the clean seam
    back -> check says repaired."""
    import re
    import shutil

    from harness import practice

    monkeypatch.setenv("FAULTBENCH_PRACTICE_KEYS", str(tmp_path / "keys"))
    spec = all_faults()[fault_id]
    ex = practice.new_exercise(tmp_path / "ex", fault=fault_id)
    readme = (ex / "README.md").read_text()
    assert "python train.py" in readme and (ex / "loss.png").stat().st_size > 0
    text = "\n".join(p.read_text(errors="ignore") for p in ex.rglob("*") if p.is_file() and p.suffix in (".py", ".md"))
    for secret in (fault_id, spec.title, r"\bfaults\b", r"\binjected?\b", "FAULTBENCH_"):
        assert not re.search(secret if secret.startswith("\\") else re.escape(secret), text), secret

    first = practice.hint(ex)
    assert "Hint 1" in first and "Hint 2" not in first
    assert spec.subsystem in practice.hint(ex) and spec.seams[0] in practice.hint(ex)
    assert practice.answer(ex, spec.subsystem, spec.seams[0]) == {"subsystem": "right", "seam": "right",
                                                                  "hints_used": 3}
    wrong = "eval" if spec.subsystem != "eval" else "loss"
    assert practice.answer(ex, wrong)["subsystem"] == "wrong"
    assert "What is wrong" in practice.reveal(ex) and spec.fix in practice.reveal(ex)

    broken = practice.check(ex)
    assert not broken["repaired"] and broken["problems"]
    module_file = spec.seams[0].split(".")[1] + ".py"  # model.<module>.<function>: restore the clean module
    shutil.copy(ROOT / "model" / module_file, ex / "model" / module_file)
    assert practice.check(ex) == {"repaired": True, "problems": []}


def test_hidden_choice_is_seeded_and_filtered():
    from harness.practice import choose_fault, difficulty

    assert choose_fault(7, None, "mask", None) == choose_fault(7, None, "mask", None)
    assert all_faults()[choose_fault(7, None, "mask", None)].subsystem == "mask"
    assert difficulty(all_faults()[choose_fault(1, None, None, "hard")]) == "hard"
    with pytest.raises(ValueError, match="no fault matches"):
        choose_fault(0, None, "no-such-subsystem", None)
    with pytest.raises(ValueError, match="difficulty must be one of"):
        choose_fault(0, None, None, "impossible")


def test_an_intermittent_crash_is_harder_than_an_immediate_nan():
    from harness.practice import DIFFICULTIES, difficulty

    faults = all_faults()
    rank = DIFFICULTIES.index
    assert rank(difficulty(faults["mask_dtype_unpadded"])) > rank(difficulty(faults["fp16_mask_constant"]))
