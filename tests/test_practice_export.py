"""Practice exercises are leak-free: every reference fault spliced into a standalone folder (no training).

The HF target's faults replace functions of the installed transformers: they cannot be spliced into a
copy a candidate could be handed, so practice refuses them (tested below) and this file covers the
reference's faults only.
"""

import ast
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from faultbench.faults.registry import all_faults
from faultbench.harness.exercise_docs import AUTHOR_DOCS, STALE_DOCSTRING
from faultbench.harness.practice import build_folder, choose_fault, scrub_paths, uniform_mtimes

FAULTS = all_faults("ref")
WHEN = 1_700_000_000  # any fixed time
# the fault machinery and the words of its registry (any case): none may appear in a candidate's folder
MACHINERY = (r"\bfaults?\b", "inject", "faultbench", "harness", "registry", "splic", "manifest")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One splice-only exercise folder per reference fault, with uniform mtimes."""
    root = tmp_path_factory.mktemp("exercises")
    out = {}
    for fault_id in sorted(FAULTS):
        out[fault_id] = build_folder(root / fault_id, fault_id)
        uniform_mtimes(out[fault_id], WHEN)
    return out


def _text_files(folder: Path) -> dict[Path, str]:
    return {p: p.read_text() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("fault_id", sorted(FAULTS))
def test_folder_names_neither_the_fault_nor_the_machinery(folders, fault_id):
    spec = FAULTS[fault_id]
    secrets = re.compile("|".join(f"(?:{s})" for s in (re.escape(fault_id), re.escape(spec.title), *MACHINERY)),
                         re.IGNORECASE)
    for path, text in _text_files(folders[fault_id]).items():
        found = secrets.search(text)
        assert not found, f"{path.name}: {text[max(0, found.start() - 60):found.end() + 60]!r}"


@pytest.mark.parametrize("fault_id", sorted(FAULTS))
def test_every_file_and_folder_has_the_same_mtime(folders, fault_id):
    folder = folders[fault_id]
    times = {p.relative_to(folder): p.stat().st_mtime for p in [folder, *folder.rglob("*")]}
    assert set(times.values()) == {WHEN}, {p: t for p, t in times.items() if t != WHEN}
    assert not list(folder.rglob("__pycache__")) and not (folder / ".cache").exists()


@pytest.mark.parametrize("fault_id", sorted(FAULTS))
def test_seam_listing_is_computed_from_the_copy_and_the_same_in_every_exercise(folders, fault_id):
    """Every listed function is found in the copy, the replaced ones included, and the listing is the same as
    another exercise's: nothing in it (a moved line) points at the changed file."""
    folder = folders[fault_id]
    listing = runpy.run_path(str(folder / "check.py"))["seam_listing"](folder)
    assert {name for name, *_ in listing} >= set(FAULTS[fault_id].seams)
    assert all(present for *_, present in listing)
    other = folders[next(f for f in sorted(folders) if f != fault_id)]
    assert listing == runpy.run_path(str(other / "check.py"))["seam_listing"](other)


@pytest.mark.parametrize("fault_id", sorted(FAULTS))
def test_replaced_functions_carry_their_authors_docstring(folders, fault_id):
    """The author's docstring by default; the seam's own (a stale contract) only where the fault keeps it on
    purpose; every reference fault is in exactly one of the two tables."""
    import inspect

    from faultbench.model.seams import resolve

    assert (fault_id in AUTHOR_DOCS) != (fault_id in STALE_DOCSTRING)
    for seam in FAULTS[fault_id].seams:
        _, module, qualname = seam.split(".", 2)
        tree = ast.parse((folders[fault_id] / "model" / f"{module}.py").read_text())
        node = tree
        for part in qualname.split("."):
            node = next(c for c in node.body if isinstance(c, (ast.ClassDef, ast.FunctionDef)) and c.name == part)
        seam_doc = inspect.getdoc(inspect.unwrap(resolve(seam)))
        doc = AUTHOR_DOCS[fault_id] if fault_id in AUTHOR_DOCS else seam_doc
        expected = doc.get(seam) if isinstance(doc, dict) else doc
        assert ast.get_docstring(node) == expected


def test_the_folder_runs_without_the_checkout(folders):
    """``python check.py --seams`` in the folder, with nothing of the checkout on the path, lists the copy."""
    folder = folders["rope_rotation_sign"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-I", "check.py", "--seams"], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if " model.rope.apply_rope " in x)
    assert line.split() == ["position", "model.rope.apply_rope", "model/rope.py"]


def test_hf_faults_are_refused_with_the_reason(monkeypatch):
    """A fault of another target (an HF one: loading the real ones imports transformers, 13 s) is refused."""
    import dataclasses

    hf_like = dataclasses.replace(FAULTS["label_permute"], id="hf_label_permute", target="hf")
    monkeypatch.setattr("faultbench.harness.practice.get_fault", lambda fault_id: hf_like)
    with pytest.raises(ValueError, match="cannot be spliced into a standalone copy"):
        choose_fault(None, "hf_label_permute", None, None)
    assert all(FAULTS[choose_fault(seed, None, None, None)].target == "ref" for seed in range(10))


def test_every_file_is_written_afresh_in_one_order(tmp_path):
    """The faulty file of an exercise is written last (the splice); settling rewrites every file in sorted order
    as a new inode (same bytes, same mode), so neither inode nor birth order singles it out."""
    for name in ("z.py", "a.py", "m/b.py"):  # made out of order, the way a splice leaves them
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name)
    (tmp_path / "a.py").chmod(0o755)
    before = {p: p.stat().st_ino for p in tmp_path.rglob("*.py")}
    uniform_mtimes(tmp_path, WHEN)
    after = {p: p.stat() for p in tmp_path.rglob("*.py")}
    assert set(after) == set(before) and all(after[p].st_ino != before[p] for p in before)
    assert [p.read_text() for p in sorted(after)] == ["a.py", "m/b.py", "z.py"]
    assert after[tmp_path / "a.py"].st_mode & 0o777 == 0o755 and not list(tmp_path.rglob("*.settle"))


def test_warnings_in_a_log_lose_their_line_and_source(tmp_path):
    """A library warning printed under the colleague's run names the changed line and shows its source: the
    README keeps the file and the message only; tracebacks keep their lines (a crash's report names them)."""
    log = (f"{tmp_path}/model/train.py:78: UserWarning: Detected call of `lr_scheduler.step()` before "
           "`optimizer.step()`.\n  scheduler.step()\nstep    0  loss 5.0\n"
           f'  File "{tmp_path}/model/loss.py", line 12, in lm_loss\n')
    assert scrub_paths(log, tmp_path) == (
        "~/job/model/train.py: UserWarning: Detected call of `lr_scheduler.step()` before `optimizer.step()`.\n"
        'step    0  loss 5.0\n  File "~/job/model/loss.py", line 12, in lm_loss\n')
