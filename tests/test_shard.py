"""Many machines: ``bench --shard K/N`` + ``merge`` give the results of one bench byte for byte, the cut is balanced
by measured cost, and merge refuses in one line what is not one whole bench."""

from __future__ import annotations

import dataclasses
import json
import warnings
from types import SimpleNamespace

import pytest

from faultbench import targets
from faultbench.harness.cli import main
from faultbench.harness.costs import estimate, partition
from faultbench.harness.record import Case
from faultbench.targets.ref.recipes import RECIPES
from tests.test_bad_input_cli import _one_line_error

CLOCK = {"timings.csv", "timings.json", "costs.json"}  # the clock's readings; every other result file is a score
# two faults of the fp32 recipe and the clean fp32 case, two seeds: 6 cases
def _bench(seeds: int = 2) -> list[str]:
    return ["bench", "--target", "ref", "--fault", "label_permute", "--fault", "loss_history_keeps_graph", "--seeds",
            str(seeds), "--detectors", "forward_loss_contract"]


BENCH = _bench()


WARNING = "a warning from inside the case's run"


@pytest.fixture
def small(tmp_path, monkeypatch):
    """The bench's clean matrix cut to its fp32 recipe, a cache of the test's own; every run warns once."""
    monkeypatch.setattr("faultbench.harness.bench.recipes_of", lambda target: {"fp32": RECIPES["fp32"]})
    monkeypatch.setattr("faultbench.harness.bench.CACHE", tmp_path / "cache")
    stack = targets.get("ref")

    def run_case(*args, **kwargs):
        warnings.warn(WARNING, UserWarning, stacklevel=1)
        return stack.run_case(*args, **kwargs)

    warned = dataclasses.replace(stack, run_case=run_case)
    monkeypatch.setattr("faultbench.harness.case.targets", SimpleNamespace(get=lambda name: warned))
    return tmp_path


def _refused(capture, argv, expect):
    capture.readouterr()  # what earlier commands printed
    return _one_line_error(capture, argv, expect)


def test_three_shards_merged_equal_one_bench_byte_for_byte(small, capfd):
    whole, merged = small / "whole", small / "merged"
    assert main([*BENCH, "--out", str(whole), "--junit", str(small / "whole.xml")]) == 0
    assert WARNING not in capfd.readouterr().err  # a case's warning...
    costs = json.loads((whole / "costs.json").read_text())
    assert len(costs) == 6 and all(v > 0 for v in costs.values())  # measured, per case

    shards = [small / f"shard{k}" for k in (1, 2, 3)]
    for k, out in enumerate(shards, 1):
        assert main([*BENCH, "--shard", f"{k}/3", "--costs", str(whole / "costs.json"), "--out", str(out),
                     "--json"]) == 0
        assert json.loads(capfd.readouterr().out.splitlines()[-1])["cached_cases"] >= 1  # the cache serves shards
    docs = [json.loads((out / "shard.json").read_text()) for out in shards]
    held = [{r["name"] for r in d["records"]} for d in docs]
    assert all(held) and sum(map(len, held)) == 6 and set().union(*held) == set(costs)  # each case once
    assert all(r["warnings"] == [f"UserWarning: {WARNING}"] for d in docs for r in d["records"])  # ...is its record's

    assert main(["merge", *map(str, reversed(shards)), "--out", str(merged), "--junit", str(small / "merged.xml")]) == 0
    for xml in ("whole.xml", "merged.xml"):  # the CI gate's file, from a bench and from a merge alike
        assert "faultbench.bench.ref.goals" in (small / xml).read_text()
    scores = sorted({p.name for p in whole.iterdir()} - CLOCK)
    assert {"bench.csv", "summary.json", "leaderboard.md"} <= set(scores)
    assert sorted(p.name for p in merged.iterdir()) == sorted(p.name for p in whole.iterdir())
    for name in scores:
        assert (merged / name).read_bytes() == (whole / name).read_bytes(), name
    summary = json.loads((merged / "summary.json").read_text())["targets"]["ref"]
    assert summary["cases"] == 6 and summary["per_fault"]  # manifested marks across shards: scored as shown
    assert json.loads((merged / "timings.json").read_text())["cached_cases"] == 6

    before = {name: (merged / name).read_bytes() for name in scores}
    for given, expect in ((shards[:2], f"{len(held[2])} of 6 cases have no record"), (shards[:2], "shard 3/3 missing"),
                          ([shards[0], shards[1], shards[0], shards[2]], "shard 1/3 given twice"),
                          ([small / "nowhere", *shards], "no shard.json")):
        _refused(capfd, ["merge", *map(str, given), "--out", str(merged)], expect)
    other = small / "other"  # one seed: another configuration
    assert main([*_bench(seeds=1), "--shard", "3/3", "--out", str(other)]) == 0
    _refused(capfd, ["merge", *map(str, shards[:2]), str(other), "--out", str(merged)],
                    "are shards of different configurations")
    (other / "shard.json").write_text('{"format": 1, "records": "garbage"}')
    _refused(capfd, ["merge", *map(str, shards), str(other), "--out", str(merged)], "not a shard file")
    assert {name: (merged / name).read_bytes() for name in scores} == before  # nothing overwritten


def test_flags_of_a_shard_are_refused_in_one_line(small, capsys):
    for value in ("0/3", "4/3", "3", "a/b", "1/1001"):
        _refused(capsys, [*BENCH, "--shard", value], "--shard: expected K/N with 1 <= K <= N <= 1000")
    _refused(capsys, [*BENCH, "--costs", "x.json"], "--costs applies only with --shard")
    (small / "notes").mkdir()
    (small / "notes" / "mine.txt").write_text("mine")
    _refused(capsys, [*BENCH, "--shard", "1/2", "--out", str(small / "notes")], "holds files of something else")
    _refused(capsys, ["merge", str(small / "notes"), "--out", str(small / "notes")],
                    "holds files of something else")


def _cases(n_seeds: int) -> list[Case]:
    return [Case(recipe, seed) for seed in range(n_seeds) for recipe in ("fp32", "ddp", "fp16", "combined")]


def test_the_cut_balances_measured_cost_and_is_deterministic_without_a_table():
    cases = _cases(3)
    table = {c.name: 10.0 if c.recipe == "combined" else 1.0 for c in cases}
    owner = partition(cases, 3, table)
    loads = [sum(table[c.name] for c, s in zip(cases, owner, strict=True) if s == k) for k in range(3)]
    assert loads == [13.0, 13.0, 13.0]  # each shard gets one costly case and the cheap ones spread
    assert partition(cases, 3, table) == owner
    # no table: the recipe's steps x ranks; a partial one: the mean of the recipe's measured cases
    assert estimate(Case("ddp", 0), {}) == pytest.approx(2 * estimate(Case("fp32", 0), {}))
    assert estimate(Case("fp32", 7), {"clean/fp32/s0": 3.0, "x/fp32/s1": 5.0, "hf:clean/fp32/s0": 99.0}) == 4.0
    assert sorted(set(partition(cases, 3, {}))) == [0, 1, 2]
