"""Practice exercises as tasks for a command-line coding agent, and a runner that scores any agent on them.

``export_tasks(out, n, seed)`` writes ``out/tasks/task-NN/`` (a broken exercise folder with ``TASK.md``, the
instructions, beside its README, train.py and check.py), ``out/grader/`` (the answer keys: what an agent must never
read) and ``out/tasks.json`` (ids, difficulties and time limits; no faults). ``run_agent(out, command, name)`` runs
the shell ``command`` in a fresh copy of each task inside ``harness.sandbox`` (the grader folder and every keys
folder hidden, the time limit enforced, ``{python}`` replaced by this interpreter), then grades what it left:
``ANSWER.json`` ({"subsystem", "function", optional "tokens"}) for localization, ``practice.check`` on the edited
copy (sandboxed too) for the repair, and the seconds it took. Results: ``out/runs/<name>/results.md`` and
``results.json``. ``python -m faultbench.baseline_agent`` is a scripted baseline to score.
"""

from __future__ import annotations

import json
import random
import re
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from faultbench.faults.registry import all_faults, get_fault
from faultbench.harness import practice
from faultbench.harness.atomic import write_text
from faultbench.harness.practice_level import difficulty
from faultbench.harness.rubric import TIME_BUDGET_MIN
from faultbench.harness.sandbox import run_command_sandboxed
from faultbench.model.seams import SUBSYSTEMS

TASK_MD = """# Task: a training job misbehaves

Your working directory is a small GPT training project that a colleague reports as broken: `README.md` is their
report, with last week's healthy numbers. It runs on its own (`python train.py ...`, as the README shows).

1. Find the bug: which part of the code it lives in (one of: {subsystems}) and which function (`python check.py
   --seams` lists them with their files).
2. Fix it, so that `python check.py` passes (exit 0: the run behaves like the healthy one).
3. Write `ANSWER.json` here: {{"subsystem": "...", "function": "..."}} (the function as `check.py --seams` names
   it, or a unique short name such as `apply_rope`); add "tokens": N if you count the tokens you used.

You have {minutes} minutes. Everything you need is in this folder; the answer is nowhere you can read.
"""
ANSWER = "ANSWER.json"
ROOT = Path(__file__).resolve().parent.parent
# what of this checkout would hand an agent the answer (the reference to diff against, the faults, their docs,
# results and history): hidden in the sandbox; the watch and its detectors stay (a baseline agent uses them)
REFERENCE = (".git", ".cache", "benchmarks", "bundles", "examples", "faults", "harness", "model", "peers", "results",
             "targets", "tests", "README.md", "Makefile", "faultbench.egg-info")


