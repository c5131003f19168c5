"""Bad input: a one-line error and exit 2 (never a traceback), and nothing lost: an empty or failed bench
leaves existing results alone, a bad cache entry is recomputed, a re-run rewrites byte-identical scores."""

import json
import sys
import textwrap

import pytest
import torch

from faultbench.faults.registry import FAULTS
from faultbench.harness.atomic import check_output
from faultbench.harness.cli import main
from faultbench.targets.ref.recipes import RECIPES

HEADER = '''
from faultbench.faults.registry import Manifest, fault


@fault("{id}", seam="{seam}", title="t" * 30, subsystem="loss", trigger="always", symptoms=("nan",),
       explanation="e" * 30, fix="f" * 30, references=("r",), manifest=Manifest(check="loss_above"))
'''
LM_LOSS = "def lm_loss(logits, labels, num_targets=None, ignore_index=-100):\n"


def _one_line_error(capsys, argv, expect: str) -> str:
    """Runs the CLI; asserts exit 2 and a single stderr line containing ``expect``; returns the line."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert expect in err, err
    return err


def _plugin(tmp_path, name: str, fault_id: str, body: str, seam: str = "model.loss.lm_loss",
            header: str = LM_LOSS) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER.format(id=fault_id, seam=seam) + header + textwrap.indent(body, "    "))
    return str(path)


# ---- counts and flags ---------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, expect", [
    (["bench", "--seeds", "0"], "--seeds: expected a positive integer, got 0"),
    (["bench", "--seeds", "-2"], "--seeds: expected a positive integer, got -2"),
    (["bench", "--seeds", "100000000"], "--seeds: expected at most 1000, got 100000000"),  # a MemoryError before
    (["bench", "--jobs", "100000"], "--jobs: expected at most 256"),
    *([(["run", "--fault", "label_permute", "--preset", "gpu"], "preset 'gpu' trains on CUDA"),
       (["train", "--preset", "gpu", "--steps", "2"], "preset 'gpu' trains on CUDA")]
      if not torch.cuda.is_available() else []),
    (["run", "--fault", "label_permute", "--steps", "1e9"], "--steps: expected a positive integer, got '1e9'"),
    (["bench", "--jobs", "0"], "--jobs: expected a positive integer"),  # jobs 0 used to spin forever
    (["train", "--threads", "0"], "--threads"),
    (["train", "--log-every", "0"], "--log-every"),
    (["run", "--fault", "label_permute", "--accum", "0"], "--accum"),  # accum 0 used to be ignored
    (["faults", "--subsystem", "nope"], "choose from 'data', 'collate'"),
    (["bench", "--only-plugin-faults"], "--only-plugin-faults needs a --plugin"),
])
def test_invalid_values_are_refused_in_one_line(argv, expect, capsys):
    _one_line_error(capsys, argv, expect)


def test_train_names_the_flags_whose_product_must_divide_the_batch(capsys):
    _one_line_error(capsys, ["train", "--world-size", "3", "--steps", "2"],
                    "--world-size 3 x --accum 1 must divide the preset's batch of 16")


def test_a_refused_bench_leaves_existing_results_alone(tmp_path, capsys):
    (tmp_path / "bench.csv").write_text("committed\n")
    _one_line_error(capsys, ["bench", "--seeds", "0", "--out", str(tmp_path)], "--seeds")
    assert (tmp_path / "bench.csv").read_text() == "committed\n"
    _one_line_error(capsys, ["bench", "--out", str(tmp_path / "bench.csv")], "is a file, not a folder")


@pytest.mark.parametrize("argv, refusal", [
    (["train", "--steps", "2", "--save"], "is not a checkpoint (no meta.json)"),
    (["run", "--fault", "label_permute", "--detectors", "loss_contract", "--bundle"],
     "is not a repro bundle (no MANIFEST.sha256)"),
])
def test_an_output_folder_never_replaces_a_users_file_or_folder(tmp_path, capsys, argv, refusal):
    # both used to delete what was there (a checkpoint or bundle is written by replacing the folder)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "main.py").write_text("mine")
    for target in ("notes.txt", "project"):
        _one_line_error(capsys, [*argv, str(tmp_path / target)], refusal)
    assert (tmp_path / "notes.txt").read_text() == (tmp_path / "project" / "main.py").read_text() == "mine"
    _one_line_error(capsys, ["bench", "--bundles", str(tmp_path / "notes.txt")], "is a file, not a folder")


class _Stop(Exception):
    pass


@pytest.mark.parametrize("argv, seeds, exclusive, per_subsystem", [
    (["--quick"], (0,), False, 1), (["--quick", "--seeds", "2"], (0, 1), False, 1), ([], (0, 1, 2), False, None),
    (["--exclusive"], (0, 1, 2), True, None), (["--detectors", "detect_anomaly"], (0, 1, 2), True, None),
    (["--quick", "--fault", "label_permute"], (0,), False, None),
])
def test_quick_and_exclusive_flags(argv, seeds, exclusive, per_subsystem, monkeypatch):
    seen = []

    def fake_run_bench(cfg):
        seen.append(cfg)
        raise _Stop

    monkeypatch.setattr("faultbench.harness.bench.run_bench", fake_run_bench)
    with pytest.raises(_Stop):
        main(["bench", *argv])
    assert (seen[0].seeds, seen[0].exclusive, seen[0].per_subsystem) == (seeds, exclusive, per_subsystem)


def test_an_empty_matrix_writes_nothing(tmp_path):
    from faultbench.harness.bench import BenchConfig, run_bench

    (tmp_path / "bench.csv").write_text("committed\n")
    cfg = BenchConfig(seeds=(), out=tmp_path, progress=False)
    with pytest.raises(ValueError, match="matrix is empty"):
        run_bench(cfg)
    assert [p.name for p in tmp_path.iterdir()] == ["bench.csv"]
    assert (tmp_path / "bench.csv").read_text() == "committed\n"


def test_a_failure_while_rendering_leaves_every_result_file_as_it_was(tmp_path, monkeypatch):
    from faultbench.harness import report

    before = {name: f"old {name}\n" for name in ("bench.csv", "summary.json", "leaderboard.md")}
    for name, text in before.items():
        (tmp_path / name).write_text(text)
    row = {c: "" for c in report.COLUMNS} | {"detector": "suite", "fault": "f", "rr_subsystem": 1.0}
    monkeypatch.setattr(report, "leaderboard", lambda *a: 1 / 0)  # rendered after the csv used to be written
    with pytest.raises(ZeroDivisionError):
        report.write_results(tmp_path, [row], {}, {}, {}, {})
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before
    with pytest.raises(ValueError, match="produced no case"):
        report.write_results(tmp_path, [], {}, {}, {}, {})


# ---- plugins --------------------------------------------------------------------------------------------

def test_plugin_that_does_not_import_is_one_line(tmp_path, capsys):
    _one_line_error(capsys, ["faults", "--plugin", "nope.module"], "No module named 'nope'")
    _one_line_error(capsys, ["faults", "--plugin", str(tmp_path)], "is not a .py file nor a module name")
    bad = tmp_path / "broken_syntax.py"
    bad.write_text("x = 1\ndef f(:\n    pass\n")
    _one_line_error(capsys, ["faults", "--plugin", str(bad)], f"{bad}:2: ")
    raising = tmp_path / "raises_on_import.py"
    raising.write_text("x = 1\nraise RuntimeError('boom')\n")
    _one_line_error(capsys, ["faults", "--plugin", str(raising)], f"{raising}:2: RuntimeError: boom")


def test_plugin_with_another_signature_gets_a_readable_message(tmp_path, capsys):
    path = _plugin(tmp_path, "other_signature", "tmp_other_signature", '"""Wrong header."""\nreturn a\n',
                   header="def lm_loss(a, b):\n")
    err = _one_line_error(capsys, ["faults", "--plugin", path],
                          "(logits, labels, num_targets=None, ignore_index=-100), got (a, b)")
    assert "_ParameterKind" not in err and "tmp_other_signature" not in FAULTS


def test_plugin_fault_using_an_undefined_name_is_refused_at_registration(tmp_path, capsys):
    path = _plugin(tmp_path, "undefined_name", "tmp_undefined_name",
                   '"""Calls a helper nobody defined."""\nreturn logits.sum() * helper_never_defined(labels)\n')
    _one_line_error(capsys, ["faults", "--plugin", path], "uses undefined name(s) helper_never_defined")
    assert "tmp_undefined_name" not in FAULTS


def test_plugin_fault_with_other_closure_variables_is_refused_at_registration(tmp_path, capsys):
    # spliced into the class, a zero-argument super() closes over __class__, which the seam does not:
    # injection used to skip such a replacement without a word
    path = _plugin(tmp_path, "closure_vars", "tmp_closure_vars", '"""Calls the parent\'s forward."""\n'
                   "return super().forward(x)\n", seam="model.gpt.MLP.forward", header="def forward(self, x):\n")
    _one_line_error(capsys, ["faults", "--plugin", path], "closes over ['__class__'] where model.gpt.MLP.forward")
    assert "tmp_closure_vars" not in FAULTS


