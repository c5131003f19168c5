"""The SageMaker Debugger peer: the re-implemented rule definitions on handcrafted arrays, rule firings ->
findings (no smdebug needed), and one faulty and one clean case end to end where smdebug is installed
(.venv-smdebug)."""

import numpy as np
import pytest
from torch import nn

from faultbench.peers.smdebug_peer import (
    Firing,
    SageMakerDebugger,
    all_zero,
    exploding,
    findings_for,
    loss_not_decreasing,
    param_name,
    ratio_out_of_range,
    unchanged,
    update_ratio,
    vanishing,
)
from tests.peers.helpers import run_with_peer


def test_the_detector_is_an_exclusive_baseline():
    assert SageMakerDebugger.id == "smdebug" and SageMakerDebugger.baseline and SageMakerDebugger.exclusive
    assert SageMakerDebugger.family == "baseline" and SageMakerDebugger.description


def test_vanishing_gradient_is_a_mean_absolute_value_below_1e_7():
    grads = {"g1": np.full(4, 1e-8), "g2": np.array([1e-3, -1e-3]), "g3": np.zeros(3)}
    assert vanishing(grads) == ["g1", "g3"]


def test_exploding_tensor_finds_nan_and_inf_unless_only_nan():
    tensors = {"a": np.array([1.0, np.nan]), "b": np.array([np.inf]), "c": np.ones(2)}
    assert exploding(tensors) == ["a", "b"]
    assert exploding(tensors, only_nan=True) == ["a"]


def test_all_zero_needs_every_value_zero_by_default():
    assert all_zero({"z": np.zeros(5), "almost": np.array([0.0, 0.0, 1.0]), "empty": np.zeros(0)}) == ["z"]
    assert all_zero({"almost": np.array([0.0, 0.0, 1.0])}, percent=60.0) == ["almost"]


def test_unchanged_tensor_is_allclose_over_the_steps():
    w = np.linspace(0.1, 1.0, 10)
    assert unchanged([w, w.copy(), w + 1e-9])
    assert not unchanged([w, w, w + 1e-3])
    assert not unchanged([w])  # one step is no history
    assert not unchanged([np.array([np.nan]), np.array([np.nan])])  # equal_nan=False


def test_weight_update_ratio_is_out_of_range_when_tiny_huge_or_nan():
    w = np.full(8, 0.02)
    assert not ratio_out_of_range(update_ratio(w, w + 1e-4))
    assert ratio_out_of_range(update_ratio(w, w))  # no update: 0 < 1e-8
    assert ratio_out_of_range(update_ratio(w, w + 1.0))  # 50 > 10
    assert ratio_out_of_range(update_ratio(w, w + np.nan))


def test_loss_not_decreasing_compares_every_num_steps():
    decreasing = [(s, 5.0 - 0.1 * s) for s in range(25)]
    assert loss_not_decreasing(decreasing) == []
    flat = [(s, 5.0) for s in range(25)]
    assert loss_not_decreasing(flat) == [10, 20]
    # saved every 3 steps: checked at 12 (vs 0) and 24 (vs 12), as in the guide's example
    sparse = [(s, 5.0) for s in range(0, 25, 3)]
    assert loss_not_decreasing(sparse) == [12, 24]
    assert loss_not_decreasing([(0, 5.0), (10, 4.9)], diff_percent=10.0) == [10]


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(8, 4)
        self.attn = Attn()


SEAMS = {f"{__name__}.Attn.forward": "model", f"{__name__}.Net.forward": "model"}
NET = Net()


def _step_of(smdebug_step: int) -> int:
    return smdebug_step // 4


def test_param_names_come_from_smdebugs_tensor_names():
    assert param_name("gradient/Net_attn.qkv.weight", "Net") == "attn.qkv.weight"
    assert param_name("Net_wte.weight", "Net") == "wte.weight"
    assert param_name("lm_loss_output_0", "Net") is None


def test_each_rule_maps_to_its_subsystem_then_its_alternative_at_its_first_step():
    firing = Firing("UnchangedTensor", (8, 12), ("Net_wte.weight", "Net_attn.qkv.weight"))
    first, second = findings_for([firing], "fp32", NET, SEAMS, _step_of)
    assert (first["subsystem"], first["seam"], first["step"]) == ("optimizer", None, 2)
    assert (second["subsystem"], second["seam"]) == ("model", None)
    assert second["confidence"] < first["confidence"]
    (ratio,) = findings_for([Firing("WeightUpdateRatio", (4,), ("Net_wte.weight",))], "fp32", NET, SEAMS, _step_of)
    assert (ratio["subsystem"], ratio["step"]) == ("optimizer", 1)


def test_exploding_tensors_are_precision_under_amp():
    firing = Firing("ExplodingTensor", (0,), ("lm_loss_output_0",))
    assert [f["subsystem"] for f in findings_for([firing], "fp16", NET, SEAMS, _step_of)] == ["precision", "model"]
    assert [f["subsystem"] for f in findings_for([firing], "fp32", NET, SEAMS, _step_of)] == ["model", "optimizer"]


def test_only_one_modules_tensors_name_a_seam():
    one = Firing("VanishingGradient", (0,), ("gradient/Net_attn.qkv.weight", "gradient/Net_attn.qkv.bias"))
    assert findings_for([one], "fp32", NET, SEAMS, _step_of)[0]["seam"] == f"{__name__}.Attn.forward"
    spread = Firing("VanishingGradient", (0,), ("gradient/Net_attn.qkv.weight", "gradient/Net_wte.weight"))
    assert findings_for([spread], "fp32", NET, SEAMS, _step_of)[0]["seam"] is None
    gradients = Firing("AllZero", (0,), ("gradient/Net_attn.qkv.weight",))
    assert findings_for([gradients], "fp32", NET, SEAMS, _step_of)[0]["subsystem"] == "loss"
    weights = Firing("AllZero", (0,), ("Net_attn.qkv.weight",))
    assert findings_for([weights], "fp32", NET, SEAMS, _step_of)[0]["subsystem"] == "model"


def test_smdebug_steps_map_to_the_optimizer_step_of_their_window():
    det = SageMakerDebugger()
    det._starts = [(0, 0), (4, 1), (8, 2)]  # 4 micro-batches per optimizer step
    assert [det.step_of(s) for s in (0, 3, 4, 9, 100)] == [0, 0, 1, 2, 2]
    assert det.step_of(-1) is None


def test_end_to_end_a_step_that_changes_nothing_is_found_and_a_clean_run_is_silent():
    pytest.importorskip("smdebug")
    faulty = run_with_peer("smdebug", ("zero_grad_between_backward_and_step",))
    assert not faulty["detector_errors"]
    assert faulty["findings"] and faulty["findings"][0]["subsystem"] == "optimizer"
    assert {f["evidence"]["rule"] for f in faulty["findings"]} >= {"WeightUpdateRatio", "UnchangedTensor"}
    clean = run_with_peer("smdebug", ())
    assert clean["crash"] is None and not clean["detector_errors"] and clean["findings"] == []
