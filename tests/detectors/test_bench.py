"""The bench's machinery: isolation (a hanging case, a raising detector), caching, atomic results, determinism."""

import json
import sys
from pathlib import Path

import pytest

from faultbench import targets
from faultbench.detectors.api import DETECTORS, resolve_ids
from faultbench.faults.registry import FAULTS, Manifest, all_faults, plugin_module_name
from faultbench.harness.bench import BenchConfig, build_matrix, run_bench
from faultbench.harness.case import run_target_case
from faultbench.harness.matcher import MIN_SUBSYSTEMS, NotRunnable, recipe_for, unmet
from faultbench.harness.record import Case
from faultbench.targets.ref.recipes import RECIPES

ONE_RECIPE = {"fp32": RECIPES["fp32"]}  # a clean matrix of one recipe is enough for the machinery

PLUGIN = str(Path(__file__).with_name("bench_plugin.py"))
TEST_DETECTORS = ("test_raises_on_start", "test_reports_every_run")


@pytest.fixture
def plugin_bench(tmp_path, monkeypatch):
    """A bench of the plugin's hanging fault plus one clean case, with the plugin's detectors only."""
    monkeypatch.setattr("faultbench.harness.bench.CACHE", tmp_path / "cache")
    cfg = BenchConfig(seeds=(0,), targets=("ref",), detectors=TEST_DETECTORS, plugins=(PLUGIN,),
                      only_plugin_faults=True, out=tmp_path / "results", timeout_s=15, progress=False)
    yield cfg
    for name in TEST_DETECTORS:  # keep the registries as other tests expect them
        DETECTORS.pop(name, None)
    FAULTS.pop("test_collate_hangs", None)
    sys.modules.pop(plugin_module_name(PLUGIN), None)  # so the next test loads (registers) it again


def test_a_hanging_case_and_a_raising_detector_are_recorded_not_fatal(plugin_bench, monkeypatch):
    monkeypatch.setattr("faultbench.harness.bench.recipes_of", lambda target: ONE_RECIPE)
    summary = run_bench(plugin_bench)["targets"]["ref"]
    rows = {(r["fault"], r["detector"]): r for r in _csv(plugin_bench.out / "bench.csv")}
    hang = rows[("test_collate_hangs", "test_reports_every_run")]
    assert hang["hang"] == "True" and hang["crash"] == "Hang"
    clean = rows[("", "test_raises_on_start")]
    assert "detector bug" in clean["error"]
    assert rows[("", "test_reports_every_run")]["detected"] == "True"  # the other detector still ran
    assert summary["hung_cases"] == 1
    assert summary["detectors"]["test_reports_every_run"]["false_positive_rate"] == 1.0
    for name in ("bench.csv", "summary.json", "leaderboard.md", "summary.png", "index.html"):
        assert (plugin_bench.out / name).stat().st_size > 0
    assert not list(plugin_bench.out.glob("*.tmp*"))  # atomic writes leave no temporaries


def test_finished_cases_are_cached_and_reused(plugin_bench, monkeypatch):
    monkeypatch.setattr("faultbench.harness.bench.recipes_of", lambda target: ONE_RECIPE)
    plugin_bench.faults = ()  # the clean case only
    first = run_bench(plugin_bench)
    cached = list((plugin_bench.out.parent / "cache").glob("*.json"))
    assert len(cached) == 1
    cached[0].write_text(cached[0].read_text().replace('"val_loss": ', '"val_loss": 123.0, "was_val_loss": '))
    run_bench(plugin_bench)  # must read the (doctored) cache entry instead of re-running
    assert json.loads(cached[0].read_text())["val_loss"] == 123.0
    assert first["cases"] == 1


