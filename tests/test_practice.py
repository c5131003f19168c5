"""Practice mode: one full exercise round trip per symptom class, grading, difficulty and hints.

Leak checks over every fault (splice only) are in test_practice_export.py, sessions in
test_practice_session.py, the rubric in test_practice_rubric.py. Grading tests share one exercise (a
crash at step 0: the cheapest to make) and copy its key (and its folder where they edit it).
"""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from faultbench.detectors.api import SUBSYSTEMS
from faultbench.faults.registry import all_faults
from faultbench.harness import practice, sandbox
from faultbench.harness.cli import main
from faultbench.harness.practice_level import DIFFICULTIES, NO_MORE_HINTS, difficulty, hints, readme_evidence
from faultbench.harness.practice_offer import repair

FAULTS = all_faults("ref")
RESULTS = practice.RESULTS
# one cheap fault per symptom class a candidate meets first (practice_level.symptom_class)
ROUND_TRIPS = {
    "crash": "ignore_index_mismatch",
    "nan": "mask_keep_convention_in_attention",  # fp32: the fp16 path is the quality one's
    "stall": "probs_then_log_softmax",
    "divergence": "optimizer_state_not_restored",  # a resume: the extra uninterrupted curve too
    "eval-metric": "loss_sum_reduction",
    "quality": "missing_unscale_before_clip",  # fp16 and hard: its README must not show the scaled norm
    "desync": "no_sync_on_last_micro_batch",  # two gloo ranks
}


def folder_check(folder: Path) -> subprocess.CompletedProcess:
    """``python check.py`` as the candidate runs it: cwd the folder, nothing of the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-I", "check.py"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.parametrize("symptom", sorted(ROUND_TRIPS))
def test_round_trip_per_symptom_class(tmp_path, symptom):
    """new -> the README shows the symptom (and only what the level allows) -> the folder's own check.py
    fails on the broken copy -> the clean functions spliced back -> check says repaired (exit 0)."""
    from faultbench.harness.practice_level import symptom_class

    spec = FAULTS[ROUND_TRIPS[symptom]]
    assert symptom_class(spec) == symptom
    ex = practice.new_exercise(tmp_path / "ex", fault=spec.id, keys=tmp_path / "keys")
    readme = (ex / "README.md").read_text()
    assert "python train.py" in readme and (ex / "loss.png").stat().st_size > 0
    assert str(tmp_path) not in readme  # paths of this machine are scrubbed
    if difficulty(spec, RESULTS) == "hard":
        assert "grad_norm" not in readme and "scale" not in readme

    if symptom != "desync":  # two ranks: its broken run is judged by `practice validate` (test_practice_offer.py)
        broken = folder_check(ex)
        assert broken.returncode == 1 and broken.stdout.startswith("FAIL"), broken.stdout + broken.stderr

    repair(ex, spec)
    # the interviewer's stricter scenario comparison costs a run: test_check_uses_the_folders_own_train_py has it
    isolated = sandbox.unavailable() is None  # namespaces where the machine allows them (test_practice_sandbox.py)
    assert practice.check(ex, keys=tmp_path / "keys", strict=False) == {"code": 0, "problems": [],
                                                                        "isolated": isolated}


# ---- grading -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, Path]:
    """One exercise (a crash at step 0) and its keys folder, shared read-only by the grading tests."""
    root = tmp_path_factory.mktemp("made")
    folder = practice.new_exercise(root / "ex", fault="ignore_index_mismatch", keys=root / "keys")
    return folder, root / "keys"


@pytest.fixture
def ex(made, tmp_path) -> tuple[Path, Path]:
    """The shared exercise with a fresh copy of its key (the events start empty)."""
    folder, keys = made
    shutil.copytree(keys, tmp_path / "keys")
    return folder, tmp_path / "keys"


@pytest.fixture
def ex_copy(made, tmp_path) -> tuple[Path, Path]:
    """A copy of the shared exercise's folder and key, to edit."""
    folder, keys = made
    shutil.copytree(folder, tmp_path / "ex")
    shutil.copytree(keys, tmp_path / "keys")
    return tmp_path / "ex", tmp_path / "keys"


