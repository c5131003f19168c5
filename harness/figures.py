"""The bench's figures: a one-page summary (the README embeds it) and a detector x fault heatmap per target and
track, each sized to be read: the summary is 1200 x 800 pixels; a heatmap puts faults on rows (at most
``MAX_FAULT_ROWS``; a larger set, the mutants, gets one row per subsystem) and stays under 2000 pixels tall.

Everything is drawn from bench rows (bench.csv's, or the scorer's before they are written) and the fault sets'
rows (``harness.sets.sets_rows``), so ``python -m faultbench.harness.page DIR`` redraws them without a rerun.
"""

from __future__ import annotations

import io
import statistics

from faultbench.harness.score import BLACKBOX, SUITE

TRACKS = (("white-box", SUITE), ("black-box", BLACKBOX))  # track -> the row name of its suite in bench rows
MAX_FAULT_ROWS = 80  # more faults than this: one heatmap row per subsystem (each cell a mean over its faults)
DPI = 100
HEADLINE = (("detected", "detection"), ("top1_subsystem", "top-1 subsystem"), ("top1_seam", "top-1 seam"))
COLOURS = ("#1b9e77", "#66c2a5", "#d95f02", "#fc8d62")  # ref white, ref black, hf white, hf black


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig, plt) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def shown(rows: list[dict]) -> list[dict]:
    """The fault rows the scorer counts: the fault showed (or no clean twin said otherwise)."""
    return [r for r in rows if r["fault"] and r.get("manifested") is not False]


def _mean(values) -> float | None:
    values = [float(bool(v)) for v in values]
    return sum(values) / len(values) if values else None


SCORES = ("cases", *(key for key, _ in HEADLINE), "fp")  # what ``scores`` gives, in table order


def scores(rows: list[dict]) -> dict:
    """Over one detector's (or track suite's) rows: its shown fault cases, detection, Top-1 subsystem and seam (means
    over them), FP (over the clean cases)."""
    faulty = shown(rows)
    return {"cases": len(faulty), **{key: _mean(r[key] for r in faulty) for key, _ in HEADLINE},
            "fp": _mean(r["detected"] for r in rows if not r["fault"])}


def headline(rows: list[dict]) -> list[dict]:
    """Per target and track, the ``scores`` of the track's suite (where it has shown fault cases)."""
    out = []
    for target in dict.fromkeys(r["target"] for r in rows):
        for track, suite in TRACKS:
            s = scores([r for r in rows if r["target"] == target and r["detector"] == suite])
            if s["cases"]:
                out.append({"target": target, "track": track, **s})
    return out


def per_subsystem(rows: list[dict], faults: dict[str, dict]) -> dict[tuple[str, str], dict[str, float]]:
    """(target, track) -> {subsystem: Top-1 subsystem rate over its shown fault cases}."""
    out: dict[tuple[str, str], dict[str, list]] = {}
    for r in shown(rows):
        track = dict((s, t) for t, s in TRACKS).get(r["detector"])
        if track and r["fault"] in faults:
            out.setdefault((r["target"], track), {}).setdefault(faults[r["fault"]]["subsystem"], []).append(
                r["top1_subsystem"])
    return {k: {s: _mean(v) for s, v in sorted(subs.items())} for k, subs in out.items()}


def summary_figure(rows: list[dict], faults: dict[str, dict], set_rows: list[dict]) -> bytes:
    """The one-page summary: the registry's headline, detection and Top-1 subsystem per fault set (the blind sets
    as their mean, with the range as a bar), and Top-1 subsystem per subsystem; PNG bytes, 1200 x 800."""
    import numpy as np

    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    head = headline(rows)
    combos = [(h["target"], h["track"]) for h in head]
    labels = [f"{t} {k}" for t, k in combos]
    colours = dict(zip([("ref", "white-box"), ("ref", "black-box"), ("hf", "white-box"), ("hf", "black-box")],
                       COLOURS, strict=True))

    ax = axes[0, 0]
    metrics = [*HEADLINE, ("fp", "false positives")]
    width = 0.8 / max(len(head), 1)
    for i, h in enumerate(head):
        values = [h[key] or 0.0 for key, _ in metrics]
        bars = ax.bar(np.arange(len(metrics)) + i * width, values, width, label=labels[i],
                      color=colours.get(combos[i], "grey"))
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(np.arange(len(metrics)) + width * (len(head) - 1) / 2, [m for _, m in metrics], fontsize=9)
    ax.set_ylim(0, 1.12)
    ax.set_title("registry: every fault x seeds (make bench)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right", ncol=2)

    for ax, (metric, name) in zip(axes[1], (("detection_rate", "detection"), ("top1_subsystem", "top-1 subsystem")),
                                  strict=True):
        _sets_panel(ax, set_rows, combos, labels, metric, name)

    ax = axes[0, 1]
    subs = per_subsystem(rows, faults)
    names = sorted({s for per in subs.values() for s in per}) or ["(no fault metadata)"]
    grid = np.array([[subs.get(c, {}).get(s, np.nan) for c in combos] for s in names])
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        ax.text(j, i, "-" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(combos)), labels, fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_title("registry: top-1 subsystem per subsystem", fontsize=10)
    fig.suptitle("faultbench: detection and localization, registry vs faults the detectors never saw", fontsize=12)
    fig.tight_layout()
    return _png(fig, plt)


