"""results/peers.md: the peer tools and our suites scored on the same cases, side by side.

Every tool's rows come from a bench.csv written by the same scorer (``harness.score.case_rows``): our two
suites (white-box, and black-box: the peers' own track) from results/bench.csv (``make bench``), the
anomaly-mode baseline and each peer from results/peers/<tool>/bench.csv (``make bench-peers``). The cases
are matched by name (fault/recipe/seed), so a tool's overhead is its case's training time over the same
case's time without any tool (the suite's run minus its step hooks, which is the plain run's time).

``python -m faultbench.peers.report [--results results]``
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from faultbench.harness.atomic import write_text
from faultbench.harness.score import BLACKBOX, SUITE, aggregate, exclusive_overhead

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Tool:
    id: str  # the detector column of its bench.csv
    name: str
    csv: str  # relative to the results folder
    approach: str  # a short, fair description of how it works and how it ran here
    caveats: str = ""  # what limits its score here that is not the tool's detection ability, said plainly


TOOLS = (
    Tool("suite", "faultbench suite", "bench.csv",
         "35 detectors: contract probes of each seam on crafted inputs, differential probes of the whole model, "
         "passive monitors against clean golden traces; each finding names a subsystem and a seam."),
    Tool("blackbox", "faultbench black-box suite", "bench.csv",
         "The detectors of the black-box track: they see the run only through faultbench.watch (module, optimizer "
         "and gradient hooks): behavioural probes of the causal-LM contract on the loop's own batch, the labels "
         "and weights implied by the logits' gradient, monitors of the optimizer, scaler and batches, and the "
         "envelope of known-good runs; a finding names the user's module or object. The peers' own track."),
    Tool("detect_anomaly", "torch.autograd.detect_anomaly", "peers/detect_anomaly/bench.csv",
         "PyTorch's anomaly mode for the whole run: a backward function that returns NaN raises, with the "
         "forward traceback of the op that made it; mapped to the innermost seam on that traceback."),
    Tool("torcheck", "torcheck 1.0.1", "peers/torcheck/bench.csv",
         "Registers checks on the optimizer (parameters change or not, no NaN/inf, output ranges); a failed check "
         "raises at optimizer.step; its message names the module/parameter, mapped to a subsystem.",
         "A failed check raises, so the run stops at the first one (as it would for a user)."),
    Tool("smdebug", "SageMaker Debugger rules (smdebug)", "peers/smdebug/bench.csv",
         "smdebug's PyTorch hook saves weights, gradients and losses every step; its built-in rules (vanishing "
         "gradient, exploding tensor, loss not decreasing, weight-update ratio, all-zero, unchanged tensor, ...) "
         "run on the saved steps with their documented defaults; a firing rule maps to a subsystem.",
         "The hook and the trial are smdebug's own, but no smdebug release on PyPI (0.4.14 to 1.0.34) ships the "
         "built-in rules' code (they run as SageMaker processing jobs), so the six rules evaluated are "
         "re-implemented from the SageMaker developer guide's definitions and default parameters "
         "(peers/smdebug_peer.py); rules for ReLU, images, classifiers and overfitting do not apply to this GPT."),
    Tool("traincheck", "TrainCheck 0.2.0", "peers/traincheck/bench.csv",
         "Instruments the training program's API calls, infers invariants from clean reference runs (golden "
         "seeds), and checks each run's trace against them; a violation names the API/variable, mapped to a "
         "subsystem and, where the API is a reference function, its seam.",
         "One seed (0): a traced case costs about 38 s (collect 22 s + check 16 s) against 0.3 s of training, so "
         "three seeds would take about an hour. The two-rank recipes are not run (traincheck-collect instruments "
         "one process; the bench's ranks live in a worker pool), so their 5 faults count as missed. No model "
         "tracking: inference crashes on traces made with the sampler tracker (KeyError 'proxy_obj_names'), so "
         "every invariant is about API calls. The check is offline, after the run: a violation's step is that "
         "of the event it names, which for a missing call can precede the trigger (scored as latency 0). One "
         "invariant is flaky on clean runs: 'GELU.forward() receives distinct arguments at each step' fired on one "
         "of two identical clean fp32 runs while the adapter was built, so its false-positive rate can read 1/9 "
         "on another run of the same cases."),
)


OURS = (SUITE, BLACKBOX)  # the white-box track's suite and the black-box track's, which the peers belong to


def _value(cell: str):
    if cell in ("True", "False"):
        return cell == "True"
    try:
        return float(cell)
    except ValueError:
        return cell if cell != "" else None


def _csv_rows(path: Path) -> list[dict]:
    with path.open() as f:
        return [{k: _value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def read_rows(results: Path, tool: Tool) -> list[dict]:
    """The tool's rows of its bench.csv, each with its timings from the timings.csv beside it (0 where absent)."""
    path = results / tool.csv
    if not path.exists():
        return []
    timing_path = path.with_name("timings.csv")
    timings = {(t["case"], t["detector"]): t for t in (_csv_rows(timing_path) if timing_path.exists() else [])}
    empty = {"train_s": 0.0, "loop_s": 0.0, "step_s": 0.0, "other_s": 0.0}
    return [{**empty, **timings.get((r["case"], r["detector"]), {}), **r}
            for r in _csv_rows(path)  # the peers ran on the reference: its rows only
            if r["detector"] == tool.id and r.get("target") in (None, "", "ref")]


