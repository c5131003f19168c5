"""``faultbench bench``: the matrix run, scored and written; or one shard of it (``--shard K/N``), for ``merge``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from faultbench.harness.atomic import check_output
from faultbench.harness.commands import MAX_JOBS, MAX_SEEDS, at_most, new_file, targets_or_all
from faultbench.harness.costs import COSTS
from faultbench.harness.shard import SHARD_FILE


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: one seed unless --seeds says otherwise, and one fault per subsystem and "
                             "target (the first by id) unless --fault names them, with the whole clean matrix")
    parser.add_argument("--exclusive", action="store_true",
                        help="also run the exclusive detectors (anomaly mode: a second run of every case), as naming "
                             "one in --detectors does")
    parser.add_argument("--seeds", type=at_most(MAX_SEEDS), help="seeds 0..N-1 (default 3; 1 with --quick)")
    parser.add_argument("--target", type=targets_or_all, default="all", metavar="ref|hf|all",
                        help="the stacks whose faults and clean matrix run (default all)")
    parser.add_argument("--plugin", action="append", help="load faults/detectors from a .py file or module")
    parser.add_argument("--only-plugin-faults", action="store_true", help="score only the plugins' faults")
    parser.add_argument("--fault", action="append", help="only this fault (repeatable)")
    parser.add_argument("--blind", action="store_true",
                        help="a blind set: progress, table and messages name no case, fault or detector (aggregates "
                             "only; the full scores are still written to --out for the set's authors)")
    parser.add_argument("--detectors", nargs="+", metavar="ID", help="detector ids, 'all' (default), 'suite'")
    parser.add_argument("--jobs", type=at_most(MAX_JOBS), default=2, help="cases run in parallel (default 2)")
    parser.add_argument("--mutants", action="store_true",
                        help="score the admitted mutant set (faults/mutants/mutants-v1.json) instead of the registry: "
                             "one seed unless --seeds says otherwise, written to results/mutants/ unless --out says")
    parser.add_argument("--out", help="output folder (default results/)")
    parser.add_argument("--force", action="store_true",
                        help="write into an --out or --bundles folder that holds files of something else")
    parser.add_argument("--no-cache", action="store_true", help="recompute every case")
    parser.add_argument("--bundles", metavar="DIR",
                        help="write a repro bundle for every case where a detector fires (runs every case anew)")
    parser.add_argument("--json", action="store_true", help="table on stderr; last stdout line is summary.json")
    parser.add_argument("--junit", metavar="FILE", type=new_file,
                        help="also write the goals and each detector's false positives as JUnit XML (a failure per "
                             "unmet goal or false positive)")
    parser.add_argument("--shard", type=shard_arg, metavar="K/N",
                        help="run the K-th of N parts of equal measured cost and write its shard.json (default --out "
                             "shards/K-of-N) for faultbench merge")
    parser.add_argument("--costs", metavar="FILE",
                        help=f"with --shard: the cost table the matrix is cut by (default {COSTS}; a case it lacks "
                             "is estimated)")


MAX_SHARDS = 1000


def shard_arg(text: str) -> tuple[int, int]:
    """``K/N``: the K-th of N shards, 1 <= K <= N <= ``MAX_SHARDS``."""
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n) <= MAX_SHARDS):
        raise argparse.ArgumentTypeError(f"expected K/N with 1 <= K <= N <= {MAX_SHARDS}, got {text!r}")
    return int(k), int(n)


def _names_exclusive(names) -> bool:
    """Whether ``--detectors`` names an exclusive detector itself (``all`` leaves them out: each doubles the bench)."""
    from faultbench.detectors.api import all_detectors

    registry = all_detectors()
    return any(n in registry and registry[n].exclusive for n in names)


def run(args) -> int:
    from faultbench.harness.bench import BenchConfig, run_bench

    seeds = tuple(range(args.seeds or (1 if args.quick or args.mutants else 3)))
    if args.shard is not None and args.out is None:
        args.out = "shards/{}-of-{}".format(*args.shard)
    if args.mutants:  # the admitted mutant set, scored as its own set (results/mutants/ unless --out says)
        from faultbench.harness.mutants import ADMITTED_PLUGIN

        args.plugin = [*(args.plugin or ()), ADMITTED_PLUGIN]
        args.only_plugin_faults = True
        args.out = args.out or "results/mutants"
    args.out = check_output("results" if args.out is None else args.out, "--out", force=args.force,
                            folder_of="summary.json" if args.shard is None else SHARD_FILE)
    if args.bundles is not None:
        check_output(args.bundles, "--bundles", force=args.force, folder_of="*/bundle.json")
    if args.only_plugin_faults and not args.plugin:
        raise ValueError("--only-plugin-faults needs a --plugin that registers faults")
    cfg = BenchConfig(seeds=seeds, targets=args.target, detectors=tuple(args.detectors or ("all",)),
                      plugins=tuple(args.plugin or ()),
                      exclusive=args.exclusive or _names_exclusive(args.detectors or ()),
                      per_subsystem=1 if args.quick and not args.fault else None,
                      only_plugin_faults=args.only_plugin_faults, faults=tuple(args.fault) if args.fault else None,
                      jobs=args.jobs, out=Path(args.out), use_cache=not args.no_cache, progress=not args.json,
                      blind=args.blind, bundles=Path(args.bundles) if args.bundles else None,
                      command=tuple(args.command_line))
    if args.fault:
        from faultbench.faults.registry import get_fault, load_plugin

        for plugin in cfg.plugins:
            load_plugin(plugin)
        for fault_id in args.fault:
            get_fault(fault_id)
    if args.shard is not None:
        return _shard(args, cfg)
    report(args, run_bench(cfg))
    return 0


def _shard(args, cfg) -> int:
    """Run this host's shard and say how to merge it."""
    from faultbench.harness.shard import run_shard

    options = {"blind": args.blind, "only_plugin_faults": args.only_plugin_faults, "mutants": args.mutants}
    doc = run_shard(cfg, args.shard, COSTS if args.costs is None else args.costs, options)
    k, n = doc["shard"]
    done = {"shard": f"{k}/{n}", "cases": len(doc["records"]), "of": len(doc["cases"]),
            "cached_cases": doc["cached_cases"], "wall_s": doc["wall_s"], "file": str(args.out / SHARD_FILE)}
    print(f"shard {k}/{n}: {done['cases']} of {done['of']} cases ({done['cached_cases']} cached) in "
          f"{done['wall_s']:.0f}s, written to {done['file']}; once every shard has run: faultbench merge DIR... "
          "--out results", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(done))
    return 0


