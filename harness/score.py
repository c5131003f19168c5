"""Scoring: from case records to per-case rows (one per case x detector) and aggregate scores.

Definitions (per detector, and for the suite = the union of the non-baseline detectors):
- detected: at least one finding on a faulty case; false positive: at least one finding on a clean case;
- localization: the detector's findings in rank order give a list of distinct subsystems (and of distinct
  seams, findings without a seam skipped); the rank of the first acceptable one gives Top-1, Top-3 and
  the reciprocal rank (0 when none is acceptable or nothing was found). A subsystem is acceptable if it
  is the fault's or in its ``also_acceptable``; a seam if the fault replaces it;
- latency: the step of the first finding with an acceptable subsystem minus the trigger step (the
  checkpoint's step for on-resume faults, else 0), never below 0: an offline checker (TrainCheck) can pin
  a violation on an event before the trigger, which is not an earlier detection;
- overhead: (loop time + the passive detectors' step-hook seconds) / loop time, same run, where the loop time is
  the train time less every hook's seconds inside the steps (both tracks' detectors, passive or probing, and the
  watch's own): a probe's or the other track's hooks in the train time would otherwise flatter the ratio. It
  counts what the hooks themselves spend; what attaching them costs beyond that (a hooked module's slower call
  path, colder caches) only an A/B run sees: ``benchmarks/detector_overhead.py``;
- shown: a fault case in which the fault manifested (its run behaved unlike the clean case of the same
  recipe, seed and detectors: ``harness.bench.mark_manifested``). Detection, localization and latency are
  means over the shown cases only; the cases where the fault did not show are counted beside them
  (``not_shown_cases``), never scored as misses. A case with no clean twin to compare (``manifested`` None)
  counts as shown.
"""

from __future__ import annotations

import functools
import statistics

from faultbench import targets

SUITE = "suite"  # the white-box track's suite: the union of its non-baseline detectors
BLACKBOX = "blackbox"  # the black-box track's suite (detectors that see the loop only through faultbench.watch)


def _rank_of_first(values: list, acceptable) -> int | None:
    seen: list = []
    for v in values:
        if v is None or v in seen:
            continue
        seen.append(v)
        if acceptable(v):
            return len(seen)
    return None


def score_findings(findings: list[dict], fault: dict | None, trigger_step: int) -> dict:
    """Scores of one ranked list of findings against one fault (None: a clean case), and where its top finding
    came from (detector, subsystem, seam; empty when nothing was found)."""
    top = findings[0] if findings else {}
    row = {"detected": bool(findings), "findings": len(findings),
           "first_step": min((f["step"] for f in findings if f["step"] is not None), default=None),
           "top_detector": top.get("detector", ""), "top_subsystem": top.get("subsystem", ""),
           "top_seam": top.get("seam") or ""}
    if fault is None:
        return row
    subsystems = {fault["subsystem"], *fault.get("also_acceptable", ())}
    seams = set(fault["seams"])
    sub_rank = _rank_of_first([f["subsystem"] for f in findings], subsystems.__contains__)
    seam_rank = _rank_of_first([f["seam"] for f in findings], seams.__contains__)
    correct_steps = [f["step"] for f in findings if f["subsystem"] in subsystems and f["step"] is not None]
    for level, rank in (("subsystem", sub_rank), ("seam", seam_rank)):
        row[f"top1_{level}"] = rank == 1
        row[f"top3_{level}"] = rank is not None and rank <= 3
        row[f"rr_{level}"] = 1.0 / rank if rank else 0.0
    row["latency"] = max(min(correct_steps) - trigger_step, 0) if correct_steps else None
    return row


def trigger_step(fault: dict | None, record: dict) -> int:
    """The step at which the fault can first act: the checkpoint's step for on-resume faults (the resumed
    run's own step counter may be the fault), else 0."""
    recipe = targets.get(target_of(record)).recipes().get(record["case"]["recipe"])
    if fault is not None and fault["trigger"] == "on-resume" and recipe is not None and recipe.resume_at:
        return recipe.resume_at
    return 0


def target_of(record: dict) -> str:
    """The target a case record ran on (a record from before targets is the reference's)."""
    return record["case"].get("target", "ref")


@functools.cache
def _seam_table(target: str) -> dict[str, str]:
    """A target's seam table, built once per process (the scorer reads it for every case record)."""
    return targets.get(target).seams()


def seam_of(finding: dict, seams) -> str | None:
    """The finding's seam; for a black-box finding (no seam, a place in the user's terms) the first of these the
    target's seam table (``seams``) has: the forward of the class of the module its ``where`` names, its ``where``
    itself (a framework function's qualified name), the function its evidence names as the code place (a crash's:
    ``faultbench.guard.code_place``)."""
    if finding.get("seam"):
        return finding["seam"]
    code = (finding.get("evidence") or {}).get("code")
    for name in (finding.get("where_class") and finding["where_class"] + ".forward", finding.get("where"),
                 isinstance(code, dict) and code.get("qualname")):
        name = isinstance(name, str) and name.removeprefix("faultbench.").split(".<locals>")[0]  # a closure: its def
        if name and name in seams:
            return name
    return None