def tool_scores(results: Path, tool: Tool, rows: list[dict]) -> dict:
    """``harness.score.aggregate`` over the tool's rows, with its overhead always from one run: the suite's
    from its hooks' share of the step time (aggregate's); an exclusive baseline of the bench against the same
    bench's suite case (``exclusive_overhead``); a peer from its side-by-side measurement (peers/overhead.py)."""
    scores = aggregate(rows, passive={})
    if tool.id in (SUITE, BLACKBOX):  # from its hooks' share of the step time, as the leaderboard counts it
        return scores
    if tool.id == "detect_anomaly":  # against the same cases of its own bench run with crash_triage only (no hooks)
        plain = read_rows(results, dataclasses.replace(tool, id="crash_triage"))
        scores["overhead_ratio"] = exclusive_overhead(plain + rows, tool.id, against="crash_triage")
    else:
        measured = results / "peers" / tool.id / "overhead.json"
        scores["overhead_ratio"] = json.loads(measured.read_text())["median_ratio"] if measured.exists() else None
    return scores


def per_fault(rows: list[dict]) -> dict[str, dict]:
    """Fault -> seeds, and on how many of them the tool detected / localized (subsystem, seam) it, and its
    latencies."""
    out: dict[str, dict] = {}
    for r in rows:
        if not r["fault"]:
            continue
        e = out.setdefault(r["fault"], {"seeds": 0, "detected": 0, "sub": 0, "seam": 0, "latencies": []})
        e["seeds"] += 1
        e["detected"] += bool(r["detected"])
        e["sub"] += bool(r["top1_subsystem"])
        e["seam"] += bool(r["top1_seam"])
        if r["latency"] is not None:
            e["latencies"].append(r["latency"])
    return out


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) and not value.is_integer() else f"{value:g}"


def beats(peer: dict[str, dict], ours: dict[str, dict]) -> list[str]:
    """Faults where the peer does better than our suite: more seeds detected or localized, or earlier."""
    lines = []
    for fault, p in sorted(peer.items()):
        o = ours.get(fault)
        if o is None:
            continue
        better = [f"{what} on {p[key]}/{p['seeds']} seeds vs our {o[key]}/{o['seeds']}"
                  for key, what in (("detected", "detected"), ("sub", "right subsystem first"),
                                    ("seam", "right seam first")) if p[key] > o[key]]
        if p["latencies"] and o["latencies"] and statistics.median(p["latencies"]) < statistics.median(o["latencies"]):
            better.append(f"found at step {statistics.median(p['latencies']):g} after the trigger vs our "
                          f"{statistics.median(o['latencies']):g}")
        if better:
            lines.append(f"`{fault}`: " + "; ".join(better))
    return lines