def _events(folder, keys) -> list[dict]:
    return practice.load_key(folder, keys)[0]["events"]


def test_check_cannot_run_a_broken_train_py(ex_copy):
    folder, keys = ex_copy
    (folder / "train.py").write_text((folder / "train.py").read_text() + "\ndef broken(:\n")
    result = practice.check(folder, keys=keys)
    assert result["code"] == 2 and "train.py is not valid Python" in result["problems"][0]
    assert _events(folder, keys)[-1] == {**_events(folder, keys)[-1], "kind": "check", "code": 2}


def test_check_uses_the_folders_own_train_py(ex_copy):
    """A train.py that fails to import is 'cannot run' (2); one that fakes the healthy log passes the folder's
    check.py (it only sees the log) but not the interviewer's check, which runs the copy's own scenario; an
    edited healthy_run.json fools only the folder's check.py."""
    folder, keys = ex_copy
    (folder / "train.py").write_text("import no_such_module\n")
    assert practice.check(folder, keys=keys)["code"] == 2
    healthy = json.loads((folder / "healthy_run.json").read_text())
    fake = [f"step {i:4d}  loss {x:.4f}" for i, x in enumerate(healthy["losses"])]
    fake.append(f"validation loss {healthy['validation']:.4f}")
    (folder / "train.py").write_text(f"print({chr(10).join(fake)!r})\n")
    assert folder_check(folder).returncode == 0
    result = practice.check(folder, keys=keys)
    assert result["code"] == 1 and result["problems"]
    (folder / "train.py").write_text("print('step    0  loss 1.0000')\n")
    (folder / "healthy_run.json").write_text(json.dumps({**healthy, "losses": [1.0], "validation": None}))
    assert folder_check(folder).returncode == 0
    assert practice.check(folder, keys=keys, strict=False)["code"] == 1


def test_answer_refuses_unknown_names_without_recording(ex):
    folder, keys = ex
    with pytest.raises(ValueError, match="unknown subsystem 'los'; did you mean 'loss'"):
        practice.answer(folder, "los", keys=keys)
    with pytest.raises(ValueError, match="unknown function 'lm_los'; did you mean 'lm_loss'"):
        practice.answer(folder, "loss", "lm_los", keys=keys)
    with pytest.raises(ValueError, match="'forward' is ambiguous: .*model.gpt.GPT.forward"):
        practice.answer(folder, "model", "forward", keys=keys)
    assert _events(folder, keys) == []


def test_answer_accepts_a_unique_short_name(ex):
    folder, keys = ex
    assert practice.resolve_seam("apply_rope") == "model.rope.apply_rope"
    assert practice.resolve_seam("KVCache.update") == "model.gpt.KVCache.update"
    assert practice.answer(folder, "loss", "lm_loss", keys=keys) == {
        "scored": True, "subsystem": "right", "seam": "right", "hints_used": 0, "late": False, "left": 2}
    wrong = next(s for s in SUBSYSTEMS if s not in ("loss", *FAULTS["ignore_index_mismatch"].also_acceptable))
    assert practice.answer(folder, wrong, "apply_rope", keys=keys)["subsystem"] == "wrong"
    assert [e["verdict_seam"] for e in _events(folder, keys)] == ["right", "wrong"]


def test_answers_after_reveal_are_recorded_not_scored(ex):
    folder, keys = ex
    assert "What is wrong" in practice.reveal(folder, keys=keys)
    assert practice.answer(folder, "loss", "lm_loss", keys=keys)["scored"] is False
    kinds = [(e["kind"], e.get("scored")) for e in _events(folder, keys)]
    assert kinds == [("reveal", None), ("answer", False)]


