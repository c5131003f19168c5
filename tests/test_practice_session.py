"""Timed practice sessions on an injectable clock: start, status, history, the kept report.

The exercise folder is splice-only with a hand-written key (no training run): sessions read only the key's
events. ``check`` is taken with the runs stubbed (its behaviour is test_practice.py's).
"""

import json

import pytest

from faultbench.harness import practice, practice_session
from faultbench.harness.cli import main


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
    (folder / ".exercise").write_text(json.dumps({"token": "0123456789abcdef"}))
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "0123456789abcdef.json").write_text(json.dumps({
        "fault": "label_permute", "seed": None, "args": [], "difficulty": "medium", "folder": str(folder),
        "created": 1000.0, "events": []}))
    return folder, tmp_path / "keys", Clock()


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
    monkeypatch.setattr(practice, "run_train", lambda *args: (log, 0))
    monkeypatch.setattr(practice, "_healthy", lambda args: (log, 0))
    clock.t += 600
    assert practice.check(folder, keys, clock, strict=False)["code"] == 0  # repaired: 25 min in
    assert practice_session.status(folder, keys, clock) == \
        "25.0 min used, 5.0 min left; hints 1/3, answers 3, checks 1; repaired"

    clock.t += 600
    row = practice_session.summary(practice.load_key(folder, keys)[0], clock())
    assert row | {"elapsed_s": 0} == {
        "fault": "label_permute", "difficulty": "medium", "elapsed_s": 0, "budget_s": 1800, "over_budget": True,
        "attempts": 3, "hints": 1, "checks": 1, "reveals": 0, "after_reveal": 0,
        "to_subsystem_s": 600, "to_seam_s": 900, "to_repair_s": 1500}
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
    other = dict(json.loads((keys / "0123456789abcdef.json").read_text()), created=500.0, events=[],
                 difficulty="hard")
    (keys / "fedcba9876543210.json").write_text(json.dumps(other))
    rows = practice_session.history(keys, clock)
    assert [(r["difficulty"], r["reveals"], r["attempts"], r["after_reveal"]) for r in rows] == [
        ("hard", 0, 0, 0), ("medium", 1, 0, 1)]
    table = practice_session.history_table(rows)
    head = "| # | difficulty | attempts | hints | reveals | to subsystem | to seam | to repair |"
    assert table.splitlines()[0] == head
    assert table.splitlines()[3] == "| 2 | medium | 0 | 0 | 1 | - | - | - |"


def test_cli_start_status_history_report(session, capsys, tmp_path):
    folder, keys, _ = session
    assert main(["practice", "start", str(folder), "--minutes", "45", "--keys", str(keys)]) == 0
    assert main(["practice", "status", str(folder), "--keys", str(keys)]) == 0
    assert "left; hints 0/3" in capsys.readouterr().out
    assert main(["practice", "history", "--keys", str(keys)]) == 0
    assert "| 1 | medium | 0 |" in capsys.readouterr().out
    assert main(["practice", "report", str(folder), "--keys", str(keys), "--out", str(tmp_path / "r.md")]) == 0
    assert (tmp_path / "r.md").read_text().startswith("# Practice session: ")
    assert main(["practice", "start", str(folder), "--minutes", "45", "--keys", str(keys)]) == 2
    assert "has started already" in capsys.readouterr().err
