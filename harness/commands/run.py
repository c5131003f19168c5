"""``faultbench run``: a fault's run next to the clean one, or in its bench recipe with detectors."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from faultbench.harness.atomic import check_output, check_replaceable
from faultbench.harness.commands import (
    MAX_STEPS,
    at_most,
    check_batch_split,
    load_plugins,
    positive_int,
    runnable_preset,
    seed_arg,
)
from faultbench.model.config import PAD_SIDES, PRECISIONS, PRESETS


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fault", action="append", required=True, help="fault id (repeatable)")
    parser.add_argument("--plugin", action="append", help="load faults from a .py file or module (repeatable)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=at_most(MAX_STEPS), help="optimizer steps (default: 100 on the reference; a "
                                                                 "fault of another target: its manifest's)")
    parser.add_argument("--seed", type=seed_arg, default=0)
    parser.add_argument("--precision", choices=PRECISIONS)
    parser.add_argument("--pad-side", choices=PAD_SIDES)
    parser.add_argument("--accum", type=positive_int)
    parser.add_argument("--world-size", type=int, default=1, choices=(1, 2))
    parser.add_argument("--plot", metavar="FILE.png", help="draw loss, grad norm, LR, scale, tokens/s: faulty vs clean")
    parser.add_argument("--force", action="store_true", help="replace an existing --plot file")
    parser.add_argument("--detectors", nargs="+", metavar="ID",
                        help="run the fault in its bench recipe with these detectors ('all', 'suite', 'baselines' or "
                             "ids) and show the ranked findings")
    parser.add_argument("--recipe", help="with --detectors: the bench recipe (default: the fault's)")
    parser.add_argument("--bundle", metavar="DIR",
                        help="with --detectors: where the repro bundle goes (default bundles/FAULT-RECIPE-sSEED)")
    parser.add_argument("--no-bundle", action="store_true", help="with --detectors: write no repro bundle")
    parser.add_argument("--json", action="store_true", help="last stdout line is a JSON report")


def run(args) -> int:
    from faultbench.faults.registry import get_fault
    from faultbench.harness.faulty_run import compare

    torch.set_num_threads(1)
    load_plugins(args)
    stacks = {get_fault(fault_id).target for fault_id in args.fault}  # unknown ids fail here, with a suggestion
    if len(stacks) > 1:
        raise ValueError(f"--fault: the faults belong to different targets ({', '.join(sorted(stacks))}); "
                         "run one target's faults at a time")
    (target,) = stacks
    if args.plot is not None:  # before the runs, not after them
        check_output(args.plot, "--plot", force=args.force)
    if args.detectors:
        return _run_detectors(args)
    if target != "ref":
        return _run_target(args, target)
    check_batch_split(runnable_preset(args.preset), args.world_size, args.accum)
    variant = {"train": {}, "data": {}}
    if args.precision:
        variant["train"]["precision"] = args.precision
    if args.pad_side:
        variant["data"]["pad_side"] = args.pad_side
    if args.accum:
        variant["train"]["accum"] = args.accum
    clean, faulty, report = compare(args.fault, variant, args.steps or 100, args.seed, args.world_size,
                                    tuple(args.plugin or ()), args.preset)
    if args.plot:
        from faultbench.harness.plot import plot_runs

        plot_runs({"clean": clean, "faulty": faulty}, args.plot, title=", ".join(args.fault))
        report["plot"] = args.plot
    _print_report(report, args.json)
    return 0


def _print_report(report: dict, as_json: bool) -> None:
    """A clean-vs-faulty report: readable on stdout, or readable on stderr and its JSON object on stdout."""
    from faultbench.harness.faulty_run import describe

    if as_json:
        print(describe(report), file=sys.stderr)
        print(json.dumps(report, default=str))
    else:
        print(describe(report))


def _run_target(args, target: str) -> int:
    """Clean vs faulty on another target than the reference: the fault's own proof scenario and variant (its
    manifest), ``--steps``/``--seed`` applied; the reference's config flags do not apply there."""
    from faultbench.faults.registry import get_fault
    from faultbench.harness.faulty_run import compare_target

    ignored = [flag for flag, value in (("--precision", args.precision), ("--pad-side", args.pad_side),
                                        ("--accum", args.accum), ("--plot", args.plot)) if value]
    if ignored or args.world_size != 1 or args.preset != "tiny":
        raise ValueError(f"{', '.join(ignored) or '--world-size/--preset'} configure the reference; a {target} fault "
                         "runs in its manifest's scenario and variant (--steps, --seed and --detectors apply)")
    manifest = get_fault(args.fault[0]).manifest
    steps = args.steps or manifest.steps
    _, _, report = compare_target(target, args.fault, manifest.scenario, manifest.variant, steps, args.seed,
                                  tuple(args.plugin or ()))
    _print_report(report, args.json)
    return 0


def _run_detectors(args) -> int:
    """The fault in its bench recipe with the detectors: the ranked findings with their evidence, and the
    repro bundle of the top finding."""
    from faultbench.harness.bundle import bundle_name
    from faultbench.harness.detect import case_recipe, describe_findings, detect

    bundle = None
    if not args.no_bundle:
        case = {"faults": args.fault, "recipe": case_recipe(args.fault, args.recipe), "seed": args.seed}
        bundle = args.bundle or f"bundles/{bundle_name(case)}"
        check_replaceable(bundle, "MANIFEST.sha256", "repro bundle")  # before the run, not after it
    record = detect(tuple(args.fault), args.seed, tuple(args.detectors), args.recipe, tuple(args.plugin or ()),
                    bundle=bundle, command=args.command_line)
    text = describe_findings(record)
    if record.get("bundle"):
        text += f"\nrepro bundle: {record['bundle']} (faultbench replay {record['bundle']})"
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps({k: record.get(k) for k in ("case", "crash", "findings", "detector_errors", "val_loss",
                                                     "bundle")}, default=str))
    else:
        print(text)
    return 0
