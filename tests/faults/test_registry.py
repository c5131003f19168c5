"""Registry hygiene, the unknown-id error, and the diff of every fault."""

import inspect
import re

import pytest

from faults.inject import diff, fault_function_source, seam_function_source
from faults.registry import SUBSYSTEMS, TRIGGERS, FaultError, all_faults, get_fault
from model.seams import SEAMS

FAULTS = all_faults()
FAULT_IDS = sorted(FAULTS)


def test_ids_are_unique_snake_case_and_match_their_key():
    for key, spec in FAULTS.items():
        assert key == spec.id and spec.id.isidentifier() and spec.id == spec.id.lower()


@pytest.mark.parametrize("fault_id", FAULT_IDS)
def test_metadata_is_complete(fault_id):
    spec = FAULTS[fault_id]
    assert spec.subsystem in SUBSYSTEMS and set(spec.also_acceptable) <= set(SUBSYSTEMS)
    assert spec.seams and all(s in SEAMS for s in spec.seams)
    assert spec.trigger in TRIGGERS and spec.symptoms
    assert all(len(x) > 20 for x in (spec.title, spec.explanation, spec.fix))
    assert spec.references and all(r.strip() for r in spec.references)
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
    from faults.registry import Manifest, fault

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
        assert not re.search(r"\bfault|inject", text, re.IGNORECASE)
        assert inspect.getdoc(fn) not in text  # the explanation stays in the registry


def test_unknown_id_suggests_the_closest():
    some_id = FAULT_IDS[0]
    with pytest.raises(FaultError, match=rf"did you mean '{some_id}'"):
        get_fault(some_id[:-1] + "x")
    with pytest.raises(FaultError, match="unknown fault id"):
        get_fault("no_such_thing_at_all")


def test_every_subsystem_has_at_least_three_faults():
    counts = {s: sum(f.subsystem == s for f in FAULTS.values()) for s in SUBSYSTEMS}
    assert min(counts.values()) >= 3, counts
    assert len(FAULTS) >= 45


def test_intermittent_triggers_are_represented():
    assert sum(f.trigger != "always" for f in FAULTS.values()) >= 8
