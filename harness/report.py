"""Bench outputs: bench.csv (case x detector), summary.json, leaderboard.md, heatmap.png, a printed table.

Scores and timings are kept apart: bench.csv, summary.json, leaderboard.md and heatmap.png hold only what
the runs' behaviour decides (byte-identical when a bench re-runs unchanged code), and timings.csv (train and
hook seconds per case x detector) and timings.json (wall time, cached cases, each detector's hook seconds
and overhead ratio) hold the clock's readings, which change on every run.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from harness.atomic import write_bytes, write_text
from harness.score import SUITE

COLUMNS = ("case", "fault", "recipe", "seed", "detector", "detected", "findings", "first_step", "latency",
           "top1_subsystem", "top3_subsystem", "rr_subsystem", "top1_seam", "top3_seam", "rr_seam",
           "manifested", "top_detector", "top_subsystem", "top_seam", "crash", "hang", "error")
TIMING_COLUMNS = ("case", "detector", "train_s", "step_s", "other_s")
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


def score_rows(summary: dict, registry, timings: dict | None = None) -> list[list[str]]:
    """The header, then the suite, then each detector (best Top-1 subsystem first), as cells; with ``timings``
    (timings.json's object) each detector's overhead and hook seconds too."""
    columns = SCORE_COLUMNS + (TIMING_SCORE_COLUMNS if timings else ())
    rows = [["detector", "kind", *(label for _, label in columns)]]
    entries = [(SUITE, "suite", summary["suite"])] if summary["suite"] else []
    ranked = sorted(summary["detectors"].items(), key=lambda kv: -(kv[1]["top1_subsystem"] or 0))
    entries += [(d, "baseline" if registry[d].baseline else registry[d].family, s) for d, s in ranked]
    per = (timings or {}).get("detectors", {})
    return rows + [[name, kind, *(_fmt({**s, **per.get(name, {})}.get(key)) for key, _ in columns)]
                   for name, kind, s in entries]


def score_table(summary: dict, registry) -> list[str]:
    """``score_rows`` as a markdown table."""
    head, *body = score_rows(summary, registry)
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def target_lines(summary: dict, timings: dict | None = None) -> list[str]:
    """The suite's targets as a markdown table; a timing target (overhead) is judged only with ``timings``
    (the leaderboard leaves it to timings.json, so that it stays byte-identical across re-runs)."""
    if summary["suite"] is None:  # e.g. a peer tool's run: the targets are the suite's
        return ["No suite detector ran in this bench, so the suite's targets do not apply."]
    suite = {**summary["suite"], **(timings or {}).get("detectors", {}).get(SUITE, {})}
    lines = ["| target | goal | measured | met |", "|---|---|---|---|"]
    for key, (op, goal) in summary["targets"].items():
        if key in TIMING_KEYS and timings is None:
            lines.append(f"| suite.{key} | {op} {goal} | a timing: see timings.json | - |")
            continue
        value = suite.get(key)
        met = value is not None and (value >= goal if op == ">=" else value <= goal)
        lines.append(f"| suite.{key} | {op} {goal} | {_fmt(value)} | {'yes' if met else 'NO'} |")
    return lines


def leaderboard(summary: dict, faults: dict[str, dict], registry) -> str:
    n_seeds = len(summary["seeds"])
    out = [
        "# faultbench leaderboard",
        "",
        f"{summary['cases']} cases ({summary['faults']} faults x {n_seeds} seeds {summary['seeds']}, plus the clean "
        f"matrix); {summary['crashed_cases']} cases crashed (a crash is an outcome), "
        f"{summary['hung_cases']} hung. Generated by `make bench`; definitions in harness/score.py. Timings (wall "
        "time, hook seconds, overhead) are in timings.json and timings.csv.",
        "",
        "## Targets",
        "",
        *target_lines(summary),
        "",
        "## Detectors",
        "",
        *score_table(summary, registry),
        "",
        "## Per fault (suite)",
        "",
        "Counted over the cases where the fault showed (its run differed from the clean case of the same recipe "
        "and seed); \"did not show\" counts the others, which are not scored.",
        "",
        "| fault | subsystem | recipes | did not show | detected | top-1 subsystem | top-1 seam | latency (steps) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fault_id, e in sorted(summary["per_fault"].items(), key=lambda kv: (kv[1]["subsystem"], kv[0])):
        lat = ", ".join(map(str, e["latencies"])) or "-"
        shown = e["cases"] - e["not_shown"]
        out.append(f"| {fault_id} | {e['subsystem']} | {', '.join(e['recipes'])} | {e['not_shown']}/{e['cases']} | "
                   f"{e['detected']}/{shown} | {e['top1_subsystem']}/{shown} | {e['top1_seam']}/{shown} | {lat} |")
    out += blind_spot_lines(summary)
    return "\n".join(out) + "\n"


def blind_spot_lines(summary: dict) -> list[str]:
    """Faults the detectors missed (where they showed), apart from faults that did not show in some case and
    faults no recipe of the matrix can show at all ("not runnable in the matrix")."""
    per = summary["per_fault"]
    shown = {f: e["cases"] - e["not_shown"] for f, e in per.items()}
    missed = [f for f, e in per.items() if e["detected"] < shown[f]]
    mislocated = [f for f, e in per.items() if e["top1_subsystem"] < shown[f]]
    silent = [f"{f} ({e['not_shown']}/{e['cases']})" for f, e in per.items() if e["not_shown"]]
    out = ["", "## Blind spots", "",
           f"- detector missed (the fault showed, no finding) on some case: {', '.join(sorted(missed)) or 'none'}",
           f"- top-1 subsystem wrong on some case: {', '.join(sorted(mislocated)) or 'none'}",
           f"- fault did not show (its run matched the clean one; not scored) on some case: "
           f"{', '.join(sorted(silent)) or 'none'}",
           "", "## Not runnable in the matrix", ""]
    unrunnable = summary.get("not_runnable", {})
    if not unrunnable:
        return out + ["Every fault's manifest is met by some recipe."]
    return out + ["| fault | why |", "|---|---|"] + [f"| {f} | {why} |" for f, why in sorted(unrunnable.items())]


def heatmap(rows: list[dict], faults: dict[str, dict]) -> bytes:
    """Detector x fault: share of seeds where the detector found the fault with an acceptable subsystem
    (full colour), found it elsewhere only (half), or missed it (blank); the PNG's bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fault_ids = sorted(faults, key=lambda f: (faults[f]["subsystem"], f))
    detectors = [SUITE] + sorted({r["detector"] for r in rows} - {SUITE})
    grid = np.zeros((len(detectors), len(fault_ids)))
    counts = np.zeros_like(grid)
    for r in rows:
        if not r["fault"] or r["fault"] not in faults:
            continue
        i, j = detectors.index(r["detector"]), fault_ids.index(r["fault"])
        counts[i, j] += 1
        grid[i, j] += 1.0 if r["rr_subsystem"] == 1.0 else 0.5 if r["detected"] else 0.0
    grid = np.divide(grid, counts, out=np.zeros_like(grid), where=counts > 0)
    fig, ax = plt.subplots(figsize=(max(10, len(fault_ids) * 0.26), max(4, len(detectors) * 0.28)))
    ax.imshow(grid, cmap="Greens", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(fault_ids)), [f"{faults[f]['subsystem']}: {f}" for f in fault_ids], rotation=90, fontsize=6)
    ax.set_yticks(range(len(detectors)), detectors, fontsize=7)
    ax.set_title("found with the right subsystem first (dark), found elsewhere (light), missed (white)", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_results(out: Path, rows: list[dict], summary: dict, timings: dict, faults: dict[str, dict],
                  registry) -> None:
    """Every output rendered first, then each file replaced atomically: a failure while rendering leaves the
    previous results whole."""
    if not rows:
        raise ValueError(f"the bench produced no case: nothing written, {out}/ left as it was")
    files = {"bench.csv": csv_text(rows).encode(), "timings.csv": csv_text(rows, TIMING_COLUMNS).encode(),
             "summary.json": (json.dumps(summary, indent=2) + "\n").encode(),
             "timings.json": (json.dumps(timings, indent=2) + "\n").encode(),
             "leaderboard.md": leaderboard(summary, faults, registry).encode(), "heatmap.png": heatmap(rows, faults)}
    for name, data in files.items():
        write_bytes(Path(out) / name, data)


def print_table(summary: dict, registry, timings: dict | None = None, file=None) -> None:
    rows = score_rows(summary, registry, timings)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)), file=file)
    print("\n".join(target_lines(summary, timings)), file=file)
