"""Timed practice sessions on an injectable clock: start, status, history, the kept report.

The exercise folder is splice-only with a hand-written key (no training run): sessions read only the key's
events. ``check`` is taken with the runs stubbed (its behaviour is test_practice.py's).
"""

import json

import pytest

from faultbench.harness import practice, practice_runs, practice_session
from faultbench.harness.cli import main
from faultbench.harness.practice_log import folder_secret, sealed
from faultbench.harness.rubric import BANDS, DIMENSIONS


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def session(tmp_path):
    """A splice-only exercise of label_permute with its key made at t=1000."""
    folder = practice.build_folder(tmp_path / "ex", "label_permute")
    practice.write_key(folder, tmp_path / "keys", {"fault": "label_permute", "seed": None, "args": [],
                                                   "difficulty": "medium", "candidate": "Ada", "max_answers": 3},
                       1000.0)
    return folder, tmp_path / "keys", Clock()


def key_path(folder, keys):
    return practice.load_key(folder, keys)[1]


def test_a_session_from_start_to_repair(session, monkeypatch):
    folder, keys, clock = session
    clock.t = 1060
    practice_session.start(folder, 30, keys, clock)
    with pytest.raises(ValueError, match="has started already"):
        practice_session.start(folder, 30, keys, clock)
    clock.t += 120
    practice.hint(folder, keys, clock)
    clock.t += 180
    practice.answer(folder, "mask", keys=keys, clock=clock)  # wrong: 5 min in
    clock.t += 300
    practice.answer(folder, "loss", keys=keys, clock=clock)  # right subsystem: 10 min in
    clock.t += 300
    practice.answer(folder, "loss", "forward_loss", keys=keys, clock=clock)  # right function: 15 min in
    log = "step    0  loss 5.0000\nvalidation loss 4.0000\n"  # the copy's run, and the healthy one, stubbed
    monkeypatch.setattr(practice_runs, "candidate_train", lambda *args: (log, 0, True))
    monkeypatch.setattr(practice, "_healthy", lambda args: (log, 0))
    clock.t += 600
    assert practice.check(folder, keys, clock, strict=False)["code"] == 0  # repaired: 25 min in
    assert practice_session.status(folder, keys, clock) == \
        "25.0 min used, 5.0 min left; hints 1/3, answers 3, checks 1; repaired"

    clock.t += 600
    row = practice_session.summary(practice.load_key(folder, keys)[0], clock())
    assert row | {"elapsed_s": 0, "folder": None} == {
        "fault": "label_permute", "difficulty": "medium", "candidate": "Ada", "folder": None, "elapsed_s": 0,
        "budget_s": 1800, "over_budget": True, "stopped": False, "late": 0, "score": None,
        "attempts": 3, "hints": 1, "checks": 1, "reveals": 0, "after_reveal": 0,
        "to_subsystem_s": 600, "to_seam_s": 900, "to_repair_s": 1500, "altered": False}
    assert "over budget by 5.0 min" in practice_session.status(folder, keys, clock)
    report = practice_session.report(folder, keys, clock)
    assert "to the right subsystem 10.0 min, to the right function 15.0 min, to the repair 25.0 min" in report
    assert "| 10.0 min | answer | `loss`: subsystem right |" in report
    assert "| 25.0 min | check | repaired |" in report


def test_without_start_the_clock_runs_from_the_exercise(session):
    folder, keys, clock = session
    clock.t = 1000 + 90
    assert practice_session.status(folder, keys, clock) == "1.5 min used, no budget set; hints 0/3, answers 0, checks 0"
    with pytest.raises(ValueError, match="positive number of minutes"):
        practice_session.start(folder, 0, keys, clock)


def test_history_lists_every_exercise_with_reveals(session):
    folder, keys, clock = session
    practice.reveal(folder, keys, clock)
    practice.answer(folder, "loss", keys=keys, clock=clock)
    other = dict(json.loads(key_path(folder, keys).read_text()), created=500.0, events=[],
                 difficulty="hard")
    (keys / "fedcba9876543210.json").write_text(json.dumps(sealed(other, folder_secret(keys))))
    rows = practice_session.history(keys, clock)
    assert [(r["difficulty"], r["reveals"], r["attempts"], r["after_reveal"]) for r in rows] == [
        ("hard", 0, 0, 0), ("medium", 1, 0, 1)]
    table = practice_session.history_table(rows)
    head = ("| # | candidate | fault | difficulty | attempts | hints | reveals | to subsystem | to seam | to repair | "
            "score | altered | folder |")
    assert table.splitlines()[0] == head
    assert table.splitlines()[3] == f"| 2 | Ada | label_permute | medium | 0 | 0 | 1 | - | - | - | - | no | {folder} |"


def test_a_key_edited_outside_faultbench_is_reported_for_good(session):
    """A candidate who moves the start of the session (or deletes a hint) by editing the key file breaks its seal:
    status, report and history say so, and the next event faultbench records does not launder it."""
    folder, keys, clock = session
    practice.hint(folder, keys, clock)
    path = key_path(folder, keys)
    assert not practice_session.history(keys, clock)[0]["altered"]
    key = json.loads(path.read_text())
    path.write_text(json.dumps({**key, "events": []}))  # the hint deleted
    assert practice_session.history(keys, clock)[0]["altered"]
    clock.t += 60
    practice.answer(folder, "loss", keys=keys, clock=clock)  # recorded and sealed, with the mark
    assert practice_session.status(folder, keys, clock).endswith("; the key was edited outside faultbench")
    assert "edited outside faultbench" in practice_session.report(folder, keys, clock)
    key = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in key.items() if k != "altered"}))  # removing the mark breaks it too
    assert practice_session.history(keys, clock)[0]["altered"]