def test_plugin_attributes_and_builtins_are_not_undefined_names(tmp_path):
    from faultbench.faults.registry import load_plugin, plugin_module_name

    path = _plugin(tmp_path, "fine_names", "tmp_fine_names", '"""Uses attributes, builtins, module globals."""\n'
                   "total = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))\n"
                   "return total * float(len([c for c in range(2)]))\n")
    try:
        load_plugin(path)
        assert "tmp_fine_names" in FAULTS
    finally:
        FAULTS.pop("tmp_fine_names", None)
        sys.modules.pop(plugin_module_name(path), None)


# ---- practice -------------------------------------------------------------------------------------------

def test_practice_new_into_a_file_and_a_garbage_marker_are_one_line(tmp_path, capsys):
    target = tmp_path / "a_file"
    target.write_text("x")
    _one_line_error(capsys, ["practice", "new", "--dir", str(target), "--fault", "label_permute"], "is a file")
    (tmp_path / "ex").mkdir()
    for garbage in ("garbage", "[1]", '{"x": 1}', '{"token": "../../etc/passwd"}'):
        (tmp_path / "ex" / ".exercise").write_text(garbage)
        for argv in (["hint", str(tmp_path / "ex")], ["answer", str(tmp_path / "ex"), "--subsystem", "data"]):
            _one_line_error(capsys, ["practice", *argv], "is not an exercise marker")


