"""``faultbench page``: a results folder's figures and index.html, drawn again from its bench.csv (no rerun)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", nargs="?", default="results", type=Path, help="the results folder (default results/)")
    parser.add_argument("--plugin", action="append", default=[], help="the plugin whose faults the folder scored")


def run(args) -> int:
    from faultbench.detectors.api import all_detectors
    from faultbench.faults.registry import all_faults, load_plugin
    from faultbench.harness.atomic import write_bytes
    from faultbench.harness.page import render
    from faultbench.harness.sets import read_rows, sets_rows

    if not (args.out / "bench.csv").is_file():
        print(f"faultbench: error: {args.out}/bench.csv not found: run `make bench` first", file=sys.stderr)
        return 2
    for plugin in args.plugin:
        load_plugin(plugin)
    faults = {k: v.metadata() for k, v in all_faults(None).items()}
    for name, data in render(read_rows(args.out / "bench.csv"), faults, all_detectors(), sets_rows(args.out)).items():
        write_bytes(args.out / name, data)
    print(f"wrote {args.out}/index.html, summary.png and the heatmaps")
    return 0
