"""Bench outputs: bench.csv (case x detector), summary.json, leaderboard.md, the figures and index.html
(``harness.page``: summary.png, heatmap_<target>_<track>.png), a printed table.

Every score is per target (``ref``, ``hf``): summary.json holds the seeds, the goals and, under "targets",
one summary per target (suite, detectors, per fault, not runnable, counts); leaderboard.md opens with the
headline per target and track and the summary figure, puts the targets side by side, then a section per target;
bench.csv has a target column. Scores and timings are kept apart: bench.csv, summary.json, leaderboard.md, the
figures and the page hold only what the runs' behaviour decides (byte-identical when a bench re-runs unchanged
code), and timings.csv (train and hook seconds per case x detector; not kept in git) and timings.json (wall time,
cached cases, each target's detectors' hook seconds and overhead ratio) hold the clock's readings, which change on
every run.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from faultbench.harness.atomic import write_bytes, write_text
from faultbench.harness.figures import heatmap_name
from faultbench.harness.score import BLACKBOX, SUITE

COLUMNS = ("case", "target", "fault", "recipe", "seed", "detector", "detected", "findings", "first_step", "latency",
           "top1_subsystem", "top3_subsystem", "rr_subsystem", "top1_seam", "top3_seam", "rr_seam",
           "manifested", "top_detector", "top_subsystem", "top_seam", "crash", "hang", "error")
TIMING_COLUMNS = ("case", "detector", "train_s", "loop_s", "step_s", "other_s")
TIMING_KEYS = ("overhead_ratio", "hook_s")  # the aggregate scores that are timings
SCORE_COLUMNS = (("fault_cases", "shown"), ("not_shown_cases", "not shown"), ("detection_rate", "detect"),
                 ("false_positive_rate", "FP"), ("top1_subsystem", "top1 sub"), ("top3_subsystem", "top3 sub"),
                 ("mrr_subsystem", "MRR sub"), ("top1_seam", "top1 seam"),
                 ("top3_seam", "top3 seam"), ("mrr_seam", "MRR seam"), ("median_latency_steps", "latency"),
                 ("errors", "errors"))
TIMING_SCORE_COLUMNS = (("overhead_ratio", "overhead"), ("hook_s", "hook s"))


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def csv_text(rows: list[dict], columns=COLUMNS) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
    return buf.getvalue()


def write_csv(path: Path, rows: list[dict], columns=COLUMNS) -> None:
    write_text(path, csv_text(rows, columns))


def split_timings(scores: dict[str, dict]) -> dict[str, dict]:
    """Take the timing entries (``TIMING_KEYS``) out of each detector's scores; returns them by detector."""
    return {d: {k: s.pop(k) for k in TIMING_KEYS if k in s} for d, s in scores.items()}


def score_rows(scores: dict, registry, timings: dict | None = None) -> list[list[str]]:
    """One target's scores (``scores``: its summary) as cells: the header, then the suite, then each detector
    (best Top-1 subsystem first); with ``timings`` (that target's entry of timings.json's "detectors") each
    detector's overhead and hook seconds too."""
    columns = SCORE_COLUMNS + (TIMING_SCORE_COLUMNS if timings is not None else ())
    rows = [["detector", "track", "kind", *(label for _, label in columns)]]
    entries = [(name, track, "suite", scores.get(key)) for name, key, track in SUITES if scores.get(key)]
    ranked = sorted(scores["detectors"].items(), key=lambda kv: (registry[kv[0]].track != "white-box",
                                                                  -(kv[1]["top1_subsystem"] or 0)))
    entries += [(d, registry[d].track, "baseline" if registry[d].baseline else registry[d].family, s)
                for d, s in ranked]
    per = timings or {}
    return rows + [[name, track, kind, *(_fmt({**s, **per.get(name, {})}.get(key)) for key, _ in columns)]
                   for name, track, kind, s in entries]


def _markdown(cells: list[list[str]]) -> list[str]:
    head, *body = cells
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def score_table(scores: dict, registry) -> list[str]:
    """``score_rows`` as a markdown table."""
    return _markdown(score_rows(scores, registry))


