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
from faultbench.harness.practice import Clock, _open_session, keys_dir, load_key, record, started, unsealed
from faultbench.harness.rubric import BANDS, DIMENSIONS


def start(directory, minutes: float, keys=None, clock: Clock = time.time) -> dict:
    """Start the clock on an exercise with a budget of ``minutes`` (ValueError if it was started already)."""
    if not minutes > 0:
        raise ValueError(f"the time budget must be a positive number of minutes, got {minutes}")
    key, path = _open_session(directory, keys)
    if any(e["kind"] == "start" for e in key["events"]):
        raise ValueError(f"the session of {directory} has started already (`faultbench practice status DIR`)")
    return record(key, path, "start", clock, budget_s=minutes * 60)


def _first(events: list[dict], t0: float, test) -> float | None:
    """Seconds from ``t0`` to the first event that passes ``test`` (None: none did)."""
    return next((e["t"] - t0 for e in events if test(e)), None)


def summary(key: dict, now: float) -> dict:
    """What a session amounts to: who and which exercise, elapsed time (to ``stop``, else ``now``) and budget,
    scored attempts (and how many were late), hints counted (none after a reveal), reveals, the time to the
    correct subsystem, the correct function and the repair (None where not reached), the interviewer's overall
    rubric score (None until scored) and whether the key was edited outside faultbench."""
    events = key["events"]
    t0, budget = started(key)
    end = next((e["t"] for e in events if e["kind"] == "stop"), now)
    scored = [e for e in events if e["kind"] == "answer" and e["scored"]]
    scores = next((e["scores"] for e in reversed(events) if e["kind"] == "score"), None)
    return {
        "fault": key["fault"], "difficulty": key["difficulty"], "candidate": key.get("candidate"),
        "folder": key.get("folder"), "elapsed_s": end - t0, "budget_s": budget,
        "over_budget": budget is not None and end - t0 > budget, "stopped": any(e["kind"] == "stop" for e in events),
        "attempts": len(scored), "late": sum(bool(e.get("late")) for e in events),
        "hints": sum(e["kind"] == "hint" and e.get("counted", True) for e in events),
        "checks": sum(e["kind"] == "check" for e in events),
        "reveals": sum(e["kind"] == "reveal" for e in events),
        "after_reveal": sum(e["kind"] == "answer" and not e["scored"] for e in events),
        "to_subsystem_s": _first(scored, t0, lambda e: e["verdict_subsystem"] in ("right", "acceptable")),
        "to_seam_s": _first(scored, t0, lambda e: e["verdict_seam"] == "right"),
        "to_repair_s": _first(events, t0, lambda e: e["kind"] == "check" and e["code"] == 0),
        "score": None if scores is None else round(sum(scores.values()) / len(scores), 2),
        "altered": bool(key.get("altered")),
    }


def score(directory, scores: dict[str, int], keys=None, clock: Clock = time.time) -> dict:
    """The interviewer's rubric scores (each of ``rubric.DIMENSIONS`` 1-4), recorded; the latest counts."""
    unknown = sorted(set(scores) - set(DIMENSIONS))
    missing = [d for d in DIMENSIONS if d not in scores]
    if unknown or missing:
        raise ValueError(f"score every rubric dimension once ({', '.join(DIMENSIONS)}): "
                         + "; ".join(filter(None, [unknown and f"unknown {', '.join(unknown)}",
                                                   missing and f"missing {', '.join(missing)}"])))
    bad = {d: v for d, v in scores.items() if not (isinstance(v, int) and 1 <= v <= 4)}
    if bad:
        raise ValueError(f"each score is 1, 2, 3 or 4 ({BANDS[0]} ... {BANDS[3]}); got {bad}")
    key, path = load_key(directory, keys)
    return record(key, path, "score", clock, scores={d: scores[d] for d in DIMENSIONS})


def band(mean: float) -> str:
    """The overall band of a mean rubric score: the band of its nearest whole score."""
    return BANDS[min(3, max(0, int(mean + 0.5) - 1))]


def status(directory, keys=None, clock: Clock = time.time) -> str:
    """One line for the candidate: time used and left, hints, attempts, checks (never the answer)."""
    key, _ = load_key(directory, keys)
    s = summary(key, clock())
    counts = (f"hints {s['hints']}/3, answers {s['attempts']}, checks {s['checks']}"
              + ("; repaired" if s["to_repair_s"] is not None else "")
              + ("; the key was edited outside faultbench" if s["altered"] else ""))
    if s["stopped"]:
        return f"stopped after {_minutes(s['elapsed_s'])}; {counts}"
    left = "no budget set" if s["budget_s"] is None else (
        f"{_minutes(s['budget_s'] - s['elapsed_s'])} left" if not s["over_budget"]
        else f"over budget by {_minutes(s['elapsed_s'] - s['budget_s'])}")
    return f"{_minutes(s['elapsed_s'])} used, {left}; {counts}"


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
        keys_.append(unsealed(key, folder))
    return [summary(k, now) for k in sorted(keys_, key=lambda k: k["created"])]


