"""``faultbench replay``: a repro bundle's case again."""

from __future__ import annotations

import argparse
import json
import sys

import torch


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle")
    parser.add_argument("--plugin", action="append",
                        help="a plugin the bundle's case names, given again (a bundle never loads code by itself)")
    parser.add_argument("--json", action="store_true", help="last stdout line is the JSON result")


def run(args) -> int:
    """Run a repro bundle's case again: the same finding, batch and state, or what differs (exit 1)."""
    from faultbench.harness.bundle import describe_replay, replay

    torch.set_num_threads(1)
    result = replay(args.bundle, tuple(args.plugin or ()))
    if args.json:
        print(describe_replay(result), file=sys.stderr)
        print(json.dumps(result, default=str))
    else:
        print(describe_replay(result))
    return 0 if result["reproduced"] else 1