def test_the_matrix_has_every_fault_per_seed_and_the_clean_matrix_of_every_target():
    cases, faults = build_matrix(BenchConfig(seeds=(0, 1), detectors=("suite",)))
    specs = all_faults(None)
    runnable = {f for f, m in faults.items() if not m.get("not_runnable")}
    faulty = [c for c in cases if c.faults]
    assert {(c.faults[0], c.seed) for c in faulty} == {(f, s) for f in runnable for s in (0, 1)}
    assert set(faults) == set(specs) and {c.target for c in faulty} == {"ref", "hf"}
    for target in ("ref", "hf"):  # each target's clean matrix is every recipe of it
        assert {c.recipe for c in cases if not c.faults and c.target == target} == set(targets.get(target).recipes())
    # each fault runs only in its own target's recipes that have everything its manifest needs
    assert all(c.target == specs[c.faults[0]].target for c in faulty)
    assert all(not unmet(specs[c.faults[0]].manifest, targets.get(c.target).recipes()[c.recipe], c.target)
               for c in faulty)
    assert not any(faults[f].get("not_runnable") for f in all_faults("ref"))  # every reference fault can show


def test_the_quick_matrix_keeps_one_fault_per_subsystem_and_the_whole_clean_matrix():
    cases, faults = build_matrix(BenchConfig(seeds=(0,), detectors=("suite",), per_subsystem=1))
    specs = all_faults(None)
    every = {(s.target, s.subsystem) for s in specs.values()}
    assert sorted((m["target"], m["subsystem"]) for m in faults.values()) == sorted(every)  # each once
    for target in ("ref", "hf"):
        assert {c.recipe for c in cases if not c.faults and c.target == target} == set(targets.get(target).recipes())
    assert {c.faults[0] for c in cases if c.faults} <= set(faults)


def test_exclusive_detectors_run_only_when_asked():
    plain, _ = build_matrix(BenchConfig(seeds=(0,), faults=("label_permute",)))
    asked, _ = build_matrix(BenchConfig(seeds=(0,), faults=("label_permute",), exclusive=True))
    exclusive = {d for d, cls in DETECTORS.items() if cls.exclusive}
    assert exclusive and not any(set(c.detectors) & exclusive for c in plain)
    assert {c.detectors for c in asked} - {c.detectors for c in plain} == {(d,) for d in exclusive}


def test_no_recipe_narrows_the_answer_on_any_target():
    """A detector that recognises a recipe's config must not learn the fault's subsystem from it."""
    cases, faults = build_matrix(BenchConfig(seeds=(0,), detectors=("suite",)))
    held: dict[tuple[str, str], set] = {}
    for c in cases:
        if c.faults:
            held.setdefault((c.target, c.recipe), set()).add(faults[c.faults[0]]["subsystem"])
    narrow = {r: sorted(s) for r, s in held.items() if len(s) < MIN_SUBSYSTEMS}
    assert MIN_SUBSYSTEMS >= 3 and not narrow, f"recipes that give the subsystem away: {narrow}"
    assert {t for t, _ in held} == {"ref", "hf"}


def test_the_matcher_assigns_hf_variants_by_their_essential_keys():
    def home(scenario="train", **variant):
        return recipe_for(Manifest(check="crash", scenario=scenario, steps=4, variant=variant), "hf")

    assert home() == "fp32"
    assert home(lr=1e-2, steps=2, warmup_steps=0, batch_size=8, weight_decay=0.0, max_grad_norm=0.0,
                model={"hidden_size": 32}, data={"seq_len": 16}) == "fp32"  # tuning keys only
    assert home(padding_side="left") == "left_pad" and home(precision="bf16") == "bf16"
    assert home(recipe="accum") == home(accum=2) == "accum"  # accumulation is on/off, a named recipe its switches
    assert home(model={"attention_dropout": 0.1}) == home("resume") == "resume"
    assert home(model={"attn_implementation": "eager"}) == home(recipe="eager") == "eager"
    assert home("ddp") == "ddp"
    # only the combined recipe has all of these (the plainest recipe that has one of them is not enough)
    assert home(recipe="eager", precision="bf16", padding_side="left") == home("resume", precision="bf16") == "combined"
    with pytest.raises(NotRunnable, match="lacks"):
        home("ddp", precision="bf16")  # no HF recipe runs bf16 on 2 ranks
    with pytest.raises(NotRunnable, match="gradient_checkpointing=True"):
        home(gradient_checkpointing=True)  # a key the matcher does not know is essential