# each track's suite: (its row name in bench.csv and timings, its key in a target's summary, its track)
SUITES = ((SUITE, "suite", "white-box"), (BLACKBOX, "blackbox", "black-box"))


def goal_checks(scores: dict, goals: dict, timings: dict | None = None) -> list[dict]:
    """One target's track suites against their goals (``goals``: row name -> goal -> [op, value]): {track, goal,
    wanted, measured, met} each; a timing goal (overhead) is judged only with ``timings`` (met None without: the
    leaderboard leaves it to timings.json, so that it stays byte-identical across re-runs)."""
    out = []
    for name, key, track in SUITES:
        if not scores.get(key) or name not in goals:
            continue
        suite = {**scores[key], **(timings or {}).get(name, {})}
        for goal, (op, wanted) in goals[name].items():
            value = None if goal in TIMING_KEYS and timings is None else suite.get(goal)
            met = None if goal in TIMING_KEYS and timings is None else (
                value is not None and (value >= wanted if op == ">=" else value <= wanted))
            out.append({"track": track, "goal": f"{name}.{goal}", "wanted": f"{op} {wanted}", "measured": value,
                        "met": met})
    return out


def goal_lines(scores: dict, goals: dict, timings: dict | None = None) -> list[str]:
    """``goal_checks`` as a markdown table."""
    checks = goal_checks(scores, goals, timings)
    if not checks:  # e.g. a peer tool's run: the goals are the suites'
        return ["No suite detector ran in this bench, so the suites' goals do not apply."]
    return ["| track | goal | wanted | measured | met |", "|---|---|---|---|---|"] + [
        f"| {c['track']} | {c['goal']} | {c['wanted']} | "
        f"{'a timing: see timings.json' if c['met'] is None else _fmt(c['measured'])} | "
        f"{'-' if c['met'] is None else 'yes' if c['met'] else 'NO'} |" for c in checks]


def junit_xml(summary: dict, timings: dict) -> str:
    """The bench as JUnit XML for a CI gate: a testsuite per target, a testcase per goal of its track suites (a
    failure when unmet) and per detector (a failure when it fired on a clean case: a false positive)."""
    import xml.etree.ElementTree as ET

    root = ET.Element("testsuites", name="faultbench.bench")
    for target, scores in summary["targets"].items():
        suite = ET.SubElement(root, "testsuite", name=f"faultbench.bench.{target}")
        cases = []
        for c in goal_checks(scores, summary["goals"], timings.get("detectors", {}).get(target, {})):
            case = ET.SubElement(suite, "testcase", classname=f"faultbench.bench.{target}.goals",
                                 name=f"{c['track']} {c['goal']} {c['wanted']}")
            if not c["met"]:
                ET.SubElement(case, "failure", type="goal", message=f"measured {_fmt(c['measured'])}")
            cases.append(case)
        for detector, s in sorted(scores.get("detectors", {}).items()):  # none in a blind set's aggregates
            case = ET.SubElement(suite, "testcase", classname=f"faultbench.bench.{target}.false_positives",
                                 name=detector)
            if not s.get("clean_cases"):
                ET.SubElement(case, "skipped", message="it ran on no clean case")
            elif s.get("false_positive_rate"):
                ET.SubElement(case, "failure", type="false positive",
                              message=f"fired on {s['false_positive_rate']:.3f} of {s['clean_cases']} clean cases")
            cases.append(case)
        suite.set("tests", str(len(cases)))
        for kind, attr in (("failure", "failures"), ("skipped", "skipped")):
            suite.set(attr, str(sum(c.find(kind) is not None for c in cases)))
        suite.set("errors", "0")
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


SIDE_BY_SIDE = (("detection_rate", "detect"), ("false_positive_rate", "FP"), ("top1_subsystem", "top1 sub"),
                ("top3_subsystem", "top3 sub"), ("mrr_subsystem", "MRR sub"), ("top1_seam", "top1 seam"),
                ("top3_seam", "top3 seam"), ("mrr_seam", "MRR seam"))


