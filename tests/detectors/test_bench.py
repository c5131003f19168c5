"""The bench's machinery: isolation (a hanging case, a raising detector), caching, atomic results, determinism."""

import json
import sys
from pathlib import Path

import pytest

from detectors.api import DETECTORS, resolve_ids
from faults.registry import FAULTS, all_faults
from harness.bench import BenchConfig, build_matrix, run_bench
from harness.case import RECIPES, Case, recipe_for, run_case

PLUGIN = str(Path(__file__).with_name("bench_plugin.py"))
TEST_DETECTORS = ("test_raises_on_start", "test_reports_every_run")


@pytest.fixture
def plugin_bench(tmp_path, monkeypatch):
    """A bench of the plugin's hanging fault plus one clean case, with the plugin's detectors only."""
    monkeypatch.setattr("harness.bench.CACHE", tmp_path / "cache")
    cfg = BenchConfig(seeds=(0,), detectors=TEST_DETECTORS, plugins=(PLUGIN,), only_plugin_faults=True,
                      out=tmp_path / "results", timeout_s=15, progress=False)
    yield cfg
    for name in TEST_DETECTORS:  # keep the registries as other tests expect them
        DETECTORS.pop(name, None)
    FAULTS.pop("test_collate_hangs", None)
    sys.modules.pop("faultbench_plugin_bench_plugin", None)  # so the next test loads (registers) it again


def test_a_hanging_case_and_a_raising_detector_are_recorded_not_fatal(plugin_bench, monkeypatch):
    monkeypatch.setattr("harness.bench.RECIPES", {"fp32": RECIPES["fp32"]})  # one clean recipe is enough
    summary = run_bench(plugin_bench)
    rows = {(r["fault"], r["detector"]): r for r in _csv(plugin_bench.out / "bench.csv")}
    hang = rows[("test_collate_hangs", "test_reports_every_run")]
    assert hang["hang"] == "True" and hang["crash"] == "Hang"
    clean = rows[("", "test_raises_on_start")]
    assert "detector bug" in clean["error"]
    assert rows[("", "test_reports_every_run")]["detected"] == "True"  # the other detector still ran
    assert summary["hung_cases"] == 1
    assert summary["detectors"]["test_reports_every_run"]["false_positive_rate"] == 1.0
    for name in ("bench.csv", "summary.json", "leaderboard.md", "heatmap.png"):
        assert (plugin_bench.out / name).stat().st_size > 0
    assert not list(plugin_bench.out.glob("*.tmp*"))  # atomic writes leave no temporaries


def test_finished_cases_are_cached_and_reused(plugin_bench, monkeypatch):
    monkeypatch.setattr("harness.bench.RECIPES", {"fp32": RECIPES["fp32"]})
    plugin_bench.faults = ()  # the clean case only
    first = run_bench(plugin_bench)
    cached = list((plugin_bench.out.parent / "cache").glob("*.json"))
    assert len(cached) == 1
    cached[0].write_text(cached[0].read_text().replace('"val_loss": ', '"val_loss": 123.0, "was_val_loss": '))
    run_bench(plugin_bench)  # must read the (doctored) cache entry instead of re-running
    assert json.loads(cached[0].read_text())["val_loss"] == 123.0
    assert first["cases"] == 1


def test_the_matrix_has_every_fault_per_seed_and_the_clean_matrix():
    cases, faults = build_matrix(BenchConfig(seeds=(0, 1), detectors=("suite",)))
    faulty = [c for c in cases if c.faults]
    assert len(faulty) == 2 * len(faults)
    assert {c.recipe for c in cases if not c.faults} == set(RECIPES)
    # each fault runs in the recipe its manifest points to, which the clean matrix also covers
    specs = all_faults()
    assert all(c.recipe == recipe_for(specs[c.faults[0]].manifest) for c in faulty)


def test_the_same_case_gives_the_same_findings():
    case = Case("left_pad", 0, ("padding_mask_dropped",), tuple(resolve_ids(["suite"])))
    a, b = run_case(case), run_case(case)
    strip = lambda r: [{k: v for k, v in f.items() if k != "evidence"} for f in r["findings"]]  # noqa: E731
    assert strip(a) == strip(b) and a["history"] and [h["loss"] for h in a["history"]] == [
        h["loss"] for h in b["history"]]


def _csv(path):
    import csv

    with open(path) as f:
        return list(csv.DictReader(f))
