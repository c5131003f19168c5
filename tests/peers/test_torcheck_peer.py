"""The torcheck peer: torcheck's messages -> findings on handcrafted outputs (no torcheck needed), and one
faulty and one clean case end to end where torcheck is installed (.venv-peers). Its honesty (imports, no way
around the rule) is tested with our detectors' in tests/detectors/test_honesty.py."""

import pytest
from torch import nn

from faultbench.peers.torcheck_peer import (
    MAPPING,
    Issue,
    Torcheck,
    findings_for,
    module_seam,
    parse_issues,
    shared_seam,
)
from tests.peers.helpers import run_with_peer


def test_the_detector_is_an_exclusive_baseline():
    assert Torcheck.id == "torcheck" and Torcheck.baseline and Torcheck.exclusive and Torcheck.family == "baseline"
    assert Torcheck.description


# a stand-in model: module classes defined here, with a seam table naming two of their forwards
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.proj = nn.Linear(4, 4)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.ln = nn.LayerNorm(4)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([Block()])


SEAMS = {f"{__name__}.Attn.forward": "model", f"{__name__}.Net.forward": "model"}
NET = Net()
PARAMS = [n for n, _ in NET.named_parameters()]


def _message(*items: str) -> str:
    return "RuntimeError: The following errors are detected while training:\n" + "\n".join(items)


def test_parse_issues_reads_every_kind_of_failed_check_once():
    text = _message("Module model's wte.weight should change. Module model's wte.weight contains NaN.",
                    "Module model's blocks.0.ln.bias contains inf.", "Module model's wte.weight should change.")
    text += "\nModule blocks.0.attn's output contains NaN.\nModule model's output shouldn't all > 0 and < 1"
    assert parse_issues(text) == [Issue("unchanged", "model", "wte.weight"),
                                  Issue("param_nonfinite", "model", "wte.weight"),
                                  Issue("param_nonfinite", "model", "blocks.0.ln.bias"),
                                  Issue("output_nonfinite", "blocks.0.attn", "output"),
                                  Issue("probabilities", "model", "output")]
    assert parse_issues("IndexError: index out of range in self") == []


def test_module_seams_are_the_innermost_seam_on_the_path():
    assert module_seam(NET, "blocks.0.attn.qkv", SEAMS) == f"{__name__}.Attn.forward"
    assert module_seam(NET, "blocks.0.ln", SEAMS) == f"{__name__}.Net.forward"  # no seam below the root
    assert module_seam(NET, "", SEAMS) == f"{__name__}.Net.forward"
    assert module_seam(NET, "wte", {}) is None
    attn = f"{__name__}.Attn.forward"
    assert shared_seam(NET, ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.bias"], SEAMS) == attn
    assert shared_seam(NET, ["blocks.0.attn.qkv.weight", "wte.weight"], SEAMS) is None  # two owners
    assert shared_seam(NET, ["wte.weight"], SEAMS) is None  # the root is no localization


def test_no_parameter_changing_points_at_the_optimizer_without_a_seam():
    issues = [Issue("unchanged", "model", n) for n in PARAMS]
    (finding,) = findings_for(issues, len(PARAMS), "fp32", NET, SEAMS)
    assert (finding["subsystem"], finding["seam"]) == ("optimizer", None)
    assert finding["confidence"] == MAPPING["unchanged_all"][2]


def test_some_parameters_not_changing_point_at_their_module_then_the_optimizer():
    issues = [Issue("unchanged", "model", f"blocks.0.attn.qkv.{p}") for p in ("weight", "bias")]
    first, second = findings_for(issues, len(PARAMS), "fp32", NET, SEAMS)
    assert (first["subsystem"], first["seam"]) == ("model", f"{__name__}.Attn.forward")
    assert (second["subsystem"], second["seam"]) == ("optimizer", None)
    assert second["confidence"] < first["confidence"]


def test_a_nonfinite_output_is_precision_under_amp_and_names_the_module():
    issues = [Issue("output_nonfinite", "blocks.0.attn", "output")]
    (amp,) = findings_for(issues, len(PARAMS), "fp16", NET, SEAMS)
    (fp32,) = findings_for(issues, len(PARAMS), "fp32", NET, SEAMS)
    assert (amp["subsystem"], amp["seam"]) == ("precision", f"{__name__}.Attn.forward")
    assert (fp32["subsystem"], fp32["seam"]) == ("model", f"{__name__}.Attn.forward")


def test_probabilities_point_at_the_models_forward_then_the_loss():
    first, second = findings_for([Issue("probabilities", "model", "output")], len(PARAMS), "fp32", NET, SEAMS)
    assert (first["subsystem"], first["seam"]) == ("model", f"{__name__}.Net.forward")
    assert (second["subsystem"], second["seam"]) == ("loss", None)


def test_nonfinite_parameters_name_no_seam():
    issues = [Issue("param_nonfinite", "model", "wte.weight")]
    assert [(f["subsystem"], f["seam"]) for f in findings_for(issues, 3, "fp32", NET, SEAMS)] == [
        ("optimizer", None), ("model", None)]
    assert [f["subsystem"] for f in findings_for(issues, 3, "bf16", NET, SEAMS)][0] == "precision"


def test_end_to_end_a_step_that_changes_nothing_is_found_and_a_clean_run_is_silent():
    pytest.importorskip("torcheck")
    faulty = run_with_peer("torcheck", ("zero_grad_between_backward_and_step",))
    assert not faulty["detector_errors"]
    assert faulty["findings"] and faulty["findings"][0]["subsystem"] == "optimizer"
    assert faulty["findings"][0]["step"] == 0
    clean = run_with_peer("torcheck", ())
    assert clean["crash"] is None and not clean["detector_errors"] and clean["findings"] == []
