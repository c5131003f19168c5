"""The detector-facing command line: `run --detectors`, `bench --json`, `detectors`."""

import json

from faultbench.harness.cli import main
from faultbench.targets.ref.recipes import RECIPES


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_run_with_detectors_shows_ranked_findings(capsys):
    assert main(["run", "--fault", "label_permute", "--detectors", "suite", "--json"]) == 0
    report = _last_json(capsys)
    assert report["case"]["recipe"] == "fp32"
    assert report["findings"][0]["subsystem"] == "loss"
    assert report["findings"][0]["seam"] == "model.train.forward_loss"


def test_unknown_detector_is_a_clear_error(capsys):
    assert main(["run", "--fault", "label_permute", "--detectors", "loss_contrakt"]) == 2
    assert "did you mean 'loss_contract'" in capsys.readouterr().err


def test_bench_json_prints_the_summary_last(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("faultbench.harness.bench.recipes_of", lambda target: {"fp32": RECIPES["fp32"]})
    monkeypatch.setattr("faultbench.harness.bench.CACHE", tmp_path / "cache")
    assert main(["bench", "--quick", "--fault", "label_permute", "--detectors", "loss_contract",
                 "forward_loss_contract", "--json", "--out", str(tmp_path)]) == 0
    summary = _last_json(capsys)
    suite = summary["targets"]["ref"]["suite"]
    assert suite["detection_rate"] == 1.0 and suite["false_positive_rate"] == 0.0 and suite["top1_seam"] == 1.0
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_detectors_lists_the_registry(capsys):
    assert main(["detectors", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {"loss_contract", "crash_triage"} <= {d["id"] for d in listed}
