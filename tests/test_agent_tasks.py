"""Practice exercises as agent tasks (harness/agent_tasks.py): export, the sandboxed runner, grading, the baseline.

Two tasks from crash faults (the cheapest exercises to make); each agent runs on one. An agent that tries to read
the grader, the other tasks, the reference and the docs gets nothing and is graded invalid; one that copies in a
repair is graded repaired; the scripted baseline (faultbench/baseline_agent.py) localizes a crash and repairs nothing.
"""

import json
import shutil

import pytest

from faultbench.faults.registry import get_fault
from faultbench.harness import agent_tasks, sandbox
from faultbench.harness.cli import main
from faultbench.harness.practice_offer import repair

POOL = ["ignore_index_mismatch", "pad_id_mismatch"]
pytestmark = pytest.mark.xdist_group("agent_tasks")  # one worker exports the tasks once


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    if why := sandbox.unavailable():
        pytest.skip(f"no sandbox on this machine: {why}")
    out = tmp_path_factory.mktemp("agent") / "tasks"
    index = agent_tasks.export_tasks(out, 2, seed=0, pool=POOL)
    return out, index


def fault_of(out, task) -> str:
    from faultbench.harness.practice import load_key

    return load_key(out / "tasks" / task, out / "grader")[0]["fault"]


def test_export_writes_tasks_without_their_faults(tasks):
    out, index = tasks
    assert [t["task"] for t in index] == ["task-01", "task-02"]
    assert {fault_of(out, t["task"]) for t in index} == set(POOL)
    for entry in index:
        folder = out / "tasks" / entry["task"]
        assert {"TASK.md", "README.md", "train.py", "check.py"} <= {p.name for p in folder.iterdir()}
        text = "".join(p.read_text() for p in folder.rglob("*") if p.is_file() and p.suffix in (".md", ".json"))
        assert not any(f in text for f in POOL)
    assert not any(f in (out / "tasks.json").read_text() for f in POOL)


def test_an_agent_that_looks_around_gets_nothing(tasks):
    out, _ = tasks
    probe = ("cat ../../../grader/*.json ../../../tasks/*/README.md > stolen.txt 2>/dev/null; "
             f"ls {agent_tasks.ROOT / 'model'} {agent_tasks.ROOT / 'faults'} >> stolen.txt 2>/dev/null; "
             f"cat {agent_tasks.ROOT / 'README.md'} >> stolen.txt; echo not-json > ANSWER.json")
    rows = agent_tasks.run_agent(out, probe, "thief", only=["task-02"])  # the other task is in sight, hidden
    for row in rows:
        assert (row["subsystem"], row["seam"], row["repaired"], row["isolated"]) == ("invalid", "invalid", False, True)
        assert (out / "runs" / "thief" / row["task"] / "stolen.txt").read_text() == ""
    assert "| task-02 | " in (out / "runs" / "thief" / "results.md").read_text()


def test_an_agent_that_repairs_and_answers_is_graded_so(tasks, tmp_path):
    """The fix (the clean functions, prepared outside) reaches the agent through an environment variable it is
    given with --pass-env; the runner's check then passes and the answer is right."""
    out, _ = tasks
    task = "task-01"
    spec = get_fault(fault_of(out, task))
    fixed = tmp_path / "fixed"
    shutil.copytree(out / "tasks" / task, fixed)
    repair(fixed, spec)
    answer = json.dumps({"subsystem": spec.subsystem, "function": spec.seams[0], "tokens": 1234})
    command = f"cp \"$FIX\"/model/*.py model/ && echo '{answer}' > ANSWER.json"
    (row,) = agent_tasks.run_agent(out, command, "fixer", passed={"FIX": str(fixed)}, only=[task])
    assert (row["subsystem"], row["seam"], row["repaired"], row["tokens"]) == ("right", "right", True, 1234)


def test_the_baseline_localizes_a_crash_and_repairs_nothing(tasks):
    out, _ = tasks
    (row,) = agent_tasks.run_agent(out, "{python} -m faultbench.baseline_agent", "baseline", only=["task-02"])
    spec = get_fault(fault_of(out, "task-02"))
    assert row["subsystem"] in ("right", "acceptable") and not row["repaired"] and not row["timed_out"]
    said = json.loads((out / "runs" / "baseline" / "task-02" / "ANSWER.json").read_text())
    assert said["subsystem"] in (spec.subsystem, *spec.also_acceptable)


def test_the_runner_refuses_bad_input_in_one_line(tasks, tmp_path, capsys):
    out, _ = tasks
    for argv, says in (([str(tmp_path), "--command", "true", "--name", "x"], "no exported tasks"),
                       ([str(out), "--command", "true", "--name", "../x"], "names a folder"),
                       ([str(out), "--command", "true", "--name", "x", "--only", "task-99"], "no task 'task-99'"),
                       ([str(out), "--command", "true", "--name", "x", "--pass-env", "FAULTBENCH_UNSET_VAR"],
                        "not set")):
        assert main(["practice", "run-agent", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err
    assert main(["practice", "export-tasks", str(out), "--tasks", "1"]) == 2
    assert "is not empty" in capsys.readouterr().err