KEY_FIELDS = {"fault": str, "difficulty": str, "events": list}  # what a history row reads of a key


HISTORY_COLUMNS = ("candidate", "fault", "difficulty", "attempts", "hints", "reveals", "to_subsystem_s", "to_seam_s",
                   "to_repair_s", "score", "altered", "folder")


def history_table(rows: list[dict]) -> str:
    """The history as a markdown table (times in minutes, '-' where not reached)."""
    head = "| # | " + " | ".join(c.removesuffix("_s").replace("_", " ") for c in HISTORY_COLUMNS) + " |"
    lines = [head, "|" + " --- |" * (len(HISTORY_COLUMNS) + 1)]
    for i, row in enumerate(rows, 1):
        cells = [_minutes(row[c]) if c.endswith("_s") else ("yes" if row[c] else "no") if c == "altered"
                 else "-" if row[c] is None else str(row[c]) for c in HISTORY_COLUMNS]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(directory, keys=None, clock: Clock = time.time) -> str:
    """The interviewer's markdown report of one session: who, the fault, the times, every event (late ones
    marked, each check's findings), the rubric scores with the overall band, and the candidate's diff."""
    from faultbench.harness.practice import candidate_diff

    key, _ = load_key(directory, keys)
    s = summary(key, clock())
    spec = get_fault(key["fault"])
    t0, _ = started(key)
    lines = [
        f"# Practice session: {spec.title}", "",
        f"- Candidate: {s['candidate'] or 'not named'}; folder `{s['folder']}`",
        f"- Fault `{spec.id}` ({spec.subsystem}, {key['difficulty']}); budget "
        f"{_minutes(s['budget_s']) if s['budget_s'] else 'none'}; time used {_minutes(s['elapsed_s'])}"
        + (" (over budget)" if s["over_budget"] else "") + (" (stopped)" if s["stopped"] else ""),
        f"- Time to the right subsystem {_minutes(s['to_subsystem_s'])}, to the right function "
        f"{_minutes(s['to_seam_s'])}, to the repair {_minutes(s['to_repair_s'])}",
        f"- Scored answers {s['attempts']} of {key.get('max_answers', '-')}, hints {s['hints']}, checks "
        f"{s['checks']}, reveals {s['reveals']}, answers after the reveal (not scored) {s['after_reveal']}, events "
        f"past the budget {s['late']}",
        *(["- **The key file was edited outside faultbench: its events and times cannot be trusted.**"]
          if s["altered"] else []), "",
        "| time | event | detail |", "| --- | --- | --- |",
    ]
    for e in key["events"]:
        lines.append(f"| {_minutes(e['t'] - t0)} | {e['kind']}{' (late)' if e.get('late') else ''} | "
                     f"{_detail(e)} |")
    scores = next((e["scores"] for e in reversed(key["events"]) if e["kind"] == "score"), None)
    lines += ["", "## Rubric scores", ""]
    if scores is None:
        lines.append(f"Not scored yet: `faultbench practice score DIR {' '.join(f'{d}=N' for d in DIMENSIONS)}` "
                     "(N 1-4; `faultbench practice rubric DIR` gives the bands).")
    else:
        lines += ["| dimension | score |", "| --- | --- |", *[f"| {d} | {v} |" for d, v in scores.items()],
                  "", f"Overall {s['score']:.2f} of 4: {band(s['score'])}."]
    diff = candidate_diff(directory, keys)
    lines += ["", "## The candidate's changes", ""]
    lines += (["The code as handed over is not on this machine (or does not match the key): no diff."] if diff is None
              else ["No change to the handed-over code."] if not diff else ["```diff", diff, "```"])
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
        verdict = {0: "repaired", 1: "not repaired", 2: "cannot run"}[event["code"]]
        return verdict + "".join(f"; {p}" for p in event.get("problems", [])).replace("|", "\\|")
    if kind == "hint":
        return f"hint {event['stage']}" + ("" if event.get("counted", True) else " (after the reveal, not counted)")
    if kind == "score":
        return ", ".join(f"{d} {v}" for d, v in event["scores"].items())
    if kind == "start":
        return f"budget {_minutes(event['budget_s'])}"
    return ""
