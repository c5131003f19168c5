"""Registry hygiene, the unknown-id error, and the diff of every fault."""

import ast
import collections
import inspect
import re
from pathlib import Path

import pytest

from faultbench.faults import registry
from faultbench.faults.inject import diff, fault_function_source, seam_function_source
from faultbench.faults.registry import (
    SUBSYSTEMS,
    TRIGGERS,
    FaultError,
    Manifest,
    all_faults,
    fault,
    get_fault,
    seam_table,
)

FAULTS = all_faults(None)  # every target's
FAULT_IDS = sorted(FAULTS)
FAULTS_DIR = Path(__file__).resolve().parents[2] / "faults"
# a reference points at something a reader can find: a quoted title, an issue or PR number, a repository or
# file path, a year, a URL, or a code name (dotted, snake_case or CamelCase)
REFERENCE_POINTER = re.compile(r"'[^']{4,}'|#\d+|[\w.-]+/[\w.-]+|\b(19|20)\d\d\b|https?://|\b[A-Za-z_]\w*\.[A-Za-z_]\w*"
                               r"|\w+_\w+|\b[A-Z][a-z]+[A-Z]\w*")


def _source_fault_ids() -> list[tuple[str, str]]:
    """(path under faults/, id) of every ``@fault("id", ...)`` decorator written in the fault modules of every
    target (the reference's in ``faults/*.py``, another target's in ``faults/<target>/``)."""
    found = []
    for path in sorted(FAULTS_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            for dec in getattr(node, "decorator_list", ()):
                if isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == "fault":
                    found.append((str(path.relative_to(FAULTS_DIR)), dec.args[0].value))
    return found


def test_ids_are_snake_case_and_match_their_key():
    for key, spec in FAULTS.items():
        assert key == spec.id and spec.id.isidentifier() and spec.id == spec.id.lower()


def test_each_id_is_written_once_across_the_fault_modules_and_every_one_registers():
    # the registry is keyed by id: two definitions of one id (on any target), or a module the builtin list
    # forgets, only show in the source
    written = _source_fault_ids()
    counts = collections.Counter(i for _, i in written)
    twice = {i: [f for f, j in written if j == i] for i, n in counts.items() if n > 1}
    assert not twice, f"fault ids defined more than once: {twice}"
    builtin = {i for i, s in FAULTS.items() if s.replacements[s.seams[0]].__module__.startswith("faultbench.faults.")}
    assert builtin == {i for _, i in written}


def test_registering_an_existing_id_is_refused_and_keeps_the_first():
    taken = FAULT_IDS[0]
    original = registry.FAULTS[taken]

    def truncate(ids, max_len, eos_id):
        """Returns the ids unchanged."""
        return ids

    with pytest.raises(FaultError, match=f"fault id '{taken}' is registered twice"):
        fault(taken, seam="model.data.truncate", title="t" * 30, subsystem="data", trigger="always",
              symptoms=("silent-quality",), explanation="e" * 30, fix="f" * 30, references=("r" * 30,),
              manifest=Manifest(check="crash"))(truncate)
    assert registry.FAULTS[taken] is original


def test_titles_are_unique():
    by_title = collections.defaultdict(list)
    for spec in FAULTS.values():
        by_title[spec.title.casefold()].append(spec.id)
    assert not {t: ids for t, ids in by_title.items() if len(ids) > 1}


@pytest.mark.parametrize("fault_id", FAULT_IDS)
def test_metadata_is_complete(fault_id):
    spec = FAULTS[fault_id]
    acceptable = (spec.subsystem, *spec.also_acceptable)
    assert set(acceptable) <= set(SUBSYSTEMS) and spec.subsystem not in spec.also_acceptable
    # every replaced seam is a location a diagnosis may name: its subsystem must be acceptable too
    table = seam_table(spec.target)
    assert spec.seams and {s: table.get(s) for s in spec.seams if table.get(s) not in acceptable} == {}
    assert spec.trigger in TRIGGERS and spec.symptoms
    assert all(len(x) > 20 for x in (spec.title, spec.explanation, spec.fix))
    assert spec.references and len(set(spec.references)) == len(spec.references)
    assert [r for r in spec.references if len(r) < 25 or not REFERENCE_POINTER.search(r)] == []
    assert set(spec.replacements) == set(spec.seams)


@pytest.mark.parametrize("fault_id", FAULT_IDS)
def test_diff_is_nonempty_and_touches_only_the_fault_seams(fault_id):
    spec = FAULTS[fault_id]
    text = diff(fault_id)
    assert text.strip(), "empty diff: the fault changes nothing"
    headers = [line for line in text.splitlines() if line.startswith("+++ ")]
    assert [h.split("(")[-1].rstrip(")") for h in headers] == list(spec.seams)
    for seam, fn in spec.replacements.items():
        assert seam_function_source(seam) != fault_function_source(seam, fn)


def test_registration_refuses_a_changed_signature_or_default():
    # the spliced copy keeps the seam's header, so a fault whose signature differs could not be spliced
    def register(fn):
        return fault("tmp_signature_probe", seam="model.data.truncate", title="t" * 30, subsystem="data",
                     trigger="always", symptoms=("silent-quality",), explanation="e" * 30, fix="f" * 30,
                     references=("r",), manifest=Manifest(check="crash"))(fn)

    def other_default(ids, max_len, eos_id=2):
        """Changes a default."""
        return ids

    def other_name(ids, max_len, eos):
        """Renames a parameter."""
        return ids

    for fn in (other_default, other_name):
        with pytest.raises(FaultError, match="signature of model.data.truncate"):
            register(fn)
    assert "tmp_signature_probe" not in FAULTS


@pytest.mark.parametrize("fault_id", FAULT_IDS)
def test_spliced_function_hides_the_fault(fault_id):
    spec = FAULTS[fault_id]
    for seam, fn in spec.replacements.items():
        text = fault_function_source(seam, fn)
        # lines the fault adds (the seam's own docstring may say "inject", as one of transformers' does)
        added = "\n".join(set(text.splitlines()) - set(seam_function_source(seam).splitlines()))
        assert not re.search(r"\bfault|inject", added, re.IGNORECASE)
        assert inspect.getdoc(fn) not in text  # the explanation stays in the registry


def test_unknown_id_suggests_the_closest():
    some_id = FAULT_IDS[0]
    with pytest.raises(FaultError, match=rf"did you mean '{some_id}'"):
        get_fault(some_id[:-1] + "x")
    with pytest.raises(FaultError, match="unknown fault id"):
        get_fault("no_such_thing_at_all")


@pytest.mark.parametrize("target", sorted({f.target for f in FAULTS.values()}))
def test_every_subsystem_and_trigger_has_a_fault(target):
    faults = [f for f in FAULTS.values() if f.target == target]
    assert set(SUBSYSTEMS) - {f.subsystem for f in faults} == set()
    if target == "ref":  # the HF target on CPU cannot run an fp16 scaler; its triggers are listed in the README
        assert set(TRIGGERS) - {f.trigger for f in faults} == set()


# the run a manifest asks for must hold the trigger's condition, or the proof runs where the fault cannot act
def _precision(m) -> str:
    """The precision a manifest's run uses: the reference's ``train`` section, or an HF recipe's field (given,
    or that of the recipe the variant starts from)."""
    if "train" in m.variant:
        return m.variant["train"].get("precision", "fp32")
    if "precision" in m.variant or "recipe" not in m.variant:
        return m.variant.get("precision", "fp32")
    from faultbench.targets.hf.recipes import RECIPES

    return RECIPES[m.variant["recipe"]].precision


TRIGGER_CONDITIONS = {
    "amp-only": lambda m: _precision(m) != "fp32",
    "multi-rank": lambda m: m.scenario.startswith("ddp"),
    "on-resume": lambda m: m.scenario.endswith("resume"),
}


@pytest.mark.parametrize("fault_id", [f for f in FAULT_IDS if FAULTS[f].trigger in TRIGGER_CONDITIONS])
def test_manifest_runs_where_the_trigger_holds(fault_id):
    spec = FAULTS[fault_id]
    assert TRIGGER_CONDITIONS[spec.trigger](spec.manifest), (spec.trigger, spec.manifest)
