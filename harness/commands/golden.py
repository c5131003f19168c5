"""``faultbench golden record``: a golden envelope from a loop's known-good watched runs."""

from __future__ import annotations

import argparse
import json

from faultbench.harness.atomic import check_output


def arguments(parser: argparse.ArgumentParser) -> None:
    gold_sub = parser.add_subparsers(dest="golden_command", required=True)
    record = gold_sub.add_parser("record", help="a golden from watches saved with faultbench.watch(..., out=RUN.json)")
    record.add_argument("runs", nargs="+", metavar="RUN.json", help="known-good runs, each a watch's out= file")
    record.add_argument("--out", required=True, help="the golden's file, for faultbench.watch(..., golden=FILE)")
    record.add_argument("--force", action="store_true", help="replace an existing --out file")
    record.set_defaults(func=run)


def run(args) -> int:
    from faultbench.harness.atomic import write_text
    from faultbench.watch import golden_from_files

    out = check_output(args.out, "--out", force=args.force)
    golden = golden_from_files(args.runs)
    write_text(out, json.dumps(golden, indent=1))
    print(f"{out}: the envelope of {golden['runs']} known-good run{'s' * (golden['runs'] != 1)} over "
          f"{len(golden['steps'])} steps")
    return 0
