"""The spliced copy of model/: no trace of the machinery, tracebacks that name the seam, undone injection."""

import re
from pathlib import Path

import pytest

from faults.inject import injected, render_tree
from faults.registry import all_faults
from harness.scenario import run_scenario

ROOT = Path(__file__).resolve().parents[2]
FAULTS = all_faults()
# That the spliced copy runs exactly as the injected reference is asserted for every fault by
# tests/test_practice.py::test_exercise_round_trip (the copy is an exercise there).


@pytest.mark.parametrize("fault_id", sorted(FAULTS))
def test_spliced_tree_has_no_trace_of_the_machinery(tmp_path, fault_id):
    tree = render_tree(tmp_path / "copy", [fault_id])
    for path in (tree / "model").rglob("*.py"):
        text = path.read_text()
        assert fault_id not in text
        assert not re.search(r"\bfaults?\b|inject", text, re.IGNORECASE), path


def test_traceback_names_the_seam_not_the_fault_module():
    crashing = [f for f, spec in FAULTS.items()
                if spec.manifest.check.startswith("crash") and not spec.manifest.scenario.startswith("ddp")]
    assert crashing, "no crash fault registered"
    for fault_id in crashing:
        m = FAULTS[fault_id].manifest
        out = run_scenario(m.scenario, m.variant, m.steps, m.seeds[0], (fault_id,))
        assert out.crash, fault_id
        assert "faults/" not in out.crash["traceback"] and 'File "' + str(ROOT / "model") in out.crash["traceback"]


def test_injection_is_undone_on_exit():
    import model.loss

    before = model.loss.lm_loss.__code__
    with injected(*sorted(FAULTS)[:1]):
        pass
    assert model.loss.lm_loss.__code__ is before
    fid = next(f for f, s in FAULTS.items() if "model.loss.lm_loss" in s.seams)
    with injected(fid):
        assert model.loss.lm_loss.__code__ is not before
        assert model.loss.lm_loss.__code__.co_filename == model.loss.__file__
    assert model.loss.lm_loss.__code__ is before


def test_several_faults_compose_and_two_on_one_seam_are_refused():
    import model.attention
    import model.loss
    from faults.registry import FaultError

    loss_fault = "label_shift_off_by_one"
    mask_fault = next(f for f, s in FAULTS.items() if s.seams == ("model.attention.build_attention_mask",))
    before = (model.loss.lm_loss.__code__, model.attention.build_attention_mask.__code__)
    with injected(loss_fault, mask_fault):
        after = (model.loss.lm_loss.__code__, model.attention.build_attention_mask.__code__)
        assert all(a is not b for a, b in zip(after, before, strict=True))
    assert (model.loss.lm_loss.__code__, model.attention.build_attention_mask.__code__) == before
    twins = [f for f, s in FAULTS.items() if "model.loss.lm_loss" in s.seams][:2]
    with pytest.raises(FaultError, match="both replace model.loss.lm_loss"):
        with injected(*twins):
            pass