def test_an_hf_fault_no_recipe_satisfies_is_not_runnable_with_its_reason(monkeypatch):
    import dataclasses

    base = all_faults("hf")["hf_label_shift_off_by_one"]
    spec = dataclasses.replace(base, id="hf_needs_bf16_ddp", manifest=Manifest(
        check="crash", scenario="ddp", variant={"precision": "bf16"}))
    monkeypatch.setitem(FAULTS, spec.id, spec)
    cases, faults = build_matrix(BenchConfig(seeds=(0,), detectors=("suite",), clean=False,
                                             faults=(spec.id, base.id)))
    assert {(c.target, c.faults) for c in cases} == {("hf", (base.id,))}
    reason = faults[spec.id]["not_runnable"]
    assert "precision=bf16" in reason and "world_size=True" in reason


def test_a_tiny_hf_bench_scores_its_cases_apart(tmp_path, monkeypatch):
    """One HF fault on seed 1 with its clean twin: rows say target hf, the fault showed, the summary is per target."""
    monkeypatch.setattr("faultbench.harness.bench.CACHE", tmp_path / "cache")
    monkeypatch.setattr("faultbench.harness.bench.recipes_of",
                        lambda target: {"fp32": targets.get(target).recipes()["fp32"]})
    cfg = BenchConfig(seeds=(1,), targets=("hf",), faults=("hf_label_shift_off_by_one",),
                      detectors=("loss_contract", "loss_vs_floor"), out=tmp_path / "out", progress=False)
    summary = run_bench(cfg)
    rows = _csv(cfg.out / "bench.csv")
    assert {r["target"] for r in rows} == {"hf"} and {r["case"] for r in rows} == {
        "hf:hf_label_shift_off_by_one/fp32/s1", "hf:clean/fp32/s1"}
    assert {r["manifested"] for r in rows if r["fault"]} == {"True"}  # unlike its clean twin's run
    assert list(summary["targets"]) == ["hf"] and summary["targets"]["hf"]["cases"] == 2
    assert summary["targets"]["hf"]["per_fault"]["hf_label_shift_off_by_one"]["recipes"] == ["fp32"]
    assert summary["targets"]["hf"]["suite"]["clean_cases"] == 1
    assert "## Target hf" in (cfg.out / "leaderboard.md").read_text()


def test_the_matcher_meets_the_whole_variant_and_ignores_only_tuning_knobs():
    def home(scenario="train", steps=10, **variant):
        return recipe_for(Manifest(check="crash", scenario=scenario, steps=steps, variant=variant))

    # fp16 under a resume with accumulation: only the combined recipe has all three (the old choice: resume)
    assert home("resume", train={"precision": "fp16", "accum": 4}) == "combined"
    assert home("ddp_resume", train={"precision": "fp16"}, data={"pad_side": "left"}) == "ddp_combined"
    assert home(train={"precision": "fp16"}, data={"pad_side": "left"}) == "combined"  # not fp16's right padding
    assert home(model={"dropout": 0.1}) == "resume"  # the plainest recipe with dropout
    assert home(steps=30, data={"num_docs": 200}) == "combined"  # 30 steps of a 200-document corpus: an epoch
    assert home(data={"seq_len": 8, "vocab_size": 32}, model={"init_std": 0.2},
                train={"batch_size": 12, "init_scale": 2.0**24, "grad_clip": 0.0}) == "fp32"  # tuning only
    for scenario, variant in (("resume", {"train": {"precision": "bf16"}}), ("train", {"model": {"bias": False}}),
                              ("ddp", {"train": {"zero": True, "accum": 2}})):
        with pytest.raises(NotRunnable, match="lacks"):
            home(scenario, **variant)


