"""Timed practice sessions: start with a time budget, status, history over every exercise, a kept report.

The answer key of an exercise holds its events (start, hint, answer, check, reveal), each with the time
the injectable ``clock`` gave (seconds). A session starts at its ``start`` event (or, if nobody ran
``start``, when the exercise was made); the times reported are measured from there.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from faultbench.faults.registry import get_fault
from faultbench.harness.practice import Clock, keys_dir, load_key, record


def start(directory, minutes: float, keys=None, clock: Clock = time.time) -> dict:
    """Start the clock on an exercise with a budget of ``minutes`` (ValueError if it was started already)."""
    if not minutes > 0:
        raise ValueError(f"the time budget must be a positive number of minutes, got {minutes}")
    key, path = load_key(directory, keys)
    if any(e["kind"] == "start" for e in key["events"]):
        raise ValueError(f"the session of {directory} has started already (`faultbench practice status DIR`)")
    return record(key, path, "start", clock, budget_s=minutes * 60)


def _first(events: list[dict], t0: float, test) -> float | None:
    """Seconds from ``t0`` to the first event that passes ``test`` (None: none did)."""
    return next((e["t"] - t0 for e in events if test(e)), None)


def _started(key: dict) -> tuple[float, float | None]:
    """When the session started (its ``start`` event, else the exercise's making) and its budget (None: none)."""
    begun = next((e for e in key["events"] if e["kind"] == "start"), None)
    return (begun["t"], begun["budget_s"]) if begun else (key["created"], None)


def summary(key: dict, now: float) -> dict:
    """What a session amounts to: elapsed time and budget, scored attempts, hints, reveals, and the time to the
    correct subsystem, the correct function and the repair (None where not reached)."""
    events = key["events"]
    t0, budget = _started(key)
    scored = [e for e in events if e["kind"] == "answer" and e["scored"]]
    return {
        "fault": key["fault"], "difficulty": key["difficulty"], "elapsed_s": now - t0, "budget_s": budget,
        "over_budget": budget is not None and now - t0 > budget,
        "attempts": len(scored), "hints": sum(e["kind"] == "hint" for e in events),
        "checks": sum(e["kind"] == "check" for e in events),
        "reveals": sum(e["kind"] == "reveal" for e in events),
        "after_reveal": sum(e["kind"] == "answer" and not e["scored"] for e in events),
        "to_subsystem_s": _first(scored, t0, lambda e: e["verdict_subsystem"] in ("right", "acceptable")),
        "to_seam_s": _first(scored, t0, lambda e: e["verdict_seam"] == "right"),
        "to_repair_s": _first(events, t0, lambda e: e["kind"] == "check" and e["code"] == 0),
    }


def status(directory, keys=None, clock: Clock = time.time) -> str:
    """One line for the candidate: time used and left, hints, attempts, checks (never the answer)."""
    key, _ = load_key(directory, keys)
    s = summary(key, clock())
    left = "no budget set" if s["budget_s"] is None else (
        f"{_minutes(s['budget_s'] - s['elapsed_s'])} left" if not s["over_budget"]
        else f"over budget by {_minutes(s['elapsed_s'] - s['budget_s'])}")
    return (f"{_minutes(s['elapsed_s'])} used, {left}; hints {s['hints']}/3, answers {s['attempts']}, "
            f"checks {s['checks']}" + ("; repaired" if s["to_repair_s"] is not None else ""))


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def history(keys=None, clock: Clock = time.time) -> list[dict]:
    """Every exercise with a key in the keys folder, oldest first, as ``summary`` rows."""
    now = clock()
    folder = Path(keys_dir(keys))
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--keys {folder} is a file, not a folder of answer keys")
    keys_ = []
    for path in sorted(folder.glob("*.json")):
        try:
            key = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{path} is not an answer key ({type(e).__name__}): is {folder} a keys folder?") from None
        if not (isinstance(key, dict) and isinstance(key.get("created"), (int, float))
                and all(isinstance(key.get(k), kind) for k, kind in KEY_FIELDS.items())):
            raise ValueError(f"{path} is not an answer key (no created, fault, difficulty, events): is {folder} a "
                             "keys folder?")
        keys_.append(key)
    return [summary(k, now) for k in sorted(keys_, key=lambda k: k["created"])]


KEY_FIELDS = {"fault": str, "difficulty": str, "events": list}  # what a history row reads of a key


HISTORY_COLUMNS = ("difficulty", "attempts", "hints", "reveals", "to_subsystem_s", "to_seam_s", "to_repair_s")


def history_table(rows: list[dict]) -> str:
    """The history as a markdown table (times in minutes, '-' where not reached)."""
    head = "| # | " + " | ".join(c.removesuffix("_s").replace("_", " ") for c in HISTORY_COLUMNS) + " |"
    lines = [head, "|" + " --- |" * (len(HISTORY_COLUMNS) + 1)]
    for i, row in enumerate(rows, 1):
        cells = [_minutes(row[c]) if c.endswith("_s") else str(row[c]) for c in HISTORY_COLUMNS]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(directory, keys=None, clock: Clock = time.time) -> str:
    """The interviewer's markdown report of one session: the fault, the times, every event, the verdicts."""
    key, _ = load_key(directory, keys)
    s = summary(key, clock())
    spec = get_fault(key["fault"])
    t0, _ = _started(key)
    lines = [
        f"# Practice session: {spec.title}", "",
        f"- Fault `{spec.id}` ({spec.subsystem}, {key['difficulty']}); budget "
        f"{_minutes(s['budget_s']) if s['budget_s'] else 'none'}; time used {_minutes(s['elapsed_s'])}"
        + (" (over budget)" if s["over_budget"] else ""),
        f"- Time to the right subsystem {_minutes(s['to_subsystem_s'])}, to the right function "
        f"{_minutes(s['to_seam_s'])}, to the repair {_minutes(s['to_repair_s'])}",
        f"- Scored answers {s['attempts']}, hints {s['hints']}, checks {s['checks']}, reveals {s['reveals']}, "
        f"answers after the reveal (not scored) {s['after_reveal']}", "",
        "| time | event | detail |", "| --- | --- | --- |",
    ]
    for e in key["events"]:
        lines.append(f"| {_minutes(e['t'] - t0)} | {e['kind']} | {_detail(e)} |")
    return "\n".join(lines) + "\n"


def _detail(event: dict) -> str:
    kind = event["kind"]
    if kind == "answer":
        said = f"`{event['subsystem']}`" + (f" / `{event['seam']}`" if event["seam"] else "")
        if not event["scored"]:
            return f"{said}: after the reveal, not scored"
        return f"{said}: subsystem {event['verdict_subsystem']}" + (
            f", function {event['verdict_seam']}" if event["verdict_seam"] else "")
    if kind == "check":
        return {0: "repaired", 1: "not repaired", 2: "cannot run"}[event["code"]]
    if kind == "hint":
        return f"hint {event['stage']}"
    if kind == "start":
        return f"budget {_minutes(event['budget_s'])}"
    return ""
