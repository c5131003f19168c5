"""How hard an exercise is, how much of the evidence its README shows, and its staged hints.

Difficulty adds three measured or declared costs:
- the trigger: how hard the bug is to reproduce (always < amp-only, eval-only, after-step < rare-batch,
  on-resume, multi-rank);
- the symptom's distance from its cause (a crash's traceback stops near it; a silent quality loss, a
  desync or a slowdown says nothing about where);
- the signals: how many detectors of the committed bench (results/bench.csv) localized the fault's
  subsystem first on every seed, counted per track (white-box, black-box: each track is one way of looking,
  and the suite rows are unions, not signals) and taken from the track with more. Many independent signals
  (4 or more) make it easier, a single one harder.
The README then shows less of the evidence the harder the exercise: an easy one shows the colleague's
whole log and the healthy run's first steps; a medium one the whole log and only the healthy run's end
numbers; a hard one the loss column only (no gradient norm, no loss scale: numbers whose ratio to a
healthy run would give the cause away) and the healthy run's end numbers.
"""

from __future__ import annotations

import csv
import math
from functools import cache
from pathlib import Path

from faultbench.harness.exercise_check import parse_log

DIFFICULTIES = ("easy", "medium", "hard")
_TRIGGER_COST = {"always": 0, "amp-only": 1, "eval-only": 1, "after-step": 1, "rare-batch": 2, "on-resume": 2,
                 "multi-rank": 2}
_SYMPTOM_COST = {"crash-shape": 0, "crash-dtype": 0, "crash-index": 0, "crash-state": 0, "nan": 0, "divergence": 1,
                 "stall": 1, "eval-metric": 1, "hang": 1, "slowdown": 2, "memory-growth": 2, "silent-quality": 2,
                 "desync": 2}
_SUITE_ROWS = ("suite", "blackbox")  # bench.csv's per-track union rows
LOUD, QUIET = 4, 1  # detectors localizing it on every seed: at least LOUD is easier, at most QUIET harder

# hint 1: what to look at for the symptom class (specific to it), then what the trigger adds
SYMPTOM_HINTS = {
    "crash": "The traceback says where it failed, not where the bad value was made: print the shape, dtype and "
             "range of the failing value and follow it back to the function that produced it.",
    "nan": "Find the first step and the first operation that produce a non-finite value (a forward hook that "
           "checks every module's output): what is special about that batch or that precision?",
    "stall": "The loss barely moves: check that gradients exist, reach the optimizer (compare the weights before "
             "and after a step) and have a sensible size, and what learning rate the optimizer really uses.",
    "divergence": "Run it twice with the same seed, then next to a healthy run step by step: the learning rate, the "
                  "gradient norm and the optimizer state tell where the two part.",
    "eval-metric": "Training looks fine but the validation number is off: compute it yourself on two documents "
                   "by hand (which tokens count, in which mode the model runs, which documents are in the split).",
    "desync": "Two ranks should hold identical weights after every step: compare a checksum of the parameters "
              "per rank, and what each rank reads, reduces and restores.",
    "performance": "No number is wrong, the machine is wasted: measure the tokens per step, the time per step and "
                   "the memory over steps, and find what grows or what is computed for nothing.",
    "quality": "Nothing crashes, so test invariants on a tiny batch: the loss at initialization (about ln of the "
               "vocabulary), the same logits with and without padding, no token seeing the future, the labels "
               "being the inputs shifted by one.",
    "schedule": "The logged learning rate is not a healthy run's: put the two lr columns side by side and work out "
                "the schedule each one follows (warmup length, peak, floor, how often it is advanced).",
}
# what a measured first difference adds in front of the class's hint
FIRST_STEP = {
    "quality": "The loss differs from a healthy run's at step 0, before any update: the forward pass or the batch "
               "is not the same. ",
    "divergence": "The first {step} step(s) match a healthy run, so one forward pass is fine. ",
}
LOSS_TOL, LR_RTOL = 2e-4, 1e-3  # train.py prints the loss to 4 decimals and the lr to 3 significant digits
TRIGGER_HINTS = {
    "always": "",
    "amp-only": " It shows only in reduced precision: run the same job in fp32 and compare.",
    "eval-only": " It shows only outside the training step (evaluation or decoding).",
    "after-step": " The first step is fine; what does a step leave behind for the next one?",
    "rare-batch": " Only some batches trigger it: find what is special about the first one that does.",
    "on-resume": " It appears only after the restart: compare the resumed run with an uninterrupted one.",
    "multi-rank": " It needs two processes: one rank alone behaves.",
}
NO_MORE_HINTS = "There are no more hints: the three above are all there is."


def _steps(log: str) -> list[dict[str, float]]:
    """train.py's step lines as {column: value} (``step 3  loss 5.1  grad_norm 0.8  lr 1.00e-03  scale 1``)."""
    out = []
    for line in log.splitlines():
        words = line.split()
        if line.startswith("step ") and len(words) >= 4 and len(words) % 2 == 0:
            try:
                out.append({words[i]: float(words[i + 1]) for i in range(2, len(words), 2)})
            except ValueError:
                continue
    return out


def _first(pairs, differs) -> int | None:
    return next((i for i, (a, b) in enumerate(pairs) if differs(a, b)), None)


