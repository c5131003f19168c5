"""The mutant set: generation is deterministic, the committed admitted set meets its goals and still matches the
seams, its mutants register and splice like any fault, and admission re-admits a sample (CI's share of
``faultbench mutate --admit``, which takes half an hour)."""

from __future__ import annotations

import ast
import sys
import textwrap
from collections import Counter

import pytest

from faultbench.faults.mutants import VERSION
from faultbench.faults.mutants.generate import by_id, candidates, register
from faultbench.faults.mutants.operators import OPERATORS
from faultbench.faults.registry import FAULTS, Manifest, get_fault, load_plugin
from faultbench.harness import mutants
from faultbench.harness.matcher import recipe_for
from faultbench.model.seams import SUBSYSTEMS

DOC = mutants.read()
ADMITTED = DOC["mutants"]


@pytest.fixture(autouse=True)
def registry_as_it_was():
    """Mutants registered by a test leave with it: another test of this worker may list every fault."""
    saved, modules = dict(FAULTS), set(sys.modules)
    yield
    FAULTS.clear()
    FAULTS.update(saved)
    for name in set(sys.modules) - modules:
        if name.startswith("faultbench_mutants_") or name.startswith("faultbench.faults.mutants."):
            del sys.modules[name]


def test_generation_is_deterministic_and_every_candidate_is_a_distinct_change():
    first, again = candidates("ref"), candidates("ref")
    assert [c.id for c in first] == [c.id for c in again]
    assert len({c.id for c in first}) == len(first)
    assert {c.operator for c in first} == set(OPERATORS)  # every operator finds sites in the reference
    for c in first:
        ast.parse(textwrap.dedent(c.function))
        assert c.diff.count("\n-") >= 1 or c.diff.count("\n+") >= 1, c.id
    assert len({c.function for c in first}) == len(first)  # no two candidates write the same code


def test_the_admitted_set_meets_its_goals():
    """>= 400 mutants over both targets and all 11 subsystems, each operator's admit rate counted."""
    assert DOC["version"] == VERSION
    assert len(ADMITTED) >= 400
    assert {m["target"] for m in ADMITTED} == {"ref", "hf"}
    assert {m["subsystem"] for m in ADMITTED} == set(SUBSYSTEMS)
    counted = Counter((t, op) for t, d in DOC["targets"].items() for op, s in d["operators"].items()
                      for _ in range(s.get("admitted", 0)))
    assert counted == Counter((m["target"], m["operator"]) for m in ADMITTED)
    for row in mutants.admission_table(DOC, ("ref", "hf")):  # every candidate run is accounted for
        assert row["run"] == row["refused"] + row["hang"] + row["not_shown"] + row["duplicate"] + row["admitted"], row
        assert 0 < row["run"] <= row["candidates"] - row["unreached"], row


@pytest.mark.parametrize("target", ["ref", "hf"])
def test_every_admitted_mutant_still_matches_its_seam_and_lands_in_its_recipe(target):
    """The recorded digest of each admitted mutant is the generator's today (a changed seam makes it stale: re-admit
    with `make mutants`), and the matcher puts its manifest in the recipe it was admitted in."""
    generated = by_id(target)
    for m in (m for m in ADMITTED if m["target"] == target):
        c = generated.get(m["id"])
        assert c is not None, f"{m['id']} is no longer generated: re-admit the set (make mutants)"
        assert mutants.hashlib.sha256(c.function.encode()).hexdigest()[:16] == m["digest"], m["id"]
        assert recipe_for(Manifest(check="bench_behaviour", **m["manifest"]), target) == m["recipe"], m["id"]


def test_the_admitted_plugin_registers_every_mutant_as_a_fault_that_splices_and_diffs():
    from faultbench.faults.inject import diff, spliced_sources
    from faultbench.faults.mutants import admitted

    load_plugin(mutants.ADMITTED_PLUGIN)
    assert admitted.STALE == []
    for m in ADMITTED[:: max(1, len(ADMITTED) // 40)]:  # a spread sample: each diff reads the seam's file
        spec = get_fault(m["id"])
        assert (spec.subsystem, spec.seams, spec.target) == (m["subsystem"], (m["seam"],), m["target"])
        changed = lambda text: [line for line in text.splitlines() if line[:1] in "+-" and line[:3] not in "+++---"]
        assert changed(diff(m["id"])) == changed(m["diff"])
        if m["target"] == "ref":
            (text,) = spliced_sources([m["id"]]).values()
            ast.parse(text)


def test_a_candidate_whose_body_uses_a_name_its_module_lacks_is_refused_not_registered():
    c = next(c for c in candidates("ref") if c.operator == "cast")
    bad = type(c)(**{**vars(c), "id": c.id + "_bad", "function": c.function.replace(
        c.function.splitlines()[-1], c.function.splitlines()[-1].rstrip() + " + undefined_name_xyz")})
    refused = register([(bad, {"manifest": {}})])
    assert list(refused) == [bad.id] and "undefined_name_xyz" in refused[bad.id]


def test_admission_readmits_a_sample_and_rejects_the_equivalent_and_the_duplicate():
    """A duplicate pair and one more admitted mutant of the reference (fp32) come back admitted with their
    symptoms; a candidate admission found equivalent is rejected as not shown, the duplicate as a duplicate of the
    same mutant."""
    rejected = DOC["targets"]["ref"]["rejected"]
    fp32 = {m["id"]: m for m in ADMITTED if m["target"] == "ref" and m["recipe"] == "fp32"}
    duplicate, of = next((i, r["duplicate_of"]) for i, r in rejected.items()
                         if r["stage"] == "duplicate" and r["recipe"] == "fp32" and r["duplicate_of"] in fp32)
    equivalent = next(i for i, r in rejected.items() if r["recipe"] == "fp32" and r["seeds_shown"] == [])
    admitted = [of, *[i for i in fp32 if i != of][:1]]
    generated = by_id("ref")
    order = {i: n for n, i in enumerate(generated)}  # candidate order: the first of a duplicate pair is kept
    chosen = [generated[i] for i in sorted({*admitted, equivalent, duplicate}, key=order.__getitem__)]
    register([(c, {"manifest": mutants.manifest_for("ref", "fp32")}) for c in chosen])
    stats, why = {op: Counter() for op in OPERATORS}, {}
    out = mutants._show_and_dedup("ref", chosen, {c.id: "fp32" for c in chosen}, 2, 120.0, stats, False, why)
    assert {c.id: list(sym) for c, sym, _ in out} == {i: fp32[i]["symptoms"] for i in admitted}
    assert why[equivalent]["stage"] == "not_shown"
    assert why[duplicate] == {**rejected[duplicate]}
