"""Practice mode: the interviewer's rubric."""

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
