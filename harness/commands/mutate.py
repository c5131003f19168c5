"""``faultbench mutate``: the mutant set and each operator's admit rate (``--admit`` builds it)."""

from __future__ import annotations

import argparse
import json
import sys

from faultbench.harness.atomic import check_output
from faultbench.harness.commands import MAX_JOBS, MAX_SEEDS, at_most, positive_int, targets_or_all


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=targets_or_all, default="all", metavar="ref|hf|all")
    parser.add_argument("--admit", action="store_true",
                        help="generate, run and admit the set (about 30 minutes on 2 cores), then write it")
    parser.add_argument("--per-cell", type=at_most(MAX_SEEDS),
                        help="candidates run per (seam, operator), spread over its sites (default 4)")
    parser.add_argument("--sample", type=positive_int, help="with --admit: only the first N candidates per target")
    parser.add_argument("--jobs", type=at_most(MAX_JOBS), help="cases run in parallel (default 2)")
    parser.add_argument("--out", help="the admitted set's file (default faults/mutants/mutants-v1.json)")
    parser.add_argument("--force", action="store_true", help="with --admit: replace an existing file")
    parser.add_argument("--json", action="store_true", help="the admission table as JSON")


def run(args) -> int:
    from pathlib import Path

    from faultbench.harness import mutants

    out = Path(args.out) if args.out else None
    if args.admit:
        path = check_output(out or mutants.admitted_path(), "--out", force=args.force)
        given = {k: v for k, v in (("per_cell", args.per_cell), ("jobs", args.jobs)) if v is not None}
        doc = mutants.admit(args.target, **given, limit=args.sample, progress=not args.json)
        mutants.write(doc, path)
        print(f"{len(doc['mutants'])} mutants admitted in {doc['wall_s']:.0f}s: written to {path}",
              file=sys.stderr if args.json else sys.stdout)
    doc = mutants.read(out)
    table = mutants.admission_table(doc, args.target)
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    print(mutants.admission_markdown(table, doc))
    return 0