def report(args, summary: dict) -> None:
    """What a bench (or a merge) prints and writes after its results: the table (aggregates only for a blind set),
    the plugin and mutant reports, where it all went; ``--json``: the table on stderr, summary.json's object last."""
    from faultbench.detectors.api import all_detectors
    from faultbench.harness.report import print_table

    stream = sys.stderr if args.json else sys.stdout
    timings = json.loads((Path(args.out) / "timings.json").read_text())
    if args.blind:  # the aggregates only: the detector table and blind spots would name what the set missed
        from faultbench.harness.sets import aggregates_only

        summary = aggregates_only(summary)
        print(json.dumps(summary["targets"], indent=1), file=stream)
    else:
        print_table(summary, all_detectors(), timings, file=stream)
    _mutant_reports(args)
    if getattr(args, "junit", None):
        from faultbench.harness.atomic import write_text
        from faultbench.harness.report import junit_xml

        write_text(Path(args.junit), junit_xml(summary, timings))
    print(f"results written to {args.out}/ (scores: bench.csv, summary.json, leaderboard.md, summary.png, "
          "heatmap_*.png, index.html; "
          "timings: timings.csv, timings.json, costs.json)", file=stream)
    if args.json:
        print(json.dumps(summary))


def _mutant_reports(args) -> None:
    """After a bench of plugin faults alone: their scores beside the registry's (results/summary.json), with the
    ratio, printed and written to generalization.md; after ``bench --mutants``: the mutant set's scores per operator
    and subsystem (by_operator.md); after a bench into results/ or results/mutants/, results/sets.md again."""
    from faultbench.harness import sets
    from faultbench.harness.atomic import write_text

    out = Path(args.out)
    registry = sets.summary_of(Path("results") / "summary.json")
    if args.only_plugin_faults and registry is not None and out.resolve() != Path("results").resolve():
        lines = sets.generalization_lines(sets.generalization(sets.summary_of(out / "summary.json"), registry))
        write_text(out / "generalization.md", "\n".join(["# The plugin's faults beside the registry's", "",
                                                          *lines]) + "\n")
        print("\n".join(["beside the registry (results/summary.json):", *lines]),
              file=sys.stderr if args.json else sys.stdout)
    if args.mutants:
        from faultbench.harness.mutants import read

        doc = read()
        rows = sets.breakdown(sets.read_rows(out / "bench.csv"), {m["id"]: m for m in doc["mutants"]})
        write_text(out / "by_operator.md", sets.breakdown_markdown(rows, doc["version"]))
    results = Path("results").resolve()
    if out.resolve() in (results, results / "mutants"):
        sets.write_sets(results)
