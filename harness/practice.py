"""Practice and interview mode. This slice: the interviewer's rubric for one fault.

``faultbench practice rubric --fault ID`` prints what a strong debugging answer covers, in the order a
strong answer takes: reproduce, isolate by subsystem, instrument, fix, prevent. It draws on the
fault's metadata and manifest, and on the committed results: the detectors that localized it in the
bench (results/bench.csv), its manifest evidence (results/faults.md) and the unit test that fails
with it injected (results/mutation.md).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from faults.registry import get_fault

RESULTS = Path(__file__).resolve().parent.parent / "results"


def _table_row(path: Path, fault_id: str) -> list[str] | None:
    """The cells of the markdown table row of ``fault_id`` in a results file (None if absent)."""
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == fault_id:
            return cells
    return None


def _localizing_detectors(fault_id: str, results: Path) -> list[str]:
    """Detectors that named an acceptable subsystem first on this fault, on every seed of the bench."""
    path = results / "bench.csv"
    if not path.exists():
        return []
    hits: dict[str, list[bool]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if row["fault"] == fault_id and row["detector"] != "suite":
                hits.setdefault(row["detector"], []).append(float(row["rr_subsystem"] or 0) == 1.0)
    return sorted(d for d, ok in hits.items() if ok and all(ok))


def rubric(fault_id: str, results: Path = RESULTS) -> str:
    spec = get_fault(fault_id)
    m = spec.manifest
    variant = json.dumps(m.variant) if m.variant else "the default tiny preset"
    acceptable = ", ".join((spec.subsystem, *spec.also_acceptable))
    evidence = _table_row(results / "faults.md", fault_id)
    mutation = _table_row(results / "mutation.md", fault_id)
    detectors = _localizing_detectors(fault_id, results)
    lines = [
        f"# Rubric: {spec.title}",
        "",
        f"(fault `{spec.id}`; trigger {spec.trigger}; symptoms {', '.join(spec.symptoms)})",
        "",
        "## 1. Reproduce",
        f"- A strong candidate makes it happen on demand: the `{m.scenario}` scenario, {m.steps} steps, with "
        f"{variant}; seeds {', '.join(map(str, m.seeds))}.",
        f"- `faultbench run --fault {spec.id}` runs it next to the clean run; "
        f"`faultbench run --fault {spec.id} --detectors all` adds the ranked findings.",
        "",
        "## 2. Isolate by subsystem",
        f"- The bug lives in **{spec.subsystem}** (a diagnosis naming {acceptable} is acceptable), in "
        + ", ".join(f"`{s}`" for s in spec.seams) + ".",
        "- Credit for narrowing down by experiment (a smaller batch, fp32 vs fp16, no padding vs left padding, "
        "one rank vs two, with vs without resume) rather than by reading code at random.",
        "",
        "## 3. Instrument: the check that exposes it and the metric that shows it",
        f"- Manifest check `{m.check}` {json.dumps(m.params) if m.params else ''}".rstrip()
        + (f": {evidence[-1]}" if evidence else "."),
    ]
    if detectors:
        lines.append("- Detectors that localize it first on every bench seed: "
                     + ", ".join(f"`{d}`" for d in detectors) + " (`faultbench detectors` says what each checks).")
    lines += [
        "",
        "## 4. Fix",
        f"- What is wrong: {spec.explanation}",
        f"- The fix: {spec.fix}",
        f"- `faultbench show {spec.id}` prints the diff against the clean seam.",
        "",
        "## 5. Prevent",
    ]
    if mutation:
        lines.append(f"- A regression test that fails with this bug in place: `{mutation[-1]}` (tests/model or "
                     "tests/distributed; `make mutation` lists them for every fault).")
    lines += [
        "- A strong answer proposes a test of the seam's contract (not of this one symptom), so the whole class "
        "of bug is caught.",
        "",
        "## The real bug it models",
        *[f"- {ref}" for ref in spec.references],
    ]
    return "\n".join(lines) + "\n"
