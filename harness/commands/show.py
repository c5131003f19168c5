"""``faultbench show``: a fault's metadata and its diff against the clean seam."""

from __future__ import annotations

import argparse
import json

from faultbench.harness.commands import load_plugins


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("fault_id")
    parser.add_argument("--plugin", action="append")
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    from faultbench.faults.inject import diff
    from faultbench.faults.registry import get_fault

    load_plugins(args)
    spec = get_fault(args.fault_id)
    meta = spec.metadata()
    if args.json:
        print(json.dumps({**meta, "diff": diff(spec.id)}, indent=2))
        return 0
    print(f"{spec.id}: {spec.title}")
    for key in ("target", "subsystem", "also_acceptable", "seams", "trigger", "symptoms"):
        value = meta[key]
        print(f"  {key:<16} {', '.join(value) if isinstance(value, (list, tuple)) else value}")
    print(f"\nwhat is wrong:\n  {spec.explanation}\n\nfix:\n  {spec.fix}\n\nmodels:")
    for ref in spec.references:
        print(f"  - {ref}")
    print("\n" + diff(spec.id))
    return 0
