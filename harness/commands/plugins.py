"""``faultbench plugins``: what loads code into faultbench."""

from __future__ import annotations

import argparse
import json


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    """What loads code into faultbench: installed entry points (always) and ``--plugin`` files (only when named)."""
    from importlib.metadata import entry_points

    from faultbench.detectors.api import DETECTOR_ENTRY_POINTS
    from faultbench.faults.registry import ENTRY_POINT_GROUP

    groups = (ENTRY_POINT_GROUP, DETECTOR_ENTRY_POINTS)
    found = [{"group": group, "name": ep.name, "loads": ep.value, "from": ep.dist.name if ep.dist else None}
             for group in groups for ep in entry_points(group=group)]
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    for ep in found:
        print(f"{ep['group']:<22} {ep['name']:<20} {ep['loads']:<40} installed by {ep['from'] or 'an unknown one'}")
    print(f"{len(found)} entry point(s) of groups {', '.join(groups)}, loaded by every command. A --plugin file or "
          "module loads only when a command line names it (never because a bundle or a cache names it).")
    return 0