# ---- the bench's cache and its outputs ----------------------------------------------------------------

SCORE_FILES = ("bench.csv", "summary.json", "leaderboard.md", "summary.png", "heatmap_ref_white.png", "index.html")


@pytest.fixture
def tiny_bench(tmp_path, monkeypatch):
    """A 2-case bench (one cheap fault and its clean case, one recipe, one seed, one detector)."""
    from faultbench.harness.bench import BenchConfig

    monkeypatch.setattr("faultbench.harness.bench.recipes_of", lambda target: {"fp32": RECIPES["fp32"]})
    monkeypatch.setattr("faultbench.harness.bench.CACHE", tmp_path / "cache")
    return BenchConfig(seeds=(0,), detectors=("forward_loss_contract",), faults=("label_permute",), jobs=1,
                       out=tmp_path / "results", progress=False)


def _scores(out) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in SCORE_FILES}


def test_a_rerun_rewrites_byte_identical_scores_and_a_bad_cache_entry_is_recomputed(tiny_bench, capsys):
    from faultbench.harness.bench import run_bench

    run_bench(tiny_bench)
    first = _scores(tiny_bench.out)
    rows = (tiny_bench.out / "bench.csv").read_text().splitlines()
    assert "train_s" not in rows[0] and "top_detector,top_subsystem,top_seam" in rows[0]
    faulty = next(r for r in rows[1:] if r.startswith("label_permute/") and ",suite," in r)
    assert ",forward_loss_contract,loss,model.train.forward_loss," in faulty  # who gave the top finding
    timings = (tiny_bench.out / "timings.csv").read_text().splitlines()
    assert timings[0] == "case,detector,train_s,loop_s,step_s,other_s" and len(timings) == len(rows)
    assert set(json.loads((tiny_bench.out / "timings.json").read_text())) == {"wall_s", "cached_cases", "detectors"}

    run_bench(tiny_bench)  # warm cache: the clock differs, the scores files must not
    assert _scores(tiny_bench.out) == first
    assert json.loads((tiny_bench.out / "timings.json").read_text())["cached_cases"] == 2

    bad_json, wrong_record = sorted((tiny_bench.out.parent / "cache").glob("*.json"))
    bad_json.write_text('{"case": {"recipe": "fp32", "unterminated')
    record = json.loads(wrong_record.read_text())
    wrong_record.write_text(json.dumps({**record, "findings": "none", "step_seconds": None}))
    capsys.readouterr()
    run_bench(tiny_bench)  # recomputes both cases instead of failing
    err = capsys.readouterr().err
    assert f"discarding the bad cache entry {bad_json}" in err
    assert f"discarding the bad cache entry {wrong_record}" in err and "findings, step_seconds" in err
    assert json.loads((tiny_bench.out / "timings.json").read_text())["cached_cases"] == 0
    assert _scores(tiny_bench.out) == first  # recomputed, the same scores
    assert json.loads(wrong_record.read_text())["findings"] == record["findings"]  # rewritten whole


