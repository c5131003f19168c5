"""``faultbench faults``: the registered faults of a target."""

from __future__ import annotations

import argparse
import json

from faultbench.harness.commands import load_plugins, targets_or_all
from faultbench.model.seams import SUBSYSTEMS


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--subsystem", choices=SUBSYSTEMS)
    parser.add_argument("--target", type=targets_or_all, default=("ref",), metavar="ref|hf|all",
                        help="whose faults (default ref)")
    parser.add_argument("--plugin", action="append", help="load faults from a .py file or module (repeatable)")
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    from faultbench.faults.registry import all_faults

    load_plugins(args)
    faults = [f for t in args.target for f in all_faults(t).values() if args.subsystem in (None, f.subsystem)]
    if args.json:
        print(json.dumps([f.metadata() for f in faults], indent=2))
        return 0
    for f in sorted(faults, key=lambda f: (f.target, f.subsystem, f.id)):
        print(f"{f.target:<4} {f.subsystem:<11} {f.id:<36} {f.trigger:<11} {','.join(f.symptoms):<22} {f.title}")
    print(f"{len(faults)} faults")
    return 0
