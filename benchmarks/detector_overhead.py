"""Step-time cost of the passive detectors: the same case with and without them, side by side.

    python -m benchmarks.detector_overhead [--recipes fp32 accum left_pad] [--steps 120] [--repeats 5] [--json]

For each recipe the clean case runs ``repeats`` times with no detector, with the passive suite
detectors (those that work inside training steps), with the whole suite, with the black-box track's passive
detectors under a watch, and with the whole black-box suite. Each repeat runs every arm once, in an order
rotated from one repeat to the next, and each arm's training time per step (the steps only: probes at
start/end are not step time) is divided by the no-detector run of the same repeat: the ratio reported is the
median of these paired ratios, with their spread (a slow spell of the machine hits the arms of one repeat
alike). The bench reports the same quantity by accounting (time spent inside the detectors' step hooks); this
measures it end to end, hook dispatch and colder caches included. Target: passive / none <= 1.05 for each track.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from faultbench.detectors.api import all_detectors, black_box_suite_ids, suite_ids
from faultbench.harness.case import run_target_case
from faultbench.harness.golden import load_golden
from faultbench.harness.record import Case
from faultbench.targets.ref.recipes import RECIPES

TARGET = 1.05


def measure(recipe: str, steps: int, repeats: int) -> dict:
    registry = all_detectors()
    suite = tuple(suite_ids())
    passive = tuple(d for d in suite if registry[d].passive)
    golden = load_golden([recipe])[recipe]
    black = tuple(black_box_suite_ids())
    variants = {"none": (), "passive": passive, "suite": suite,
                "bb_passive": tuple(d for d in black if registry[d].passive), "blackbox": black}
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            record = run_target_case(Case(recipe, 0, (), variants[name]), golden)
            assert record["crash"] is None and not record["findings"], record["findings"] or record["crash"]
            times[name].append(record["train_s"] / len(record["history"]))
    ratios = {name: sorted(t / base for t, base in zip(times[name], times["none"], strict=True)) for name in names}
    return {"recipe": recipe, "steps": steps, "repeats": repeats,
            "ms_per_step": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "passive_ratio": statistics.median(ratios["passive"]), "suite_ratio": statistics.median(ratios["suite"]),
            "bb_passive_ratio": statistics.median(ratios["bb_passive"]),
            "blackbox_ratio": statistics.median(ratios["blackbox"]),
            "spread": {k: [v[0], v[-1]] for k, v in ratios.items() if k != "none"},
            "passive_detectors": len(passive), "bb_passive_detectors": len(variants["bb_passive"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["fp32", "accum", "left_pad"])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for recipe in args.recipes:
        if RECIPES[recipe].world_size > 1:
            raise SystemExit(f"{recipe}: single-process recipes only")
        # a longer run than the bench's so per-step timings are stable
        RECIPES[recipe] = dataclasses.replace(RECIPES[recipe], steps=args.steps)
        results.append(measure(recipe, args.steps, args.repeats))
    for r in results:
        ms = r["ms_per_step"]
        spread = {k: f"[{lo:.3f}, {hi:.3f}]" for k, (lo, hi) in r["spread"].items()}
        print(f"{r['recipe']:<9} none {ms['none']:.2f} ms/step  passive ({r['passive_detectors']}) "
              f"{ms['passive']:.2f} ms -> ratio {r['passive_ratio']:.3f} {spread['passive']}  whole suite "
              f"{ms['suite']:.2f} ms -> {r['suite_ratio']:.3f} {spread['suite']}  (target passive <= {TARGET})")
        print(f"{'':<9} black-box: passive ({r['bb_passive_detectors']}) {ms['bb_passive']:.2f} ms -> ratio "
              f"{r['bb_passive_ratio']:.3f} {spread['bb_passive']}  whole black-box suite {ms['blackbox']:.2f} ms -> "
              f"{r['blackbox_ratio']:.3f} {spread['blackbox']}  (paired ratios per repeat: median [min, max])")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
