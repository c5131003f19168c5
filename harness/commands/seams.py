"""``faultbench seams``: a target's seams with their subsystem and file:line."""

from __future__ import annotations

import argparse
import json

from faultbench.harness.commands import target_name


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=target_name, default="ref", help="ref (default) or hf")
    parser.add_argument("--json", action="store_true")


def seam_rows(target: str) -> list[dict]:
    """Every seam of ``target`` with its subsystem and definition's file:line (relative to this repository, or
    to the installed package's folder: ``transformers/trainer.py``), in table order."""
    import inspect

    from faultbench import targets
    from faultbench.faults.inject import display_path

    stack = targets.get(target)
    rows = []
    for name, subsystem in stack.seams().items():
        fn = inspect.unwrap(stack.resolve(name))
        _, line = inspect.getsourcelines(fn)
        rows.append({"name": name, "subsystem": subsystem, "file": display_path(inspect.getsourcefile(fn)),
                     "line": line})
    return rows


def run(args) -> int:
    table = seam_rows(args.target)
    if args.json:
        print(json.dumps(table, indent=2))
    else:
        width = max(len(s["name"]) for s in table)
        for s in table:
            print(f"{s['subsystem']:<11} {s['name']:<{width}}  {s['file']}:{s['line']}")
    return 0