def test_a_cached_record_of_another_case_is_not_used(tiny_bench, capsys):
    from faultbench.harness.bench import read_cached
    from faultbench.harness.record import Case

    path = tiny_bench.out.parent / "entry.json"
    case, other = Case("fp32", 0, (), ("forward_loss_contract",)), Case("fp32", 1, (), ("forward_loss_contract",))
    record = {"case": other.to_dict(), "name": other.name, "history": [], "crash": None, "findings": [],
              "detector_errors": {}, "step_seconds": {}, "other_seconds": {}, "train_s": 0.0, "val_loss": None,
              "outputs": {}}
    path.write_text(json.dumps(record))
    assert read_cached(path, other) == record
    assert read_cached(path, case) is None and not path.exists()
    assert "the record of another case (clean/fp32/s1)" in capsys.readouterr().err


@pytest.mark.parametrize("change", [
    {"findings": [{"detector": "d", "step": "seven", "subsystem": "loss", "seam": None, "confidence": 0.5}]},
    {"findings": [{"detector": "d", "step": 3, "subsystem": "loss", "seam": None}]},  # no confidence
    {"findings": [{"detector": "d", "step": True, "subsystem": "loss", "seam": None, "confidence": 0.5}]},
    {"history": [1, 2, 3]},
])
def test_a_cache_entry_with_mistyped_findings_or_history_is_discarded(tmp_path, capsys, change):
    from faultbench.harness.bench import read_cached
    from faultbench.harness.record import Case

    case = Case("fp32", 0, (), ("forward_loss_contract",))
    record = {"case": case.to_dict(), "name": case.name, "history": [{"step": 1}], "crash": None, "findings": [],
              "detector_errors": {}, "step_seconds": {}, "other_seconds": {}, "train_s": 0.0, "val_loss": None,
              "outputs": {}}
    path = tmp_path / "entry.json"
    path.write_text(json.dumps(record))
    assert read_cached(path, case) == record  # the well-typed entry is read
    path.write_text(json.dumps({**record, **change}))
    assert read_cached(path, case) is None and not path.exists()
    assert "discarding the bad cache entry" in capsys.readouterr().err


def test_two_plugins_of_one_file_name_in_two_folders_both_load(tmp_path):
    from faultbench.faults.registry import load_plugin, plugin_module_name

    paths = []
    for folder, fault_id in (("a", "tmp_same_name_a"), ("b", "tmp_same_name_b")):
        (tmp_path / folder).mkdir()
        paths.append(_plugin(tmp_path / folder, "faults", fault_id, '"""A plain loss."""\n'
                             "return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), "
                             "labels[:, 1:].reshape(-1))\n"))
    try:
        for path in paths:
            load_plugin(path)
        assert {"tmp_same_name_a", "tmp_same_name_b"} <= set(FAULTS)  # the second was silently skipped before
    finally:
        for path, fault_id in zip(paths, ("tmp_same_name_a", "tmp_same_name_b"), strict=True):
            FAULTS.pop(fault_id, None)
            sys.modules.pop(plugin_module_name(path), None)


