"""``faultbench merge``: the shards of a ``bench --shard K/N``, scored as one bench into the same results files."""

from __future__ import annotations

import argparse
from pathlib import Path

from faultbench.harness.atomic import check_output
from faultbench.harness.commands import bench, new_file


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shards", nargs="+", metavar="DIR", help="each shard's --out folder (or its shard.json)")
    parser.add_argument("--out", default="results", help="output folder (default results/)")
    parser.add_argument("--force", action="store_true", help="write into an --out folder that holds files of "
                                                             "something else")
    parser.add_argument("--plugin", action="append",
                        help="a plugin the shards' cases load, given again (a shard never loads code by itself)")
    parser.add_argument("--json", action="store_true", help="table on stderr; last stdout line is summary.json")
    parser.add_argument("--junit", metavar="FILE", type=new_file,
                        help="also write the goals and false positives as JUnit XML")


def run(args) -> int:
    from faultbench.harness.shard import merge

    args.out = check_output(args.out, "--out", force=args.force, folder_of="summary.json")
    summary, options = merge(args.shards, Path(args.out), tuple(args.plugin or ()))
    vars(args).update(options)  # blind, only_plugin_faults, mutants: reported as the shards' bench would
    bench.report(args, summary)
    return 0
