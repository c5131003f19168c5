"""Which faults practice offers (harness/practice_offer.py, results/practice_offer.md).

The committed table covers every reference fault once and offers exactly those whose run shows a symptom and whose
reference repair passes; what an offered fault's run shows agrees with the symptom label its first hint is built
from; two rows are reproduced live; ``new`` draws only offered faults and refuses an explicit one that is not.
"""

import pytest

from faultbench.faults.registry import all_faults
from faultbench.harness import offer_table, practice, practice_offer
from faultbench.harness.practice_level import hints, symptom_class

FAULTS = all_faults("ref")


def committed() -> dict[str, dict]:
    return offer_table.read_table()


def test_the_table_covers_every_reference_fault_and_offers_exactly_the_honest_ones():
    rows = committed()
    text = (offer_table.RESULTS / offer_table.TABLE).read_text()
    assert set(rows) == set(FAULTS) and all(text.count(f"| {f} |") == 1 for f in FAULTS)
    for fault_id, row in rows.items():
        honest = row["the run shows"] in ("crash", "nan", "differs") and row["repair passes"] == "yes"
        assert (row["offered"] == "yes") == honest, row
        assert row["symptom label"] == symptom_class(FAULTS[fault_id])
    assert offer_table.offered() == {f for f, r in rows.items() if r["offered"] == "yes"}


def test_every_offered_fault_shows_what_its_first_hint_says():
    """The first hint names the symptom class: a crash hint for a run that shows numbers, or a quality hint for
    one that crashes, would mislead."""
    for fault_id, row in committed().items():
        if row["offered"] == "yes":
            assert row["label matches"] == "yes", row
            assert hints(FAULTS[fault_id])[0].startswith(f"Hint 1 ({row['symptom label']})")


@pytest.mark.parametrize("fault_id", ["amp_no_scaling"])
def test_a_row_is_reproduced_live(fault_id):
    """A precision bug whose run looks healthy (not offered), run again (offered faults are run by the round trips
    of test_practice.py)."""
    live, row = practice_offer.validate_fault(fault_id), committed()[fault_id]
    columns = ("the run shows", "label matches", "repair passes", "offered")
    assert {c: offer_table.cell(live[c]) for c in columns} == {c: row[c] for c in columns}


def test_new_draws_only_offered_faults(tmp_path):
    (tmp_path / offer_table.TABLE).write_text(offer_table.table([
        {"fault": f, "symptom label": "crash", "the run shows": "crash", "label matches": True,
         "repair passes": True, "offered": f != "label_permute", "why not": ""}
        for f in ("ignore_index_mismatch", "label_permute", "pad_id_mismatch")]))
    drawn = {practice.choose_fault(seed, None, None, None, results=tmp_path) for seed in range(40)}
    assert drawn == {"ignore_index_mismatch", "pad_id_mismatch"}
    with pytest.raises(ValueError, match="'label_permute' is not offered"):
        practice.choose_fault(None, "label_permute", None, None, results=tmp_path)


def test_a_seed_draws_by_the_keys_folders_secret():
    """The same seed on two interviewers' machines (two secrets) need not draw the same fault: over 40 seeds, the
    two draws differ somewhere; on one machine a seed always draws the same fault."""
    draw = lambda seed, secret: practice.choose_fault(seed, None, None, None, secret=secret)  # noqa: E731
    assert [draw(s, b"a") for s in range(40)] == [draw(s, b"a") for s in range(40)]
    assert [draw(s, b"a") for s in range(40)] != [draw(s, b"b") for s in range(40)]


def test_validate_refuses_an_id_of_another_target_before_running():
    with pytest.raises(ValueError, match="practice offers reference faults"):
        practice_offer.validate(["hf_label_permute"])