def test_cli_start_status_history_report(session, capsys, tmp_path):
    folder, keys, _ = session
    assert main(["practice", "start", str(folder), "--minutes", "45", "--keys", str(keys)]) == 0
    assert main(["practice", "status", str(folder), "--keys", str(keys)]) == 0
    assert "left; hints 0/3" in capsys.readouterr().out
    assert main(["practice", "history", "--keys", str(keys)]) == 0
    assert "| 1 | Ada | label_permute | medium | 0 |" in capsys.readouterr().out
    assert main(["practice", "report", str(folder), "--keys", str(keys), "--out", str(tmp_path / "r.md")]) == 0
    assert (tmp_path / "r.md").read_text().startswith("# Practice session: ")
    assert main(["practice", "start", str(folder), "--minutes", "45", "--keys", str(keys)]) == 2
    assert "has started already" in capsys.readouterr().err


def test_answers_are_capped_and_those_past_the_budget_marked_late(session):
    folder, keys, clock = session
    practice_session.start(folder, 10, keys, clock)
    clock.t += 300
    assert practice.answer(folder, "mask", keys=keys, clock=clock) | {"subsystem": None} == {
        "scored": True, "subsystem": None, "seam": None, "hints_used": 0, "late": False, "left": 2}
    clock.t += 600  # 15 minutes into a 10-minute budget
    assert practice.answer(folder, "optimizer", keys=keys, clock=clock)["late"]
    practice.answer(folder, "loss", keys=keys, clock=clock)
    with pytest.raises(ValueError, match="no answers left: all 3 were used"):
        practice.answer(folder, "loss", "forward_loss", keys=keys, clock=clock)
    assert [e["kind"] for e in practice.load_key(folder, keys)[0]["events"]] == ["start"] + ["answer"] * 3
    report = practice_session.report(folder, keys, clock)
    assert "| 5.0 min | answer | `mask`: subsystem wrong |" in report
    assert "| 15.0 min | answer (late) | `optimizer`: subsystem wrong |" in report
    assert "Scored answers 3 of 3" in report and "events past the budget 2" in report


def test_stop_closes_the_session_and_freezes_its_clock(session):
    folder, keys, clock = session
    clock.t += 120
    practice.stop(folder, keys, clock)
    clock.t += 600
    for move in (lambda: practice.hint(folder, keys, clock), lambda: practice.answer(folder, "loss", keys=keys),
                 lambda: practice.check(folder, keys, clock), lambda: practice.stop(folder, keys, clock),
                 lambda: practice_session.start(folder, 5, keys, clock)):
        with pytest.raises(ValueError, match="was stopped"):
            move()
    assert practice_session.status(folder, keys, clock) == "stopped after 2.0 min; hints 0/3, answers 0, checks 0"
    assert "What is wrong" in practice.reveal(folder, keys, clock)  # the reveal and the report still work
    assert "(stopped)" in practice_session.report(folder, keys, clock)


def test_hints_after_the_reveal_are_not_counted(session):
    folder, keys, clock = session
    practice.hint(folder, keys, clock)
    practice.reveal(folder, keys, clock)
    practice.hint(folder, keys, clock)
    assert practice_session.summary(practice.load_key(folder, keys)[0], clock())["hints"] == 1
    assert "| hint 2 (after the reveal, not counted) |" in practice_session.report(folder, keys, clock)


def test_rubric_scores_give_an_overall_band(session, capsys):
    folder, keys, _ = session
    with pytest.raises(ValueError, match="missing instrument, fix, prevent, example"):
        practice_session.score(folder, {"reproduce": 3, "isolate": 2}, keys)
    with pytest.raises(ValueError, match="each score is 1, 2, 3 or 4"):
        practice_session.score(folder, dict.fromkeys(DIMENSIONS, 5), keys)
    words = ["reproduce=4", "isolate=3", "instrument=3", "fix=4", "prevent=2", "example=2"]
    assert main(["practice", "score", str(folder), *words, "--keys", str(keys)]) == 0
    assert capsys.readouterr().out.strip() == "scored: overall 3.00 of 4 (3: correct, with prompting)"
    report = practice_session.report(folder, keys)
    assert "| prevent | 2 |" in report and "Overall 3.00 of 4: 3: correct, with prompting." in report
    assert main(["practice", "score", str(folder), "reproduce=x", "--keys", str(keys)]) == 2
    assert practice_session.band(3.5) == BANDS[3] and practice_session.band(1.2) == BANDS[0]


def test_the_report_shows_the_candidates_changes(session):
    folder, keys, clock = session
    assert "No change to the handed-over code." in practice_session.report(folder, keys, clock)
    loss = folder / "model" / "train.py"
    loss.write_text(loss.read_text().replace("def forward_loss(", "def forward_loss(  # looked here\n    ", 1))
    report = practice_session.report(folder, keys, clock)
    assert "+++ now/model/train.py" in report and "+def forward_loss(  # looked here" in report
    practice.load_key(folder, keys)[1].with_suffix(".handed").write_text("{}")  # not what was handed over
    assert "no diff" in practice_session.report(folder, keys, clock)


def test_rubric_of_an_exercise_folder(session, capsys):
    folder, keys, _ = session
    assert main(["practice", "rubric", str(folder), "--keys", str(keys)]) == 0
    assert capsys.readouterr().out.startswith("# Rubric: " + practice.get_fault("label_permute").title)
    assert main(["practice", "rubric", "--keys", str(keys)]) == 2