def test_cli_answer_typo_is_one_line_and_check_exit_code(ex, capsys):
    folder, keys = ex
    assert main(["practice", "answer", str(folder), "--subsystem", "maks", "--keys", str(keys)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "did you mean 'mask'" in err
    assert main(["practice", "answer", str(folder), "--subsystem", "loss", "--seam", "lm_loss", "--keys",
                 str(keys)]) == 0
    assert "subsystem: right; function: right (hints used: 0; answers left: 2)" in capsys.readouterr().out


# ---- hints and difficulty ----------------------------------------------------------------------------

def test_hints_are_staged_then_say_there_are_no_more(ex):
    folder, keys = ex
    spec = FAULTS["ignore_index_mismatch"]
    given = [practice.hint(folder, keys=keys) for _ in range(4)]
    assert "Hint 1" in given[0] and "Hint 2" not in given[0]
    assert "`loss`" in given[1] and "`lm_loss` in `model/loss.py`" in given[2]
    assert given[3] == NO_MORE_HINTS
    assert [e["stage"] for e in _events(folder, keys)] == [1, 2, 3] and given[2] == "\n".join(hints(spec))


def test_first_hint_is_specific_to_the_symptom_class_and_trigger():
    first = {f: hints(spec)[0] for f, spec in FAULTS.items()}
    assert len(set(first.values())) >= 12  # not one generic text
    assert "uninterrupted" in first["sampler_state_not_restored"] and "two processes" in first["sampler_ignores_rank"]
    assert "fp32" in first["missing_unscale_before_clip"] and "traceback" in first["ignore_index_mismatch"]


def _log(rows, validation=5.0):
    return "".join(f"step {i:4d}  loss {loss:.4f}  grad_norm {g:.4f}  lr {lr:.2e}  scale 1\n"
                   for i, (loss, g, lr) in enumerate(rows)) + f"validation loss {validation}\n"


HEALTHY = _log([(5.5, 3.0, 1e-4), (5.4, 2.9, 2e-4), (5.3, 2.8, 3e-4), (5.2, 2.7, 4e-4)])


@pytest.mark.parametrize("rows, validation, fault_id, says, not_says", [
    # the schedule runs ahead from step 1, the loss parts later: the learning rate, not data or model invariants
    ([(5.5, 3.0, 1e-4), (5.4, 2.9, 5e-4), (5.2, 2.8, 9e-4), (5.1, 2.7, 1e-3)], 5.0, "lr_schedule_horizon_wrong",
     "Hint 1 (schedule)", "padding"),
    # NaN at step 0 from a bug declared as triggered by rare batches: no "only some batches"
    ([(float("nan"), float("nan"), 1e-4)] * 4, 5.0, "mask_keep_convention_in_attention", "Hint 1 (nan)",
     "Only some batches"),
    ([(5.6, 3.0, 1e-4), (5.5, 2.9, 2e-4), (5.4, 2.8, 3e-4), (5.3, 2.7, 4e-4)], 5.0, "label_permute",
     "step 0, before any update", "first 0 step"),
    ([(5.5, 3.0, 1e-4), (5.4, 2.9, 2e-4), (5.3, 2.8, 3e-4), (5.9, 2.7, 4e-4)], 5.0, "optimizer_state_not_restored",
     "The first 3 step(s) match", "step 0, before"),
    ([(5.5, 3.0, 1e-4), (5.4, 2.9, 2e-4), (5.3, 2.8, 3e-4), (5.2, 2.7, 4e-4)], 4.2, "eval_in_train_mode",
     "Hint 1 (eval-metric)", "learning rate"),
])
def test_first_hint_follows_what_the_run_shows(rows, validation, fault_id, says, not_says):
    from faultbench.harness.practice_level import shown

    first = hints(FAULTS[fault_id], shown(_log(rows, validation), 0, HEALTHY))[0]
    assert says in first and not_says not in first, first


def test_an_exercise_hands_the_measured_first_hint(tmp_path):
    """A real schedule bug: the key keeps what the run showed, and the candidate's first hint is about the
    learning rate (the declared "silent-quality" would have sent them to padding and causal masks)."""
    folder = practice.new_exercise(tmp_path / "ex", fault="lr_schedule_horizon_wrong", keys=tmp_path / "keys")
    first = practice.hint(folder, keys=tmp_path / "keys")
    assert first.startswith("Hint 1 (schedule)") and "padding" not in first
    assert "padding" in hints(FAULTS["lr_schedule_horizon_wrong"])[0]  # the declared class's text


def test_hard_readme_shows_no_gradient_norm_or_scale():
    """The unscale-before-clip case is solved by dividing the logged norm by the scale: a hard README shows the
    loss column only, and of the healthy run only its end numbers."""
    log = "step    0  loss 5.5326  grad_norm 208118.1700  lr 1.50e-03  scale 65536\nvalidation loss 5.1\n"
    healthy = "step    0  loss 5.5326  grad_norm 3.1757  lr 1.50e-03  scale 65536\nvalidation loss 5.0\n"
    theirs, ref = readme_evidence("hard", log, healthy)
    assert theirs == ["step 0 loss 5.5326", "validation loss 5.1"] and ref == ["validation loss 5.0"]
    assert "3.1757" in "".join(readme_evidence("easy", log, healthy)[1])
    assert difficulty(FAULTS["missing_unscale_before_clip"], RESULTS) == "hard"


def _bench(folder: Path, fault_id: str, localizing: int) -> Path:
    """A results folder whose bench has ``localizing`` of 6 detectors localizing the fault on both seeds."""
    folder.mkdir()
    with (folder / "bench.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["fault", "detector", "rr_subsystem"])
        writer.writeheader()
        for i in range(6):
            for _seed in range(2):
                writer.writerow({"fault": fault_id, "detector": f"d{i}", "rr_subsystem": float(i < localizing)})
    return folder


def test_difficulty_follows_the_measured_signals(tmp_path):
    """Same trigger and symptom: a fault that many detectors localize is easier, one a single detector
    localizes harder, than the unbenched costs say."""
    rank = DIFFICULTIES.index
    always = FAULTS["label_permute"]  # always + silent quality: medium unbenched
    assert rank(difficulty(always, _bench(tmp_path / "loud", always.id, 5))) < rank(difficulty(always, tmp_path))
    amp = FAULTS["missing_unscale_before_clip"]  # amp-only + silent quality: medium unbenched
    assert rank(difficulty(amp, tmp_path)) < rank(difficulty(amp, _bench(tmp_path / "quiet", amp.id, 1)))
    levels = [difficulty(s, RESULTS) for s in FAULTS.values()]
    assert all(levels.count(level) >= 5 for level in DIFFICULTIES), levels


def test_an_intermittent_crash_is_harder_than_an_immediate_nan():
    rank = DIFFICULTIES.index
    assert rank(difficulty(FAULTS["mask_dtype_unpadded"], RESULTS)) > rank(difficulty(FAULTS["fp16_mask_constant"],
                                                                                          RESULTS))


def test_hidden_choice_is_seeded_and_filtered():
    from faultbench.harness.practice import choose_fault

    assert choose_fault(7, None, "mask", None) == choose_fault(7, None, "mask", None)
    masks = {choose_fault(seed, None, "mask", None) for seed in range(20)}
    assert len(masks) > 1 and {FAULTS[f].subsystem for f in masks} == {"mask"}
    hard = {choose_fault(seed, None, None, "hard") for seed in range(20)}
    assert len(hard) > 1 and {difficulty(FAULTS[f], RESULTS) for f in hard} == {"hard"}
    with pytest.raises(ValueError, match="no fault matches"):
        choose_fault(0, None, "no-such-subsystem", None)
    with pytest.raises(ValueError, match="difficulty must be one of"):
        choose_fault(0, None, None, "impossible")


def test_export_archive_keeps_uniform_times(made, tmp_path):
    import tarfile

    folder, keys = made
    archive = practice.export_archive(folder, tmp_path / "ex.tar.gz", keys)
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
    assert {m.mtime for m in members} == {int(folder.stat().st_mtime)}
    assert {re.sub(r"^ex/?", "", m.name) for m in members} >= {"README.md", "check.py", "train.py", "model/gpt.py"}