def case_rows(record: dict, faults: dict[str, dict], suite_ids: list[str], blackbox_ids=(),
              passive: dict[str, bool] | None = None) -> list[dict]:
    """One row per detector of the case, and one per track's suite when the case ran detectors of it (its step
    seconds: its machinery's and its members', less those ``passive`` says are not: detector id -> counts in
    overhead, True when absent, as ``aggregate``'s)."""
    passive = passive or {}
    seams = _seam_table(target_of(record))
    record = {**record, "findings": [{**f, "seam": seam_of(f, seams)} for f in record["findings"]]}
    case = record["case"]
    fault = faults[case["faults"][0]] if case["faults"] else None
    trig = trigger_step(fault, record)
    base = {"case": record["name"], "target": target_of(record),
            "fault": case["faults"][0] if case["faults"] else "", "recipe": case["recipe"],
            "seed": case["seed"], "crash": (record["crash"] or {}).get("type", ""),
            "hang": bool(record.get("hang")), "train_s": record.get("train_s", 0.0),
            # the loop alone: every hook's seconds inside the steps taken out
            "loop_s": record.get("train_s", 0.0) - sum(record["step_seconds"].values()),
            "manifested": record.get("manifested") if case["faults"] else None}
    rows = []
    for det in case["detectors"]:
        found = [f for f in record["findings"] if f["detector"] == det]
        rows.append({**base, "detector": det, **score_findings(found, fault, trig),
                     "step_s": record["step_seconds"].get(det, 0.0), "other_s": record["other_seconds"].get(det, 0.0),
                     "error": record["detector_errors"].get(det, "")})
    for name, ids, machinery in ((SUITE, suite_ids, ()), (BLACKBOX, blackbox_ids, ("watch",))):
        members = [d for d in case["detectors"] if d in ids]
        if not members:
            continue
        found = [f for f in record["findings"] if f["detector"] in members]
        timed = [*(d for d in members if passive.get(d, True)), *machinery]  # the watch's time is overhead too
        rows.append({**base, "detector": name, **score_findings(found, fault, trig),
                     "step_s": sum(record["step_seconds"].get(d, 0.0) for d in timed),
                     "other_s": sum(record["other_seconds"].get(d, 0.0) for d in timed),
                     "error": "; ".join(f"{d}: {e}" for d, e in record["detector_errors"].items()
                                        if d in members or d.startswith(machinery))})
    return rows


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def aggregate(rows: list[dict], passive: dict[str, bool]) -> dict:
    """Scores of one detector (or the suite) over its rows. ``passive``: detector id -> counts in overhead."""
    faulty = [r for r in rows if r["fault"] and r.get("manifested") is not False]
    clean = [r for r in rows if not r["fault"]]
    latencies = [r["latency"] for r in faulty if r.get("latency") is not None]
    ratios = [(r["loop_s"] + r["step_s"]) / r["loop_s"] for r in rows
              if r["loop_s"] > 0 and passive.get(r["detector"], True)]
    out = {
        "fault_cases": len(faulty),
        "not_shown_cases": sum(bool(r["fault"]) and r.get("manifested") is False for r in rows),
        "clean_cases": len(clean),
        "detection_rate": _mean(r["detected"] for r in faulty),
        "false_positive_rate": _mean(r["detected"] for r in clean),
        "median_latency_steps": statistics.median(latencies) if latencies else None,
        "errors": sum(bool(r["error"]) for r in rows),
        "hook_s": sum(r["step_s"] + r["other_s"] for r in rows),
        "overhead_ratio": statistics.median(ratios) if ratios else 1.0,
    }
    for level in ("subsystem", "seam"):
        for metric in ("top1", "top3", "rr"):
            key = f"{metric}_{level}" if metric != "rr" else f"mrr_{level}"
            out[key] = _mean(r[f"{metric}_{level}"] for r in faulty)
    return out


def exclusive_overhead(rows: list[dict], detector: str, against: str = SUITE) -> float | None:
    """An exclusive detector changes the run itself (anomaly mode slows every op), so its overhead is its
    case's train time over the paired case's (the rows of ``against``, same bench) loop time (its train time
    without any step hook)."""
    base = {r["case"]: r["loop_s"] for r in rows if r["detector"] == against}
    ratios = [r["train_s"] / base[r["case"]] for r in rows
              if r["detector"] == detector and r["train_s"] > 0 and base.get(r["case"], 0) > 0 and not r["crash"]]
    return statistics.median(ratios) if ratios else None


def per_fault(rows: list[dict], faults: dict[str, dict]) -> dict:
    """For each fault: its recipes and how the suite did on its cases (detected, top-1 subsystem and seam,
    latency, crashes) counted over the cases where it showed; "not_shown" counts the others."""
    out = {}
    for r in rows:
        if r["detector"] != SUITE or not r["fault"]:
            continue
        entry = out.setdefault(r["fault"], {"target": r.get("target", "ref"),
                                            "subsystem": faults[r["fault"]]["subsystem"], "recipes": [], "cases": 0,
                                            "not_shown": 0, "detected": 0, "top1_subsystem": 0, "top1_seam": 0,
                                            "latencies": [], "crashed": 0})
        if r["recipe"] not in entry["recipes"]:
            entry["recipes"].append(r["recipe"])
        entry["cases"] += 1
        if r.get("manifested") is False:
            entry["not_shown"] += 1
            continue
        entry["detected"] += r["detected"]
        entry["top1_subsystem"] += r["top1_subsystem"]
        entry["top1_seam"] += r["top1_seam"]
        entry["crashed"] += bool(r["crash"])
        if r["latency"] is not None:
            entry["latencies"].append(r["latency"])
    return out


def not_runnable(faults: dict[str, dict]) -> dict[str, str]:
    """The faults no recipe of the matrix can show, with the reason (they have no case and no score)."""
    return {f: m["not_runnable"] for f, m in faults.items() if m.get("not_runnable")}