def shown(log: str, code: int | None, healthy: str) -> dict:
    """What the colleague's run shows next to the healthy one, measured from the two logs: whether it crashed,
    the first step with a non-finite loss or gradient norm, the first step whose loss and whose learning rate
    differ, and whether the validation loss differs. Hint 1 is chosen from it (``hints``)."""
    ours, theirs = _steps(log), _steps(healthy)
    pairs = list(zip(ours, theirs, strict=False))
    finite = [math.isfinite(s.get("loss", 0.0)) and math.isfinite(s.get("grad_norm", 0.0)) for s in ours]
    validation, healthy_validation = parse_log(log)["validation"], parse_log(healthy)["validation"]
    return {
        "crashed": bool(code) and "Traceback" in log,
        "nonfinite_step": finite.index(False) if False in finite else None,
        "loss_step": _first(pairs, lambda a, b: not abs(a.get("loss", 0.0) - b.get("loss", 0.0)) <= LOSS_TOL),
        "lr_step": _first(pairs, lambda a, b: not math.isclose(a.get("lr", 0.0), b.get("lr", 0.0), rel_tol=LR_RTOL)),
        "validation_differs": healthy_validation is not None and not (
            validation is not None and abs(validation - healthy_validation) <= LOSS_TOL),
    }


def measured_class(seen: dict) -> str | None:
    """The symptom class the run shows (None: nothing in the logs tells; the declared class then)."""
    lr, loss = seen["lr_step"], seen["loss_step"]
    if seen["nonfinite_step"] is not None:
        return "nan"
    if seen["crashed"]:
        return "crash"
    if lr is not None and (loss is None or lr <= loss):
        return "schedule"
    if loss is not None:
        return "quality" if loss == 0 else "divergence"
    return "eval-metric" if seen["validation_differs"] else None


def symptom_class(spec) -> str:
    """The symptom class a candidate meets first (crash, nan, stall, ..., quality)."""
    for symptom in spec.symptoms:
        if symptom.startswith("crash") or symptom == "hang":
            return "crash" if symptom != "hang" else "performance"
        if symptom in ("slowdown", "memory-growth"):
            return "performance"
        if symptom in SYMPTOM_HINTS:
            return symptom
    return "quality"


@cache
def _localizers(results: Path) -> dict[str, list[str]]:
    """{fault id: the detectors that localized its subsystem first on every seed of the bench} (empty: no bench)."""
    path = results / "bench.csv"
    if not path.exists():
        return {}
    hits: dict[tuple[str, str], list[bool]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if row["detector"] not in _SUITE_ROWS:
                hits.setdefault((row["fault"], row["detector"]), []).append(float(row["rr_subsystem"] or 0) == 1.0)
    out: dict[str, list[str]] = {}
    for (fault, detector), ok in sorted(hits.items()):
        out.setdefault(fault, []).extend([detector] if all(ok) else [])
    return out


def localizing_detectors(fault_id: str, results: Path) -> list[str]:
    """The detectors that localize the fault's subsystem first on every bench seed."""
    return _localizers(results).get(fault_id, [])


def signals(fault_id: str, results: Path) -> int | None:
    """How many detectors of one track localize the fault's subsystem first on every bench seed, in the track
    with more of them (None: not benched)."""
    from faultbench.detectors.api import all_detectors

    found = _localizers(results)
    if fault_id not in found:
        return None
    registry = all_detectors()
    tracks = [getattr(registry.get(d), "track", "white-box") for d in found[fault_id]]
    return max((tracks.count(t) for t in set(tracks)), default=0)


def difficulty(spec, results: Path) -> str:
    """easy / medium / hard: trigger cost + symptom distance, minus 1 for a loud fault, plus 1 for a quiet one."""
    cost = _TRIGGER_COST[spec.trigger] + min(_SYMPTOM_COST[s] for s in spec.symptoms)
    loud = signals(spec.id, results)
    if loud is not None:
        cost += (loud <= QUIET) - (loud >= LOUD)
    return "easy" if cost <= 1 else "medium" if cost <= 3 else "hard"


def first_hint(spec, seen: dict | None = None) -> str:
    """Hint 1: what to look at for the symptom the run shows (``seen``: ``shown``'s measurement; None: the
    fault's declared symptom), with the trigger's remark only where the run agrees with it (a bug that parts from
    the healthy run at step 0 is not one that "only some batches" or "the step after" trigger)."""
    cls = (measured_class(seen) if seen else None) or symptom_class(spec)
    prefix = FIRST_STEP.get(cls, "").format(step=(seen or {}).get("loss_step"))
    from_start = bool(seen) and 0 in (seen["loss_step"], seen["nonfinite_step"])
    trigger = "" if from_start and spec.trigger in ("rare-batch", "after-step") else TRIGGER_HINTS[spec.trigger]
    return f"Hint 1 ({cls}): {prefix if seen else ''}{SYMPTOM_HINTS[cls]}{trigger}"


def hints(spec, seen: dict | None = None) -> list[str]:
    """The three staged hints: the symptom (as the run shows it, ``first_hint``), the subsystem, the seam."""
    seams = " and ".join(f"`{s.rsplit('.', 1)[-1]}` in `{'/'.join(s.split('.')[:2])}.py`" for s in spec.seams)
    return [
        first_hint(spec, seen),
        f"Hint 2 (the subsystem): look in `{spec.subsystem}` (`python check.py --seams` lists its functions).",
        f"Hint 3 (the function): {seams}.",
    ]


def readme_evidence(level: str, log: str, healthy: str) -> tuple[list[str], list[str]]:
    """(the colleague's log lines, the healthy run's lines) the README shows at ``level``."""
    lines = log.strip().splitlines()
    healthy_lines = healthy.splitlines()
    ends = [line for line in healthy_lines if line.startswith(("validation", "generation"))]
    if level == "easy":
        return lines, [line for line in healthy_lines if line.startswith("step ")][:2] + ends
    if level == "medium":
        return lines, ends
    return [" ".join(line.split()[:4]) if line.startswith("step ") else line for line in lines], ends
