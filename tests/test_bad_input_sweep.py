"""A sweep of bad inputs over every subcommand (issue 23): each refused in one stderr line with exit 2, no
traceback, before any work, and no file in the working folder changed. Fast refusals only (no training runs);
the slower ones live in test_bad_input_cli.py."""

from __future__ import annotations

import os

import pytest

from faultbench.harness.cli import main

SUBCOMMANDS = ("train", "seams", "faults", "show", "run", "replay", "plugins", "detectors", "bench", "contracts",
               "mutate", "practice new", "practice export", "practice hint", "practice check", "practice reveal",
               "practice status", "practice report", "practice start", "practice history", "practice answer",
               "practice rubric", "practice stop", "practice score", "practice runsheet", "practice validate",
               "practice export-tasks", "practice run-agent", "golden record")
COUNTS = ("0", "-1", "abc", "1.5", "", "1e3", "99999999999999999999")
BAD_IDS = ("label_permut", "LABEL_PERMUTE", "no_such_fault", "", "../etc/passwd")

# (argv, what the line must say), grouped by argument class
SWEEP: list[tuple[list[str], str]] = []
SWEEP += [([*sub.split(), "--no-such-flag"], "error:") for sub in SUBCOMMANDS]  # unknown flags
SWEEP += [([*sub.split(), "--json", "--json", "extra-positional", "more"], "") for sub in
          ("seams", "faults", "detectors", "contracts", "plugins")]  # stray positionals
SWEEP += [(["bench", "--seeds", c], "--seeds") for c in COUNTS]
SWEEP += [(["bench", "--jobs", c], "--jobs") for c in COUNTS]
SWEEP += [(["train", "--steps", c], "--steps") for c in COUNTS]
SWEEP += [(["train", "--accum", c], "--accum") for c in COUNTS]
SWEEP += [(["train", "--world-size", c], "--world-size") for c in COUNTS]
SWEEP += [(["train", "--threads", c], "--threads") for c in COUNTS]
SWEEP += [(["train", "--log-every", c], "--log-every") for c in COUNTS]
SWEEP += [(["run", "--fault", "label_permute", "--steps", c], "--steps") for c in COUNTS]
SWEEP += [(["run", "--fault", "label_permute", "--accum", c], "--accum") for c in COUNTS]
SWEEP += [(["mutate", "--per-cell", c], "--per-cell") for c in COUNTS]
SWEEP += [(["mutate", "--jobs", c], "--jobs") for c in COUNTS]
SWEEP += [(["practice", "start", "EX", "--minutes", c], "--minutes") for c in ("0", "-1", "abc", "", "nan", "inf")]
SWEEP += [(["show", i], "") for i in BAD_IDS]
SWEEP += [(["run", "--fault", i], "") for i in BAD_IDS]
SWEEP += [(["bench", "--fault", i], "") for i in BAD_IDS]
SWEEP += [(["practice", "rubric", "--fault", i], "") for i in BAD_IDS]
SWEEP += [(["practice", "new", "--dir", "EX", "--fault", i], "") for i in BAD_IDS]
SWEEP += [(["bench", "--detectors", d], "") for d in ("no_such_detector", "bb_causalty", "")]
SWEEP += [(["bench", "--target", t], "") for t in ("nope", "", "ref,nope", "REF")]
SWEEP += [(["faults", "--target", t], "") for t in ("nope", "", "ref,nope")]
SWEEP += [(["seams", "--target", t], "") for t in ("nope", "")]
SWEEP += [(["faults", "--subsystem", s], "") for s in ("nope", "", "Loss")]
SWEEP += [(["train", "--preset", p], "") for p in ("tny", "", "huge")]
SWEEP += [(["train", "--precision", p], "") for p in ("fp8", "", "FP32")]
SWEEP += [(["train", "--pad-side", p], "") for p in ("middle", "")]
SWEEP += [(["run", "--fault", "label_permute", "--precision", "fp8"], "")]
SWEEP += [(["run", "--fault", "label_permute", "--pad-side", "middle"], "")]
SWEEP += [(["run", "--fault", "label_permute", "--preset", "tny"], "")]
SWEEP += [(["run", "--fault", "label_permute", "hf_label_shift_off_by_one"], "")]  # a stray positional
SWEEP += [(["run", "--fault", "label_permute", "--fault", "hf_label_shift_off_by_one"], "different targets")]
SWEEP += [(["bench", "--plugin", p], "plugin") for p in ("missing.py", "notes.txt", "no/such/module", "dir/")]
SWEEP += [(["run", "--fault", "label_permute", "--plugin", "missing.py"], "plugin")]
SWEEP += [(["bench", "--only-plugin-faults"], "--only-plugin-faults needs a --plugin")]
SWEEP += [(["bench", "--out", o], "--out") for o in ("", "x" * 300, "committed.txt", "committed.txt/inside")]
SWEEP += [(["bench", "--bundles", b], "--bundles") for b in ("committed.txt", "y" * 300)]
SWEEP += [(["run", "--fault", "label_permute", "--plot", p], "--plot") for p in
          ("committed.txt", "missing/p.png", "z" * 300, "")]
