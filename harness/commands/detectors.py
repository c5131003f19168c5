"""``faultbench detectors``: the detector registry."""

from __future__ import annotations

import argparse
import json


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    from faultbench.detectors.api import all_detectors

    registry = all_detectors()
    if args.json:
        print(json.dumps([{"id": d, "family": c.family, "passive": c.passive, "baseline": c.baseline,
                           "exclusive": c.exclusive, "description": c.description} for d, c in registry.items()],
                         indent=2))
        return 0
    for d, c in sorted(registry.items(), key=lambda kv: (kv[1].baseline, kv[1].family, kv[0])):
        kind = "baseline" if c.baseline else c.family
        print(f"{kind:<11} {d:<28} {'passive' if c.passive else 'probe':<8} {c.description}")
    print(f"{len(registry)} detectors")
    return 0
