"""The README's own-loop example (examples/own_loop.py), run as a user would: a copy in a folder of its own, no
faultbench checkout on the path; correct as written, then with one classic bug typed into it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop.py"
BUGS = {  # the edit that breaks the loop -> (subsystem, where) the watch must name first
    "zero_grad removed": (("            optimizer.zero_grad(set_to_none=True)\n", "            pass\n"),
                          ("optimizer", "optimizer")),
    "targets not shifted": (("data[i + 1 : i + 33] for i in starts", "data[i : i + 32] for i in starts"),
                            ("loss", "loss")),
}


def _run(folder: Path, source: str) -> dict:
    (folder / "train.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "train.py"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "faultbench.watch:" in proc.stderr  # the readable report, printed at exit
    return json.loads((folder / "findings.json").read_text())


def test_the_example_adds_three_lines_and_its_correct_loop_draws_no_finding(tmp_path):
    source = EXAMPLE.read_text()
    assert sum("# faultbench" in line for line in source.splitlines()) <= 10
    report = _run(tmp_path, source)
    assert report["findings"] == [] and report["errors"] == {} and report["steps"] == 40


@pytest.mark.parametrize("bug", BUGS)
def test_a_classic_bug_typed_into_the_example_is_named_in_the_users_terms(tmp_path, bug):
    (old, new), expected = BUGS[bug]
    source = EXAMPLE.read_text()
    assert old in source
    top = _run(tmp_path, source.replace(old, new))["findings"][0]
    assert (top["subsystem"], top["where"]) == expected