def side_by_side(summary: dict) -> list[str]:
    """The suite and each detector, one column per metric and target (``detect ref``, ``detect hf``, ...)."""
    per_target = summary["targets"]
    names = list(per_target)
    detectors = list(dict.fromkeys(d for t in names for d in per_target[t]["detectors"]))
    head = ["detector", *(f"{label} {t}" for _, label in SIDE_BY_SIDE for t in names)]
    rows = [head]
    suites = {name: key for name, key, _ in SUITES}
    for det in [*suites, *detectors]:
        scores = [per_target[t].get(suites[det]) if det in suites else per_target[t]["detectors"].get(det)
                  for t in names]
        if any(scores):
            rows.append([det, *(_fmt((s or {}).get(key)) for key, _ in SIDE_BY_SIDE for s in scores)])
    return _markdown(rows)


def _coverage_line() -> str:
    """How much of the contract catalogue (detectors/CONTRACTS.md) the detectors check."""
    from faultbench.detectors.contracts import coverage

    c = coverage()
    white, black = (c["per_track"][t]["checked"] for t in ("white-box", "black-box"))
    return (f"Contract coverage: {c['checked']} of {c['contracts']} catalogue contracts are checked by a detector "
            f"(white-box {white}, black-box {black}); "
            "`faultbench contracts` prints the grid (detectors/CONTRACTS.md).")


def headline_lines(summary: dict) -> list[str]:
    """Per target and track, the suite's shown fault cases, detection, Top-1 subsystem and seam, and FP."""
    metrics = (("detection_rate", "detection"), ("top1_subsystem", "top-1 subsystem"), ("top1_seam", "top-1 seam"),
               ("false_positive_rate", "FP"))
    rows = [["target", "track", "shown fault cases", *(label for _, label in metrics)]]
    rows += [[target, track, str(s["fault_cases"]), *(_fmt(s.get(key)) for key, _ in metrics)]
             for target, scores in summary["targets"].items() for _, key, track in SUITES if (s := scores.get(key))]
    return _markdown(rows)


def leaderboard(summary: dict, faults: dict[str, dict], registry, extra: list[str] = ()) -> str:
    n_seeds = len(summary["seeds"])
    counts = "; ".join(f"{t}: {s['cases']} cases ({s['faults']} faults, {s['crashed_cases']} crashed, "
                       f"{s['hung_cases']} hung)" for t, s in summary["targets"].items())
    out = [
        "# faultbench leaderboard",
        "",
        f"{summary['cases']} cases ({summary['faults']} faults x {n_seeds} seeds {summary['seeds']}, plus the clean "
        f"matrix of each target); {counts}. A crash is an outcome. Generated by `make bench`; definitions in "
        "harness/score.py. Timings (wall time, hook seconds, overhead) are in timings.json. The same results as a "
        "page: index.html (sortable tables, a drill-down per fault and per detector; open it in a browser).",
        "",
        "## Headline",
        "",
        *headline_lines(summary),
        "",
        "![summary: registry, fault sets, per subsystem](summary.png)",
        "",
        "Heatmaps (detector x fault, per target and track): " + ", ".join(
            f"[{t} {track}]({heatmap_name(t, track)})" for t in summary["targets"]
            for _, key, track in SUITES if summary["targets"][t].get(key)) + ".",
        "",
        _coverage_line(),
        "",
        "## Targets side by side",
        "",
        "Each target's detection and localization over its own fault cases, false positives over its own clean "
        "matrix (`ref`: the reference in model/; `hf`: transformers' Llama under Trainer).",
        "",
        *side_by_side(summary),
        *extra,
    ]
    for target, scores in summary["targets"].items():
        out += target_section(target, scores, summary["goals"], registry)
    return "\n".join(out) + "\n"