def test_a_fault_no_recipe_can_show_is_not_runnable_and_gets_a_row_of_its_own(monkeypatch):
    import dataclasses

    from faultbench.harness.report import blind_spot_lines

    spec = dataclasses.replace(FAULTS["label_permute"], id="needs_bf16_resume", manifest=Manifest(
        check="crash", scenario="resume", variant={"train": {"precision": "bf16"}}))
    monkeypatch.setitem(FAULTS, spec.id, spec)
    cases, faults = build_matrix(BenchConfig(seeds=(0,), detectors=("suite",), faults=(spec.id, "label_permute")))
    assert {c.faults for c in cases if c.faults} == {("label_permute",)}  # never scored where it cannot show
    assert "train.precision=bf16" in faults[spec.id]["not_runnable"]
    entry = {"subsystem": "loss", "recipes": ["fp32"], "cases": 3, "detected": 1, "top1_subsystem": 1,
             "top1_seam": 1, "latencies": [0], "crashed": 0}
    per_fault = {"missed_once": {**entry, "not_shown": 1}, "silent": {**entry, "not_shown": 2}}
    lines = blind_spot_lines({"per_fault": per_fault, "not_runnable": {spec.id: faults[spec.id]["not_runnable"]}})
    assert "- detector missed (the fault showed, no finding) on some case: missed_once" in lines
    assert any(line.startswith("- fault did not show") and "silent (2/3)" in line and "missed_once (1/3)" in line
               for line in lines)
    (row,) = [line for line in lines if line.startswith(f"| {spec.id} |")]
    assert "train.precision=bf16" in row


def test_a_fault_is_recorded_as_shown_only_where_its_run_differs_from_the_clean_one():
    from faultbench.harness.bench import mark_manifested

    # dropout 0: eval_in_train_mode changes nothing in fp32; label_permute always does
    cases = [Case("fp32", 0), Case("fp32", 0, ("eval_in_train_mode",)), Case("fp32", 0, ("label_permute",)),
             Case("resume", 0), Case("resume", 0, ("eval_in_train_mode",))]
    records = {c: run_target_case(c) for c in cases}
    records[Case("left_pad", 0, ("label_permute",))] = dict(records[cases[2]])  # no clean twin in this matrix
    mark_manifested(records)
    shown = {(c.recipe, c.faults[0]): r["manifested"] for c, r in records.items() if c.faults}
    assert shown == {("fp32", "eval_in_train_mode"): False, ("fp32", "label_permute"): True,
                     ("resume", "eval_in_train_mode"): True, ("left_pad", "label_permute"): None}


def test_a_kept_graph_shows_though_every_number_is_unchanged():
    from faultbench.harness.bench import mark_manifested

    cases = [Case("fp32", 0), Case("fp32", 0, ("loss_history_keeps_graph",))]
    records = {c: run_target_case(c) for c in cases}
    clean, faulty = records.values()
    assert [h["loss"] for h in clean["history"]] == [h["loss"] for h in faulty["history"]]
    mark_manifested(records)
    assert faulty["manifested"] and faulty["outputs"]["graphs_held"] > clean["outputs"]["graphs_held"] == 0


def test_the_same_case_gives_the_same_findings():
    case = Case("left_pad", 0, ("padding_mask_dropped",), tuple(resolve_ids(["suite"])))
    a, b = run_target_case(case), run_target_case(case)
    strip = lambda r: [{k: v for k, v in f.items() if k != "evidence"} for f in r["findings"]]  # noqa: E731
    assert strip(a) == strip(b) and a["history"] and [h["loss"] for h in a["history"]] == [
        h["loss"] for h in b["history"]]


def _csv(path):
    import csv

    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("tqdm", [True, False], ids=["tqdm", "no-tqdm"])
def test_progress_is_a_bar_or_plain_lines_and_a_blind_bench_names_no_case(capsys, monkeypatch, tqdm):
    from faultbench.harness.bench import Progress

    if not tqdm:  # the core install (torch, numpy) has no tqdm: plain lines
        monkeypatch.setitem(sys.modules, "tqdm", None)
    for named in (True, False):
        progress = Progress(2, enabled=True, named=named)
        progress.update("blind_fault_x-s0")
        progress.update("blind_fault_x-s1")
        err = capsys.readouterr().err
        assert ("blind_fault_x-s1" in err) == named and "2/2" in err and ("\r" in err) == tqdm
        if not tqdm:
            assert [line.split()[0] for line in err.splitlines()] == ["1/2", "2/2"]
