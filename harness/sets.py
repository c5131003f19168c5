"""The fault sets side by side: the registry, the unseen, blind and mutant sets, per target and track.

Each set is scored by its own bench run into its own folder (``make bench`` -> results/, the unseen plugin ->
results/unseen/, the blind plugins (benchmarks/blind/ to blind10/) -> results/blind/ to
results/blind10/, ``bench --mutants`` -> results/mutants/); this
reads their summary.json files and the bench rows of the mutant set, and renders one table (results/sets.md, and
a section of the leaderboard) plus the mutant set's scores per operator and per subsystem
(results/mutants/by_operator.md).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from faultbench.harness.report import _fmt
from faultbench.harness.score import BLACKBOX, SUITE

SETS = (("registry", "."), ("unseen", "unseen"), ("blind", "blind"), ("blind2", "blind2"),  # name, results/ folder
        ("blind3", "blind3"), ("blind4", "blind4"), ("blind5", "blind5"), ("blind6", "blind6"),
        ("blind7", "blind7"), ("blind8", "blind8"), ("blind9", "blind9"),
        ("blind10", "blind10"), ("mutants", "mutants"))
METRICS = (("detection_rate", "detection"), ("top1_subsystem", "top-1 subsystem"), ("top1_seam", "top-1 seam"),
           ("false_positive_rate", "FP"))
TRACKS = (("white-box", "suite"), ("black-box", "blackbox"))


def summary_of(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sets_rows(results: Path, registry: dict | None = None) -> list[dict]:
    """{set, target, track, faults, <metric>...} for every set whose summary.json is there (``registry``: the
    registry's summary, when it is being written and its file is not yet the new one)."""
    rows = []
    for name, folder in SETS:
        summary = registry if name == "registry" and registry is not None else summary_of(results / folder /
                                                                                          "summary.json")
        if summary is None:
            continue
        for target, scores in summary.get("targets", {}).items():
            for track, key in TRACKS:
                s = scores.get(key)
                if s and s.get("fault_cases"):
                    rows.append({"set": name, "target": target, "track": track, "faults": scores["faults"],
                                 "seeds": len(summary["seeds"]), **{m: s.get(m) for m, _ in METRICS}})
    return rows


def sets_markdown(rows: list[dict]) -> list[str]:
    out = ["| target | track | set | faults x seeds | " + " | ".join(label for _, label in METRICS) + " |",
           "|---|---|---|---|" + "---|" * len(METRICS)]
    for r in sorted(rows, key=lambda r: (r["target"], r["track"], [n for n, _ in SETS].index(r["set"]))):
        out.append(f"| {r['target']} | {r['track']} | {r['set']} | {r['faults']} x {r['seeds']} | "
                   + " | ".join(_fmt(r[m]) for m, _ in METRICS) + " |")
    return out


def generalization(plugin: dict, registry: dict) -> list[dict]:
    """A plugin's scores beside the registry's, per target and track where both ran: each metric of the plugin,
    the registry's, and their ratio (plugin / registry; how much of the home score carries to faults the
    detectors were not written for)."""
    rows = []
    for target, scores in plugin.get("targets", {}).items():
        home = registry.get("targets", {}).get(target, {})
        for track, key in TRACKS:
            mine, theirs = scores.get(key), home.get(key)
            if not (mine and theirs and mine.get("fault_cases")):
                continue
            for metric, label in METRICS:
                a, b = mine.get(metric), theirs.get(metric)
                ratio = a / b if a is not None and b else None
                rows.append({"target": target, "track": track, "metric": label, "plugin": a, "registry": b,
                             "ratio": None if metric == "false_positive_rate" else ratio})
    return rows


def generalization_lines(rows: list[dict]) -> list[str]:
    out = ["| target | track | metric | plugin | registry | plugin / registry |", "|---|---|---|---|---|---|"]
    out += [f"| {r['target']} | {r['track']} | {r['metric']} | {_fmt(r['plugin'])} | {_fmt(r['registry'])} | "
            f"{_fmt(r['ratio'])} |" for r in rows]
    return out


def sets_section(out: Path, summary: dict) -> list[str]:
    """The leaderboard's fault sets side by side, where ``out`` holds other sets' results beside this run's (the
    registry's ``summary``, not yet written); nothing when it holds none."""
    rows = sets_rows(out, registry=summary)
    if len({r["set"] for r in rows}) < 2:
        return []
    return ["", "## Fault sets side by side", "",
            "The registry (this run), the unseen plugin (unseen/), the blind sets (blind/ to blind10/, aggregates "
            "only) and the admitted mutant set (mutants/), each scored by its own bench run; the mutant set's "
            "per-operator scores are in mutants/by_operator.md.", "", *sets_markdown(rows)]


def write_sets(results: Path) -> Path:
    from faultbench.harness.atomic import write_text

    lines = ["# The fault sets side by side", "",
             "Each set scored by its own bench run: the registry (`make bench`, results/), the unseen plugin "
             "(examples/unseen_faults.py, results/unseen/), the blind sets (benchmarks/blind/ to "
             "benchmarks/blind10/, each written by someone who never read the detectors; aggregates only in "
             "results/blind/ to results/blind10/; all but blind10 are partly seen, see the README) and the admitted "
             "mutant set "
             "(`make bench-mutants`, results/mutants/). Detection and Top-1 are means over the cases where the fault "
             "showed; FP over each run's clean matrix.", "", *sets_markdown(sets_rows(results))]
    return write_text(results / "sets.md", "\n".join(lines) + "\n")


def read_rows(path: Path) -> list[dict]:
    """bench.csv's rows with the scorer's booleans back (``manifested`` None where it is empty)."""
    import csv

    flags = ("detected", "top1_subsystem", "top1_seam")
    with open(path, newline="") as f:
        return [{**r, **{k: r[k] == "True" for k in flags},
                 "manifested": {"True": True, "False": False}.get(r["manifested"])} for r in csv.DictReader(f)]


def breakdown(rows: list[dict], meta: dict[str, dict]) -> list[dict]:
    """The bench rows of mutants (``meta``: id -> its entry in the admitted set) per (target, track, by, key), by
    operator and by subsystem: cases where the mutant showed, detection, Top-1 subsystem and seam."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["detector"] not in (SUITE, BLACKBOX) or r["fault"] not in meta or r.get("manifested") is False:
            continue
        track = "white-box" if r["detector"] == SUITE else "black-box"
        for by in ("operator", "subsystem"):
            groups.setdefault((r["target"], track, by, meta[r["fault"]][by]), []).append(r)
    out = []
    for (target, track, by, key), group in sorted(groups.items()):
        n = len(group)
        latencies = [float(r["latency"]) for r in group if r.get("latency") not in (None, "")]
        out.append({"target": target, "track": track, "by": by, "key": key, "cases": n,
                    **{m: sum(bool(r[m]) for r in group) / n for m in ("detected", "top1_subsystem", "top1_seam")},
                    "median_latency": statistics.median(latencies) if latencies else None})
    return out


def breakdown_markdown(rows: list[dict], version: str) -> str:
    out = ["# Mutant set: scores per operator and per subsystem", "",
           f"Generated by `faultbench bench --mutants` ({version}); means over the cases where the mutant showed.", ""]
    for by in ("operator", "subsystem"):
        out += [f"## Per {by}", "", f"| target | track | {by} | cases | detection | top-1 subsystem | top-1 seam | "
                "median latency (steps) |", "|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['target']} | {r['track']} | {r['key']} | {r['cases']} | {r['detected']:.3f} | "
                f"{r['top1_subsystem']:.3f} | {r['top1_seam']:.3f} | {_fmt(r['median_latency'])} |"
                for r in rows if r["by"] == by]
        out.append("")
    return "\n".join(out)


def aggregates_only(summary: dict) -> dict:
    """A summary without its per-fault and per-detector parts: what a blind set's authors may publish, so that
    detector authors learn how the set scored, never which of its faults were missed."""
    keep = ("suite", "blackbox", "faults", "cases", "crashed_cases", "hung_cases")
    return {"cases": summary["cases"], "faults": summary["faults"], "seeds": summary["seeds"],
            "goals": summary.get("goals"),
            "targets": {t: {k: v[k] for k in keep if k in v} for t, v in summary["targets"].items()}}


if __name__ == "__main__":  # python -m faultbench.harness.sets SRC DST: DST = SRC's summary, aggregates only
    import sys

    from faultbench.harness.atomic import write_text

    source, dest = map(Path, sys.argv[1:3])
    write_text(dest, json.dumps(aggregates_only(json.loads(source.read_text())), indent=2) + "\n")