def render(results: Path) -> str:
    table = {t.id: read_rows(results, t) for t in TOOLS}
    ran = [t for t in TOOLS if table[t.id]]
    missing = [t for t in TOOLS if not table[t.id]]
    lines = [
        "# Peer tools on the same cases",
        "",
        "Written by `make bench-peers` (`python -m faultbench.peers.report`). Every tool ran on the same cases: each "
        "of the "
        "faults in the recipe its manifest points to, seeds 0, 1, 2, plus the clean matrix (every recipe x the same "
        "seeds) for false positives, scored by the same code as the leaderboard (`harness/score.py`). Our suite "
        "comes from results/bench.csv; anomaly mode and each peer from results/peers/<tool>/bench.csv.",
        "",
        "| tool | fault cases | clean cases | detection | false positives | Top-1 subsystem | Top-1 seam | "
        "median latency (steps) | overhead (x step time) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = {t.id: tool_scores(results, t, table[t.id]) for t in ran}
    for t in ran:
        s = summary[t.id]
        lines.append(f"| {t.name} | {s['fault_cases']} | {s['clean_cases']} | {_fmt(s['detection_rate'])} | "
                     f"{_fmt(s['false_positive_rate'])} | {_fmt(s['top1_subsystem'])} | {_fmt(s['top1_seam'])} | "
                     f"{_fmt(s['median_latency_steps'])} | {_fmt(s['overhead_ratio'], 2)} |")
    lines += ["", "Overhead, always from one run: our suite shares the run, so its figure is the step time with its "
              "hooks over the step time without them (the bench's accounting; `make perf` measures it end to end); "
              "anomaly mode's is its case's training time over the same case run without it in the same bench; each "
              "peer's comes from `python -m faultbench.peers.overhead TOOL`: the clean fp32, accum and left_pad cases "
              "with and "
              "without the tool, interleaved, median time per step (results/peers/<tool>/overhead.json).", ""]
    if missing:
        lines += ["Not scored (no results): " + ", ".join(f"{t.name} (`{t.csv}` is missing)" for t in missing), ""]
    lines += ["## How each tool works, and how it ran here", ""]
    lines += [f"- **{t.name}**: {t.approach}" + (f" *Caveats:* {t.caveats}" if t.caveats else "") for t in ran]
    lines.append("")

    faults = per_fault(table["suite"])
    by_tool = {t.id: per_fault(table[t.id]) for t in ran}
    lines += ["## Per fault", "",
              "Each cell: seeds detected / seeds with the right subsystem first / seeds with the right seam first.", "",
              "| fault | " + " | ".join(t.name for t in ran) + " |", "|---|" + "---|" * len(ran)]
    for fault in sorted(faults):
        cells = []
        for t in ran:
            e = by_tool[t.id].get(fault)
            cells.append(f"{e['detected']}/{e['sub']}/{e['seam']}" if e else "-")
        lines.append(f"| `{fault}` | " + " | ".join(cells) + " |")

    nobody = [f for f in sorted(faults) if not any(by_tool[t.id].get(f, {}).get("detected") for t in ran)]
    peers = [t for t in ran if t.id not in OURS]
    no_peer = [f for f in sorted(faults) if not any(by_tool[t.id].get(f, {}).get("detected") for t in peers)]
    lines += ["", "## Faults no tool catches", "",
              ("None: every fault is detected by at least one tool on at least one seed." if not nobody
               else ", ".join(f"`{f}`" for f in nobody)),
              "", f"Faults no peer catches on any seed ({len(no_peer)} of {len(faults)}): "
              + (", ".join(f"`{f}`" for f in no_peer) or "none") + ".", "",
              "## Where a peer beats our suites", ""]
    ours = [(t, by_tool[t.id]) for t in ran if t.id in OURS]
    for t in peers:
        for suite, scores in ours:
            won = beats(by_tool[t.id], scores)
            lines.append(f"- **{t.name}** vs the {suite.name}: " + ("; ".join(won) if won else
                         "on no fault (detection, localization or latency)") + ".")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    results = Path(args.results)
    write_text(results / "peers.md", render(results))
    print(f"wrote {results / 'peers.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