def _sets_panel(ax, set_rows: list[dict], combos, labels, metric: str, name: str) -> None:
    """One metric per target/track for the registry, the unseen plugin, the blind sets (mean, range) and mutants."""
    import numpy as np

    groups = [("registry", lambda s: s == "registry"), ("blind sets", lambda s: s.startswith("blind")),
              ("mutants", lambda s: s == "mutants")]
    width = 0.8 / len(groups)
    for g, (group, member) in enumerate(groups):
        values, lows, highs = [], [], []
        for target, track in combos:
            got = [r[metric] for r in set_rows
                   if member(r["set"]) and r["target"] == target and r["track"] == track and r[metric] is not None]
            mean = statistics.fmean(got) if got else 0.0
            values.append(mean)
            lows.append(mean - min(got, default=mean))
            highs.append(max(got, default=mean) - mean)
        n_blind = len({r["set"] for r in set_rows if member(r["set"])})
        label = f"{group} (mean of {n_blind}, range)" if group == "blind sets" else group
        bars = ax.bar(np.arange(len(combos)) + g * width, values, width, label=label,
                      yerr=[lows, highs] if group == "blind sets" else None, capsize=3,
                      color=("#4c72b0", "#dd8452", "#8c8c8c")[g])
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(np.arange(len(combos)) + width, labels, fontsize=8)
    ax.set_ylim(0, 1.3)
    ax.set_title(f"{name} by fault set", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncol=3)


def heatmap_grid(rows: list[dict], faults: dict[str, dict], detectors: list[str]):
    """Fault (or, past ``MAX_FAULT_ROWS`` faults, subsystem) x detector: found with an acceptable subsystem first
    (1), found with another first (0.5), missed (0), averaged over the shown cases; (grid, row labels)."""
    import numpy as np

    ids = sorted({r["fault"] for r in shown(rows) if r["fault"] in faults},
                 key=lambda f: (faults[f]["subsystem"], f))
    by_subsystem = len(ids) > MAX_FAULT_ROWS
    keys = sorted({faults[f]["subsystem"] for f in ids}) if by_subsystem else ids
    sums = np.zeros((len(keys), len(detectors)))
    counts = np.zeros_like(sums)
    col = {d: j for j, d in enumerate(detectors)}
    row_of = {f: keys.index(faults[f]["subsystem"] if by_subsystem else f) for f in ids}
    for r in shown(rows):
        if r["fault"] in row_of and r["detector"] in col:
            i, j = row_of[r["fault"]], col[r["detector"]]
            counts[i, j] += 1
            sums[i, j] += 1.0 if r["top1_subsystem"] else 0.5 if r["detected"] else 0.0
    grid = np.divide(sums, counts, out=np.full_like(sums, np.nan), where=counts > 0)
    n_per = {k: sum(faults[f]["subsystem"] == k for f in ids) for k in keys} if by_subsystem else {}
    labels = [f"{k} ({n_per[k]} faults)" for k in keys] if by_subsystem else [
        f"{f}  [{faults[f]['subsystem']}]" for f in keys]
    return grid, labels


def heatmap(rows: list[dict], faults: dict[str, dict], detectors: list[str], title: str) -> bytes:
    """One target and track's heatmap (``rows`` of that target; ``detectors``: the track's suite first, then
    its detectors); PNG bytes."""
    plt = _pyplot()
    grid, labels = heatmap_grid(rows, faults, detectors)
    fig, ax = plt.subplots(figsize=(3.5 + 0.22 * len(detectors), 2.2 + 0.2 * max(len(labels), 8)))
    cmap = plt.get_cmap("Greens").with_extremes(bad="#d0d0d0")  # grey: no shown case of that fault there
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(detectors)), detectors, rotation=90, fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout()
    return _png(fig, plt)


def heatmap_name(target: str, track: str) -> str:
    return f"heatmap_{target}_{track.split('-')[0]}.png"


def track_detectors(rows: list[dict], registry, track: str) -> list[str]:
    """The track's suite, then its detectors that ran (``registry``: detector id -> class, with ``track``)."""
    suite = dict(TRACKS)[track]
    ran = dict.fromkeys(r["detector"] for r in rows)
    members = sorted(d for d in ran if d in registry and registry[d].track == track)
    if not members:
        return []
    return [suite, *members] if suite in ran else members


def heatmaps(rows: list[dict], faults: dict[str, dict], registry) -> dict[str, bytes]:
    """{file name: PNG} per target and track that ran: heatmap_<target>_<track>.png."""
    out = {}
    for target in dict.fromkeys(r["target"] for r in rows):
        mine = [r for r in rows if r["target"] == target]
        for track, _ in TRACKS:
            detectors = track_detectors(mine, registry, track)
            if detectors and shown(mine):
                title = (f"target {target}, {track}: found with the right subsystem first (dark), another first "
                         "(light), missed (white), no shown case (grey)")
                out[heatmap_name(target, track)] = heatmap(mine, faults, detectors, title)
    return out
