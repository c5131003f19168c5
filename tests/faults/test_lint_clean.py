"""A spliced fault leaves no lint trail: ruff's pyflakes and unused-argument rules (``F``, ``ARG``) find nothing in
the spliced module that they do not find in the clean one. Otherwise ``ruff check --select F,ARG model/`` in an
exercise folder points at the faulty function (an import only the clean body used, an argument the bug ignores)
without any debugging.

One documented exception: ``val_split_overlaps_train`` is a random split, so the text it is given and the hash it
used go unused by the nature of the bug (a version that still hashes the text would not overlap)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from faultbench.faults.inject import spliced_sources
from faultbench.faults.registry import all_faults

FAULTS = all_faults("ref")
RUFF = shutil.which("ruff") or str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "ruff")
UNUSED_BY_NATURE = {"val_split_overlaps_train"}


def _lint(text: str, name: str, folder: Path) -> set[tuple[str, str]]:
    path = folder / name
    path.write_text(text)
    out = subprocess.run([RUFF, "check", "--isolated", "--select", "F,ARG", "--output-format", "json", str(path)],
                         capture_output=True, text=True, timeout=60).stdout
    return {(e["code"], e["message"]) for e in json.loads(out)}


@pytest.mark.parametrize("fault_id", [
    pytest.param(f, marks=pytest.mark.xfail(strict=True, reason="unused by the nature of the bug"))
    if f in UNUSED_BY_NATURE else f for f in sorted(FAULTS)])
def test_a_spliced_fault_adds_no_lint_finding(fault_id, tmp_path):
    for path, text in spliced_sources([fault_id]).items():
        name = Path(path).name
        new = _lint(text, name, tmp_path) - _lint(Path(path).read_text(), name, tmp_path)
        assert not new, f"{fault_id}: {path}: {sorted(new)}"