SWEEP += [(["train", "--save", s], "") for s in ("committed.txt", "")]
SWEEP += [(["train", "--resume", r], "") for r in ("missing-checkpoint", "committed.txt")]
SWEEP += [(["replay", r], "") for r in ("missing-bundle", "committed.txt", ".")]
SWEEP += [(["practice", cmd, d], "") for cmd in ("hint", "check", "reveal", "status", "report", "stop", "rubric")
          for d in ("missing-exercise", "committed.txt", ".")]
SWEEP += [(["practice", "score", "EX", *s], "") for s in (["reproduce=3"], ["reproduce=x"], ["fix"], ["=3"])]
SWEEP += [(["practice", "new", "--dir", "EX", "--max-answers", c], "--max-answers") for c in ("0", "-1", "abc", "")]
SWEEP += [(["practice", "rubric", "EX", "--fault", "label_permute"], "")]
SWEEP += [(["practice", "runsheet", "--fault", i], "") for i in BAD_IDS]
SWEEP += [(["practice", "validate", "--only", i], "") for i in (*BAD_IDS, "hf_label_permute")]
SWEEP += [(["practice", "export-tasks", "EX", "--tasks", c], "--tasks") for c in ("0", "-1", "abc", "", "101")]
SWEEP += [(["practice", "export-tasks", ".", "--tasks", "1"], "not empty")]
SWEEP += [(["practice", "run-agent", d, "--command", "true", "--name", "x"], "") for d in ("missing", "committed.txt")]
SWEEP += [(["practice", "runsheet", "--fault", "label_permute", "--minutes", c], "--minutes")
          for c in ("0", "-1", "abc", "")]
SWEEP += [(["practice", "answer", "missing-exercise", "--subsystem", "loss"], "")]
SWEEP += [(["practice", "answer", "EX", "--subsystem", "nope"], "")]
SWEEP += [(["practice", "new", "--dir", "EX", "--subsystem", "nope"], "")]
SWEEP += [(["practice", "new", "--dir", "EX", "--difficulty", "extreme"], "")]
SWEEP += [(["practice", "report", ".", "--out", "committed.txt"], "")]
SWEEP += [(["practice", "history", "--keys", "committed.txt"], "")]
SWEEP += [(["mutate", "--admit", "--out", o], "--out") for o in ("committed.txt", "missing/set.json", "w" * 300)]
SWEEP += [(["mutate", "--out", "committed.txt"], "")]
SWEEP += [(["mutate", "--target", "nope"], "")]
SWEEP += [(["golden", "record", *runs, "--out", o], says) for runs, o, says in (
    (["committed.txt"], "g.json", "committed.txt: "), (["missing.json"], "g.json", "missing.json: "),
    (["dir"], "g.json", "dir: "), ([""], "g.json", ""), (["committed.txt"], "committed.txt", "--out"),
    (["committed.txt"], "", "--out"), (["committed.txt"], "v" * 300, "--out"), (["committed.txt"], "dir", "--out"),
    (["committed.txt"], "missing/g.json", "--out"), ([], "g.json", ""))]
SWEEP += [(["golden", "record", "committed.txt"], "--out")]
SWEEP += [([], "")]  # no subcommand
SWEEP += [([*sub, "--seed", s], "--seed") for sub in (["train"], ["run", "--fault", "label_permute"],
                                                      ["practice", "new", "--dir", "EX"])
          for s in ("-1", "abc", "1.5", "99999999999999999999")]
# flags that mean something only beside another: refused instead of silently ignored
SWEEP += [(argv, f"{argv[-1] if argv[-1].startswith('--') else argv[-2]} applies only") for argv in (
    ["train", "--zero"], ["train", "--timeout", "5"],
    ["run", "--fault", "label_permute", "--recipe", "fp32"], ["run", "--fault", "label_permute", "--no-bundle"],
    ["run", "--fault", "label_permute", "--bundle", "dir"], ["run", "--fault", "label_permute", "--force"],
    ["run", "--fault", "label_permute", "--detectors", "suite", "--steps", "5"],
    ["run", "--fault", "label_permute", "--detectors", "suite", "--plot", "p.png"],
    ["run", "--fault", "label_permute", "--detectors", "suite", "--precision", "bf16"],
    ["run", "--fault", "label_permute", "--detectors", "suite", "--world-size", "2"],
    ["run", "--fault", "label_permute", "--detectors", "suite", "--no-bundle", "--bundle", "dir"],
    ["mutate", "--jobs", "3"], ["mutate", "--per-cell", "2"], ["mutate", "--sample", "2"], ["mutate", "--force"],
    ["practice", "new", "--dir", "EX", "--fault", "label_permute", "--seed", "3"],
    ["practice", "export", "--dir", "EX", "--fault", "label_permute", "--subsystem", "loss"],
    ["practice", "export", "--dir", "EX", "--force"], ["practice", "report", "EX", "--force"])]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "committed.txt").write_text("committed")
    (tmp_path / "dir").mkdir()
    return tmp_path


def _snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in folder.rglob("*")}


def test_the_sweep_is_large():
    assert len(SWEEP) >= 180


@pytest.mark.parametrize(("argv", "says"), SWEEP, ids=[" ".join(a)[:60] or "(none)" for a, _ in SWEEP])
def test_a_bad_input_is_refused_in_one_line_and_changes_nothing(workdir, capsys, argv, says):
    before = _snapshot(workdir)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert says in err, err
    assert _snapshot(workdir) == before
    assert os.getcwd() == str(workdir)