def test_every_output_path_follows_one_policy_before_any_work(tmp_path, capsys):
    """'' , a missing folder, an over-long name, a file the command did not write, a folder of something else:
    each refused in one line, before the run, and nothing there changes (issue 23: committed results overwritten
    after a whole run, an export half-made)."""
    mine = tmp_path / "leaderboard.md"
    mine.write_text("committed")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.py").write_text("mine")
    long = "x" * 300
    for argv, refusal in (
        (["bench", "--out", ""], "--out '' names no folder"),
        (["bench", "--out", str(tmp_path / "src")], "holds files of something else (no summary.json)"),
        (["bench", "--out", str(tmp_path / long)], "a name longer than 255 bytes"),
        (["bench", "--out", str(mine / "inside")], f"{mine} is a file, not a folder"),
        (["run", "--fault", "label_permute", "--plot", str(mine)], "exists: pass --force to replace it"),
        (["run", "--fault", "label_permute", "--plot", str(tmp_path / "missing" / "p.png")], "does not exist"),
        (["practice", "report", str(tmp_path), "--out", str(mine)], "exists: pass --force to replace it"),
        (["practice", "export", "--dir", str(tmp_path / "ex"), "--archive", str(mine)], "pass --force"),
        (["mutate", "--admit", "--out", str(tmp_path / long / "set.json")], "a name longer than 255 bytes"),
    ):
        _one_line_error(capsys, argv, refusal)
    assert mine.read_text() == "committed" and (tmp_path / "src" / "main.py").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["leaderboard.md", "src"]  # no half-made exercise


def test_practice_history_of_a_folder_that_holds_no_keys_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "summary.json").write_text('{"cases": 1}')
    _one_line_error(capsys, ["practice", "history", "--keys", str(tmp_path)], "summary.json is not an answer key")
    (tmp_path / "summary.json").write_text("{not json")
    _one_line_error(capsys, ["practice", "history", "--keys", str(tmp_path)], "is not an answer key (JSONDecodeError)")


@pytest.mark.parametrize("content", ["[]", '{"ref/fp32-x": {"runs": "none"}}', '{"ref/fp32-x": {"seeds": [1, 2], "ru'])
def test_a_bad_golden_cache_is_named_deleted_and_recorded_again(tmp_path, capsys, content):
    from faultbench.harness.golden import read_cache

    path = tmp_path / "ref-abc.json"
    path.write_text(content)
    assert read_cache(path) == {} and not path.exists()
    assert f"discarding the bad golden cache {path}" in capsys.readouterr().err
    good = {"ref/fp32-x": {"seeds": [1000], "runs": [{"loss": [5.0]}]}}
    path.write_text(json.dumps(good))
    assert read_cache(path) == good


def test_a_truncated_tokenizer_or_practice_reference_cache_is_computed_again(tmp_path, capsys, monkeypatch):
    from faultbench.harness import practice_runs
    from faultbench.model.tokenizer import load_or_train_tokenizer

    monkeypatch.setenv("TOKENIZER_CACHE_DIR", str(tmp_path))
    texts = ["the cat sat", "a dog ran far", "the dog sat"] * 20
    first = load_or_train_tokenizer(texts, 300)
    (cached,) = tmp_path.glob("tokenizer-*.json")
    cached.write_text(cached.read_text()[:100])  # truncated
    again = load_or_train_tokenizer(texts, 300)
    assert again.encode("the cat ran") == first.encode("the cat ran")
    assert f"discarding the bad tokenizer cache {cached}" in capsys.readouterr().err

    monkeypatch.setenv("FAULTBENCH_CACHE", str(tmp_path / "cache"))
    calls = []
    compute = lambda: calls.append(1) or {"loss": 1.0}  # noqa: E731
    assert practice_runs.reference_cached("k", {"a": 1}, (), compute) == {"loss": 1.0}
    (entry,) = (tmp_path / "cache" / "practice-reference" / "k").glob("*.json")
    entry.write_text('{"loss": 1.')
    assert practice_runs.reference_cached("k", {"a": 1}, (), compute) == {"loss": 1.0} and len(calls) == 2
    assert f"discarding the bad practice reference {entry}" in capsys.readouterr().err


