"""The TrainCheck peer: its violations -> findings mapping on handcrafted ``failed.log`` output (no TrainCheck
needed), and one faulty and one clean case end to end where TrainCheck is installed (.venv-peers)."""

import json
from pathlib import Path

import pytest

from faultbench.model.seams import SEAMS, SUBSYSTEMS
from faultbench.peers.traincheck_peer import (
    API_SUBSYSTEMS,
    api_subsystem,
    findings_for,
    frame_seam,
    parse_failed_log,
    trace_step,
    violation_finding,
)

ROOT = Path(__file__).resolve().parents[2]
SITE = "/venv/lib/python3.11/site-packages"


def _frame(path: str, line: int, func: str) -> str:
    return f'  File "{path}", line {line}, in {func}\n    ...\n'


def _violation(text: str, apis: list[str], event: dict) -> dict:
    """A violation as traincheck-check writes it to failed.log (the fields the mapping reads)."""
    return {"invariant": {"text_description": text, "relation": "APIContainRelation",
                          "params": [{"param_type": "APIParam", "api_full_name": a} for a in apis]},
            "check_passed": False, "triggered": True, "trace": [event]}


SCHEDULER = _violation(
    "LRScheduler.step() always calls lr_scheduler._update_param_group_val()",
    ["torch.optim.lr_scheduler.LRScheduler.step", "torch.optim.lr_scheduler._update_param_group_val"],
    {"meta_vars.step": 3, "meta_vars.stage": "training", "function": "torch.optim.lr_scheduler.LRScheduler.step",
     "stack_trace": [_frame(f"{ROOT}/peers/_traincheck_traincheck_case.py", 54, "train_one_step"),
                     _frame(f"{ROOT}/model/train.py", 98, "train_step"),
                     _frame(f"{ROOT}/model/train.py", 78, "optimizer_step"),
                     _frame(f"{SITE}/traincheck/instrumentor/tracer.py", 475, "wrapped")]})
# no --API-dump-stack-trace: pandas writes NaN for the missing stack
SCALER = _violation("GradScaler.step() always calls Optimizer.step()",
                    ["torch.amp.grad_scaler.GradScaler.step", "torch.optim.optimizer.Optimizer.step"],
                    {"meta_vars.step": 0, "meta_vars.stage": "init",
                     "function": "torch.amp.grad_scaler.GradScaler.step", "stack_trace": float("nan")})


def test_failed_log_is_a_sequence_of_json_objects():
    text = json.dumps(SCHEDULER, indent=4) + "\n" + json.dumps({**SCALER, "trace": []}, indent=4) + "\n"
    assert [v["invariant"]["text_description"] for v in parse_failed_log(text)] == [
        SCHEDULER["invariant"]["text_description"], SCALER["invariant"]["text_description"]]
    assert parse_failed_log("") == []


def test_a_stack_frame_in_the_reference_names_the_innermost_seam():
    f = violation_finding(SCHEDULER, SEAMS, ROOT)
    assert (f["seam"], f["subsystem"], f["confidence"]) == ("model.train.optimizer_step", "optimizer", 0.6)
    assert f["evidence"]["frame"] == "model/train.py:78 in optimizer_step"
    assert f["step"] == 2  # the third training iteration of TrainCheck's 1-based count
    assert f["detector"] == "traincheck" and "LRScheduler.step()" in f["message"]


def test_without_a_stack_the_api_names_the_subsystem():
    f = violation_finding(SCALER, SEAMS, ROOT)
    assert (f["seam"], f["subsystem"], f["confidence"], f["step"]) == (None, "precision", 0.4, 0)


def test_a_method_frame_is_told_apart_by_its_line():
    import inspect

    from faultbench.model.gpt import GPT, Block

    for cls, seam in ((Block, "model.gpt.Block.forward"), (GPT, "model.gpt.GPT.forward")):
        _, first = inspect.getsourcelines(cls.forward)
        assert frame_seam(f"{ROOT}/model/gpt.py", first + 2, "forward", SEAMS, ROOT) == seam
    assert frame_seam(f"{ROOT}/model/run.py", 70, "build_run", SEAMS, ROOT) is None  # not a seam
    assert frame_seam(f"{SITE}/torch/optim/adam.py", 10, "step", SEAMS, ROOT) is None


def test_api_table_longest_prefix_and_default():
    assert api_subsystem("torch.nn.functional.scaled_dot_product_attention") == "model"
    assert api_subsystem("torch.nn.functional.cross_entropy") == "loss"
    assert api_subsystem("torch.nn.utils.clip_grad.clip_grad_norm_") == "optimizer"
    assert api_subsystem("torch.amp.autocast_mode.autocast.__enter__") == "precision"
    assert api_subsystem("torch.optimizer_like_name") == "model"  # a prefix matches whole name parts only
    assert api_subsystem(None) == "model"
    assert set(API_SUBSYSTEMS.values()) <= set(SUBSYSTEMS)


def test_trace_steps():
    assert trace_step({"meta_vars.step": 1, "meta_vars.stage": "training"}) == 0
    assert trace_step({"meta_vars.step": 16, "meta_vars.stage": "testing"}) == 16
    assert trace_step({"meta_vars.step": float("nan")}) is None
    assert trace_step({}) is None


def test_findings_are_ranked_and_see_only_the_tool_output():
    found = findings_for([SCALER, SCHEDULER], SEAMS, ROOT)
    assert [f["confidence"] for f in found] == [0.6, 0.4]
    assert all(set(f) == {"detector", "step", "subsystem", "seam", "message", "evidence", "confidence"} for f in found)


def test_end_to_end_one_fault_and_one_clean_case(tmp_path):
    """Real TrainCheck (slow: the fp32 invariants take ~4 minutes the first time, then they are cached)."""
    pytest.importorskip("traincheck")
    from faultbench.harness.score import case_rows
    from faultbench.peers.traincheck_peer import build_cases, run_matrix, write_results

    cases, faults = build_cases((0,), ["huge_lr"])
    cases = [c for c in cases if c.recipe == "fp32"]  # the fault's case and the clean fp32 case
    records = run_matrix(cases, jobs=2, use_cache=False, progress=lambda line: None)
    faulty, clean = records
    assert not faulty["detector_errors"] and not clean["detector_errors"]
    assert len(faulty["history"]) == len(clean["history"]) == 16 and faulty["train_s"] > 0
    assert faulty["findings"], "TrainCheck flags the LR schedule of huge_lr"
    assert {f["subsystem"] for f in faulty["findings"]} <= set(SUBSYSTEMS)
    rows = case_rows(faulty, faults, suite_ids=[])
    assert rows[0]["detector"] == "traincheck" and rows[0]["detected"]
    summary = write_results(records, faults, tmp_path, (0,), wall_s=1.0)
    assert (tmp_path / "bench.csv").read_text().count("\n") == 3
    assert summary["detectors"]["traincheck"]["fault_cases"] == 1
