"""``faultbench contracts``: the contract catalogue and the detectors' coverage of it."""

from __future__ import annotations

import argparse
import json


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="a list of {id, component, kind, statement, source, tracks, detectors, uncheckable}")


def run(args) -> int:
    from faultbench.detectors import contracts

    if args.json:
        print(json.dumps(contracts.as_json(), indent=2))
        return 0
    print(contracts.markdown(), end="")
    return 0
