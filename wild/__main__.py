"""``python -m wild`` (``make wild``): every wild program on 3 seeds clean, a golden from two of them, the
injected bugs against that golden, a baseline for the overhead; results/wild.md written atomically.

    python -m wild [--programs nanogpt,hf-gpt2] [--seeds 0,1,2] [--no-bugs] [--out results/wild.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import faultbench
from wild.programs import PROGRAMS
from wild.report import write_report
from wild.run import WORK, bugs_of, run_case


def run_program(program, seeds: list[int], with_bugs: bool, say) -> dict:
    runs = {"clean": {}, "golden_clean": None, "baseline": None, "bugs": {}}
    for seed in seeds:
        say(f"{program.name} clean seed {seed}")
        runs["clean"][seed] = run_case(program, seed, f"clean-{seed}", save=True)
    golden_path = None
    saved = [WORK / program.name / f"clean-{s}" / "watch.json" for s in seeds[1:]]
    if len(saved) >= 2 and all(p.exists() for p in saved):
        golden_path = WORK / program.name / "golden.json"
        try:
            faultbench.record_golden([json.loads(p.read_text()) for p in saved], str(golden_path))
        except ValueError as e:
            say(f"{program.name}: no golden ({e})")
            golden_path = None
    if golden_path is not None:
        say(f"{program.name} clean seed {seeds[0]} with the golden of seeds {seeds[1:]}")
        runs["golden_clean"] = run_case(program, seeds[0], "golden-clean", golden=golden_path)
    say(f"{program.name} baseline (no watch) seed {seeds[0]}")
    runs["baseline"] = run_case(program, seeds[0], "baseline", mode="none")
    if with_bugs:
        for bug in bugs_of(program.name):
            say(f"{program.name} bug {bug.name}")
            runs["bugs"][bug.name] = (bug, run_case(program, seeds[0], f"bug-{bug.name}", bug=bug, golden=golden_path))
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wild")
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--no-bugs", action="store_true")
    parser.add_argument("--out", default="results/wild.md")
    args = parser.parse_args(argv)
    names = [n for n in args.programs.split(",") if n]
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        parser.error(f"unknown program(s) {unknown}; known: {sorted(PROGRAMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    start = time.time()

    def say(msg):
        print(f"[wild {time.time() - start:6.0f}s] {msg}", file=sys.stderr, flush=True)

    results = {name: run_program(PROGRAMS[name], seeds, not args.no_bugs, say) for name in names}
    falses = write_report(results, seeds, args.out)
    say(f"wrote {args.out}")
    return 1 if falses else 0


if __name__ == "__main__":
    sys.exit(main())