def target_section(target: str, scores: dict, goals: dict, registry) -> list[str]:
    """A target's part of the leaderboard: its goals, detectors, faults, blind spots and unrunnable faults."""
    out = ["", f"## Target {target}", "", "### Goals", "", *goal_lines(scores, goals), "", "### Detectors", "",
           *score_table(scores, registry), "", "### Per fault (suite)", "",
           "Counted over the cases where the fault showed (its run differed from the clean case of the same "
           "target, recipe and seed); \"did not show\" counts the others, which are not scored.", "",
           "| fault | subsystem | recipes | did not show | detected | top-1 subsystem | top-1 seam | latency (steps) |",
           "|---|---|---|---|---|---|---|---|"]
    for fault_id, e in sorted(scores["per_fault"].items(), key=lambda kv: (kv[1]["subsystem"], kv[0])):
        lat = ", ".join(map(str, e["latencies"])) or "-"
        shown = e["cases"] - e["not_shown"]
        out.append(f"| {fault_id} | {e['subsystem']} | {', '.join(e['recipes'])} | {e['not_shown']}/{e['cases']} | "
                   f"{e['detected']}/{shown} | {e['top1_subsystem']}/{shown} | {e['top1_seam']}/{shown} | {lat} |")
    return out + blind_spot_lines(scores)


def blind_spot_lines(summary: dict) -> list[str]:
    """Faults the detectors missed (where they showed), apart from faults that did not show in some case and
    faults no recipe of the matrix can show at all ("not runnable in the matrix")."""
    per = summary["per_fault"]
    shown = {f: e["cases"] - e["not_shown"] for f, e in per.items()}
    missed = [f for f, e in per.items() if e["detected"] < shown[f]]
    mislocated = [f for f, e in per.items() if e["top1_subsystem"] < shown[f]]
    silent = [f"{f} ({e['not_shown']}/{e['cases']})" for f, e in per.items() if e["not_shown"]]
    out = ["", "### Blind spots", "",
           f"- detector missed (the fault showed, no finding) on some case: {', '.join(sorted(missed)) or 'none'}",
           f"- top-1 subsystem wrong on some case: {', '.join(sorted(mislocated)) or 'none'}",
           f"- fault did not show (its run matched the clean one; not scored) on some case: "
           f"{', '.join(sorted(silent)) or 'none'}",
           "", "### Not runnable in the matrix", ""]
    unrunnable = summary.get("not_runnable", {})
    if not unrunnable:
        return out + ["Every fault's manifest is met by some recipe."]
    return out + ["| fault | why |", "|---|---|"] + [f"| {f} | {why} |" for f, why in sorted(unrunnable.items())]


def write_results(out: Path, rows: list[dict], summary: dict, timings: dict, faults: dict[str, dict],
                  registry, extra: list[str] = (), set_rows: list[dict] = ()) -> None:
    """Every output rendered first, then each file replaced atomically: a failure while rendering leaves the
    previous results whole. ``extra``: lines the leaderboard ends its overview with; ``set_rows``: the fault sets
    side by side (``harness.sets.sets_rows``) for the summary figure and the page."""
    if not rows:
        raise ValueError(f"the bench produced no case: nothing written, {out}/ left as it was")
    from faultbench.harness.page import render

    files = {"bench.csv": csv_text(rows).encode(), "timings.csv": csv_text(rows, TIMING_COLUMNS).encode(),
             "summary.json": (json.dumps(summary, indent=2) + "\n").encode(),
             "timings.json": (json.dumps(timings, indent=2) + "\n").encode(),
             "leaderboard.md": leaderboard(summary, faults, registry, extra).encode(),
             **render(rows, faults, registry, list(set_rows))}
    for name, data in files.items():
        write_bytes(Path(out) / name, data)


def print_table(summary: dict, registry, timings: dict | None = None, file=None) -> None:
    """Each target's detector table and goals (``timings``: timings.json's object, for the overhead columns)."""
    for target, scores in summary["targets"].items():
        per = (timings or {}).get("detectors", {}).get(target, {}) if timings is not None else None
        rows = score_rows(scores, registry, per)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        print(f"target {target}: {scores['cases']} cases, {scores['faults']} faults", file=file)
        for r in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)), file=file)
        print("\n".join(goal_lines(scores, summary["goals"], per)), file=file)