@pytest.mark.parametrize("state", ["list", "no_model", "folder"])
def test_train_resume_from_a_state_that_is_not_a_training_state_is_refused_before_the_run(tmp_path, capsys, state):
    """meta.json's sha256 updated to match, as anyone can: still one line, exit 2, before any run is built."""
    import hashlib

    import torch

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    path = ckpt / "state.pt"
    if state == "folder":
        path.mkdir()
        digest = "0" * 64
    else:
        torch.save([1, 2] if state == "list" else {"optimizer": {}, "step": 3}, path)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    (ckpt / "meta.json").write_text(json.dumps({"format": 1, "sha256": digest, "config": {},
                                                "tokenizer_sha256": "x"}))
    _one_line_error(capsys, ["train", "--steps", "2", "--resume", str(ckpt)],
                    "no state.pt file" if state == "folder" else "lacks model")


def test_a_failed_golden_run_is_never_cached_and_stops_the_bench_in_one_line(tmp_path, monkeypatch):
    """A clean golden run that crashed or hung is the machinery's failure (a rank killed): the other recipes'
    entries are kept, that recipe's is not, and a ValueError (one line, exit 2 at the CLI) says to run again."""
    from faultbench.harness import golden as golden_mod
    from faultbench.harness.record import failed_record

    monkeypatch.setattr(golden_mod, "CACHE", tmp_path)
    monkeypatch.setattr(golden_mod, "trace_of", lambda record: {"loss": [1.0]})

    def runs(cases, kill=("ddp",)):
        return [failed_record(c, "RankFailure", "rank 1 died") if c.recipe in kill else
                {"case": c.to_dict(), "crash": None, "hang": False} for c in cases]

    with pytest.raises(ValueError, match=r"golden run of ref recipe\(s\) ddp \(RankFailure\) failed") as info:
        golden_mod.load_golden(["fp32", "ddp"], run_cases=runs)
    assert "\n" not in str(info.value)
    (path,) = tmp_path.glob("ref-*.json")
    assert [k.split("-")[0] for k in json.loads(path.read_text())] == ["ref/fp32"]
    again = golden_mod.load_golden(["fp32", "ddp"], run_cases=lambda cases: runs(cases, kill=()))
    assert len(again["ddp"]["runs"]) == len(golden_mod.GOLDEN_SEEDS) == len(again["fp32"]["runs"])


def test_a_folder_of_earlier_bundles_is_written_again_and_a_foreign_folder_is_refused(tmp_path):
    # bundles live one folder down (DIR/<case>/bundle.json): a rerun into the same DIR is not a foreign folder
    earlier = tmp_path / "bundles"
    (earlier / "case-0").mkdir(parents=True)
    (earlier / "case-0" / "bundle.json").write_text("{}")
    foreign = tmp_path / "project"
    foreign.mkdir()
    (foreign / "main.py").write_text("mine")
    assert check_output(earlier, "--bundles", folder_of="*/bundle.json") == earlier
    with pytest.raises(ValueError, match="holds files of something else"):
        check_output(foreign, "--bundles", folder_of="*/bundle.json")


def test_cases_failed_by_the_machinery_are_never_scored():
    """A worker that died, a rank that failed, a harness error: no outcome of the case, so no score at all (one
    line, nothing written); a crash of the case itself is an outcome and is scored."""
    from faultbench.harness.bench import refuse_machinery_failures
    from faultbench.harness.record import Case, failed_record

    ok, lost = Case("fp32", 0, ("label_permute",), ("loss_contract",)), Case("fp32", 1, ("label_permute",), ())
    crashed = {ok: failed_record(ok, "ValueError", "the fault's own crash")}
    refuse_machinery_failures(crashed)
    with pytest.raises(ValueError, match=r"^1 of 2 cases failed in the machinery \(WorkerDied; the first: the "
                                         r"case's process died \(exit code -9\)\): nothing scored") as info:
        refuse_machinery_failures({**crashed, lost: failed_record(lost, "WorkerDied",
                                                                  "the case's process died\n(exit code -9)")})
    assert "\n" not in str(info.value)