def export_tasks(out, n: int, seed: int = 0, pool=None) -> list[dict]:
    """``n`` tasks from distinct faults of ``pool`` (the offered reference faults), a seeded draw, written under
    ``out``; their index."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; give a new folder")
    pool = sorted(pool or practice.offered() or all_faults("ref"))
    if not 1 <= n <= len(pool):
        raise ValueError(f"--tasks must be between 1 and {len(pool)} (the offered faults), got {n}")
    chosen = random.Random(seed).sample(pool, n)
    index = []
    for i, fault_id in enumerate(chosen, 1):
        task = f"task-{i:02d}"
        folder = practice.new_exercise(out / "tasks" / task, fault=fault_id, keys=out / "grader")
        level = difficulty(get_fault(fault_id), practice.RESULTS)
        minutes = TIME_BUDGET_MIN[level]
        write_text(folder / "TASK.md", TASK_MD.format(subsystems=", ".join(SUBSYSTEMS), minutes=minutes))
        practice.uniform_mtimes(folder, int(folder.stat().st_mtime))
        index.append({"task": task, "difficulty": level, "minutes": minutes})
    write_text(out / "tasks.json", json.dumps(index, indent=1) + "\n")
    return index


def _answer(folder: Path, spec) -> dict:
    """The graded ANSWER.json of a finished task (``invalid`` verdicts for a missing or malformed one)."""
    try:
        said = json.loads((folder / ANSWER).read_text())
        subsystem, function = said["subsystem"], said.get("function")
        if subsystem not in SUBSYSTEMS:
            raise ValueError(subsystem)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {"subsystem": "invalid", "seam": "invalid", "tokens": None}
    try:
        seam = None if function is None else practice.resolve_seam(str(function))
    except ValueError:  # not a function of the listing (or an ambiguous short name): a wrong function
        seam = str(function)
    tokens = said.get("tokens")
    return {**practice.grade(spec, subsystem, seam), "tokens": tokens if isinstance(tokens, int) else None}


def run_agent(out, command: str, name: str, passed: dict[str, str] | None = None, only=None) -> list[dict]:
    """Run ``command`` on every task of ``out`` (or ``only`` those ids) and grade it; the rows, also written to
    ``out/runs/<name>/``."""
    out = Path(out)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
        raise ValueError(f"--name {name!r}: letters, digits, '.', '_' and '-' only (it names a folder)")
    if not (out / "tasks.json").is_file():
        raise ValueError(f"{out} holds no exported tasks (no tasks.json): `faultbench practice export-tasks` first")
    index = json.loads((out / "tasks.json").read_text())
    unknown = sorted(set(only or ()) - {t["task"] for t in index})
    if unknown:
        raise ValueError(f"no task {unknown[0]!r} in {out / 'tasks.json'}")
    runnable = command.replace("{python}", shlex.quote(sys.executable))
    runs = out / "runs" / name
    rows = []
    for entry in (t for t in index if not only or t["task"] in only):
        folder = runs / entry["task"]
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(out / "tasks" / entry["task"], folder)
        others = [p for p in (*(out / "runs").iterdir(), *runs.iterdir()) if p.is_dir() and p not in (runs, folder)]
        hidden = [out / "grader", out / "tasks", *others, *practice.key_folders(), *(ROOT / p for p in REFERENCE)]
        start = time.monotonic()
        ran = run_command_sandboxed(runnable, folder, hidden, entry["minutes"] * 60, passed)
        seconds = time.monotonic() - start
        key, _ = practice.load_key(folder, out / "grader")
        spec = get_fault(key["fault"])
        repaired = practice.check(folder, out / "grader")["code"] == 0
        rows.append({"task": entry["task"], "difficulty": entry["difficulty"], **_answer(folder, spec),
                     "repaired": repaired, "seconds": round(seconds, 1), "timed_out": ran.code is None,
                     "exit": ran.code, "isolated": ran.isolated})
    write_text(runs / "results.json", json.dumps(rows, indent=1) + "\n")
    write_text(runs / "results.md", results_table(rows, name, command))
    return rows


def summary(rows: list[dict]) -> dict:
    """Localization (subsystem right or acceptable; function right), repair rate, median seconds, tokens."""
    tokens = [r["tokens"] for r in rows if r["tokens"] is not None]
    return {"tasks": len(rows),
            "subsystem": sum(r["subsystem"] in ("right", "acceptable") for r in rows) / len(rows),
            "function": sum(r["seam"] == "right" for r in rows) / len(rows),
            "repaired": sum(r["repaired"] for r in rows) / len(rows),
            "median_s": statistics.median(r["seconds"] for r in rows),
            "tokens": sum(tokens) if tokens else None}


def results_table(rows: list[dict], name: str, command: str) -> str:
    s = summary(rows)
    columns = ("task", "difficulty", "subsystem", "seam", "repaired", "seconds", "timed_out", "tokens")
    return "\n".join([
        f"# Agent `{name}` on {s['tasks']} practice tasks", "", f"Command: `{command}`", "",
        f"Subsystem right (or acceptable) {s['subsystem']:.2f}; function right {s['function']:.2f}; repaired "
        f"{s['repaired']:.2f}; median {s['median_s']:.1f} s a task; tokens {s['tokens'] or 'not reported'}.", "",
        "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns),
        *["| " + " | ".join("-" if r[c] is None else str(r[c]) for c in columns) + " |" for r in rows], ""])
