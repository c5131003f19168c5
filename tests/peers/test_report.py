"""results/peers.md from bench.csv files: scores per tool, per-fault cells, and where a peer beats the suite."""

import json

from faultbench.harness.report import TIMING_COLUMNS, write_csv
from faultbench.peers.report import TOOLS, beats, per_fault, render, tool_scores


def _row(detector, fault, seed, detected, sub=False, seam=False, latency=None, train_s=1.0, step_s=0.0, error=""):
    case = f"{fault or 'clean'}/fp32/s{seed}"
    return {"case": case, "fault": fault, "recipe": "fp32", "seed": seed, "detector": detector, "detected": detected,
            "findings": int(detected), "first_step": latency, "latency": latency, "top1_subsystem": sub,
            "top3_subsystem": sub, "rr_subsystem": float(sub), "top1_seam": seam, "top3_seam": seam,
            "rr_seam": float(seam), "crash": "", "hang": False, "train_s": train_s, "loop_s": train_s - step_s,
            "step_s": step_s, "other_s": 0.0, "error": error}


def test_a_peer_that_finds_what_the_suite_misses_is_credited(tmp_path):
    suite = [_row("suite", "a", s, True, True, True, 0, 1.1, 0.1) for s in (0, 1)]
    suite += [_row("suite", "b", s, False) for s in (0, 1)] + [_row("suite", "", 0, False, train_s=1.1, step_s=0.1)]
    write_csv(tmp_path / "bench.csv", suite)
    peer = [_row("torcheck", "b", 0, True, True, False, 0), _row("torcheck", "b", 1, False),
            _row("torcheck", "a", 0, False), _row("torcheck", "", 0, True)]
    write_csv(tmp_path / "peers" / "torcheck" / "bench.csv", peer)
    (tmp_path / "peers" / "torcheck" / "overhead.json").write_text(json.dumps({"median_ratio": 1.5}))

    torcheck = next(t for t in TOOLS if t.id == "torcheck")
    s = tool_scores(tmp_path, torcheck, peer)
    assert (s["detection_rate"], s["false_positive_rate"], s["top1_subsystem"]) == (1 / 3, 1.0, 1 / 3)
    assert s["overhead_ratio"] == 1.5  # its side-by-side measurement, not times from another run
    won = beats(per_fault(peer), per_fault(suite))
    assert won == ["`b`: detected on 1/2 seeds vs our 0/2; right subsystem first on 1/2 seeds vs our 0/2"]

    text = render(tmp_path)
    assert "| torcheck 1.0.1 | 3 | 1 | 0.333 | 1 | 0.333 | 0 | 0 | 1.50 |" in text
    assert "| `b` | 0/0/0 | 1/1/0 |" in text and "Faults no tool catches" in text
    assert "TrainCheck 0.2.0 (`peers/traincheck/bench.csv` is missing)" in text


def test_anomaly_mode_is_charged_against_the_same_cases_of_its_own_bench(tmp_path):
    # its bench runs each case twice: with crash_triage only (no step hooks) and in anomaly mode
    plain = [_row("crash_triage", "a", s, False, train_s=1.0) for s in (0, 1)]
    anomaly = [_row("detect_anomaly", "a", 0, False, train_s=3.0), _row("detect_anomaly", "a", 1, False, train_s=2.0)]
    write_csv(tmp_path / "peers" / "detect_anomaly" / "bench.csv", plain + anomaly)
    write_csv(tmp_path / "peers" / "detect_anomaly" / "timings.csv", plain + anomaly, TIMING_COLUMNS)
    write_csv(tmp_path / "bench.csv", [_row("suite", "a", s, True, train_s=9.0) for s in (0, 1)])  # another run

    tool = next(t for t in TOOLS if t.id == "detect_anomaly")
    assert tool_scores(tmp_path, tool, anomaly)["overhead_ratio"] == 2.5  # median of 3.0 and 2.0 over 1.0
