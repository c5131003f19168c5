"""The ``faultbench`` command line (``python -m faultbench``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from faultbench.harness.atomic import check_output, check_replaceable
from faultbench.model.config import PAD_SIDES, PRECISIONS, PRESETS, get_preset
from faultbench.model.seams import SUBSYSTEMS
from faultbench.paths import cache_dir, in_checkout


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (``faultbench bench: error: ...``), exit 2, no usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


MAX_SEEDS, MAX_JOBS, MAX_STEPS = 1000, 256, 10_000_000  # beyond these a count is a typo, not a plan


def _positive_int(text: str, most: int | None = None) -> int:
    """A count (seeds, steps, jobs, ...): an integer >= 1 (and <= ``most``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    if most is not None and value > most:
        raise argparse.ArgumentTypeError(f"expected at most {most}, got {value}")
    return value


def _runnable_preset(name: str):
    """The named preset, if this machine can run it: a CUDA preset without a CUDA device is refused in one line
    (it used to run and be reported as the fault's crash)."""
    preset = get_preset(name)
    if preset.train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"preset {name!r} trains on CUDA and this machine has no CUDA device "
                         "(torch.cuda.is_available() is False); use 'tiny' or 'small'")
    return preset


def _at_most(most: int):
    """``_positive_int`` up to ``most``: a count whose huge values would only exhaust memory or time."""
    def parse(text: str) -> int:
        return _positive_int(text, most)

    return parse


TRAIN_TIMEOUT_S = 3600.0  # train --world-size N: how long a hung rank may take
MAX_SEED = 2**32 - 1  # what every generator a run seeds accepts (numpy's is the narrowest)


def _seed(text: str) -> int:
    """A seed: an integer from 0 to ``MAX_SEED``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed from 0 to {MAX_SEED}, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def _target_name(text: str) -> str:
    """A target's name (``ref``, ``hf``); an unknown one is refused with the closest name."""
    from faultbench import targets

    try:
        targets.get(text) if text not in targets.names() else None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _targets_or_all(text: str) -> tuple[str, ...]:
    """``all`` (every target) or one target's name, as the tuple of targets meant."""
    from faultbench import targets

    return targets.names() if text == "all" else (_target_name(text),)


def _train(args) -> int:
    import os

    from faultbench.harness.training import train_on_rank, train_reference
    from faultbench.model.distributed import init_from_env

    torch.set_num_threads(args.threads)
    if args.save is not None:
        check_replaceable(args.save, "meta.json", "checkpoint")
        check_output(args.save, "--save", force=True, folder_of="meta.json")
    base = _runnable_preset(args.preset)
    launched_by_torchrun = _torchrun()
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun else args.world_size
    train_overrides = {"world_size": world, "zero": args.zero}
    for key, value in (("steps", args.steps), ("precision", args.precision), ("accum", args.accum)):
        if value is not None:
            train_overrides[key] = value
    if args.steps is not None:
        train_overrides["warmup_steps"] = min(base.train.warmup_steps, args.steps)
    _check_batch_split(base, world, args.accum, "torchrun's WORLD_SIZE" if launched_by_torchrun else "--world-size")
    data_overrides = {"pad_side": args.pad_side} if args.pad_side else {}
    cfg = base.replace(train=train_overrides, data=data_overrides, seed=args.seed)
    log = sys.stderr if args.json else sys.stdout
    common = {"save": args.save, "resume": args.resume, "log_every": args.log_every}

    if launched_by_torchrun:
        import torch.distributed as dist

        rank, _ = init_from_env(cfg.train.device)
        summary = train_reference(cfg, rank, log=log, **common)
        dist.destroy_process_group()
        if rank != 0:
            return 0
    elif world > 1:
        from faultbench.harness.launch import RankPool

        with RankPool(world, start_method="spawn") as pool:  # one case: a pool would not be reused
            summary = pool.run(train_on_rank, cfg.to_dict(), {**common, "log": True},
                               timeout_s=args.timeout or TRAIN_TIMEOUT_S)[0]
    else:
        summary = train_reference(cfg, log=log, **common)

    summary["preset"] = args.preset
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"val_loss {summary['val_loss']:.4f}  loss_floor {summary['loss_floor']:.4f}  "
              f"gap {summary['gap_to_floor']:.4f}  {summary['tokens_per_s']:,.0f} tok/s  "
              f"{summary['steps']} steps in {summary['train_s']:.1f}s")
    return 0


def _check_batch_split(base, world: int, accum: int | None, world_flag: str = "--world-size") -> None:
    """The preset's batch (documents per optimizer step) must split into equal micro-batches on every rank."""
    accum = accum or base.train.accum
    if base.train.batch_size % (world * accum):
        raise ValueError(f"{world_flag} {world} x --accum {accum} must divide the preset's batch of "
                         f"{base.train.batch_size} documents per step (equal micro-batches on every rank)")


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


def _seams(args) -> int:
    table = seam_rows(args.target)
    if args.json:
        print(json.dumps(table, indent=2))
    else:
        width = max(len(s["name"]) for s in table)
        for s in table:
            print(f"{s['subsystem']:<11} {s['name']:<{width}}  {s['file']}:{s['line']}")
    return 0


def _load_plugins(args) -> None:
    from faultbench.faults.registry import load_plugin

    for plugin in getattr(args, "plugin", None) or ():
        load_plugin(plugin)


def _faults(args) -> int:
    from faultbench.faults.registry import all_faults

    _load_plugins(args)
    faults = [f for t in args.target for f in all_faults(t).values() if args.subsystem in (None, f.subsystem)]
    if args.json:
        print(json.dumps([f.metadata() for f in faults], indent=2))
        return 0
    for f in sorted(faults, key=lambda f: (f.target, f.subsystem, f.id)):
        print(f"{f.target:<4} {f.subsystem:<11} {f.id:<36} {f.trigger:<11} {','.join(f.symptoms):<22} {f.title}")
    print(f"{len(faults)} faults")
    return 0


def _show(args) -> int:
    from faultbench.faults.inject import diff
    from faultbench.faults.registry import get_fault

    _load_plugins(args)
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


def _run(args) -> int:
    from faultbench.faults.registry import get_fault
    from faultbench.harness.faulty_run import compare

    torch.set_num_threads(1)
    _load_plugins(args)
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
    _check_batch_split(_runnable_preset(args.preset), args.world_size, args.accum)
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


def _replay(args) -> int:
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


def _detectors(args) -> int:
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


def _plugins(args) -> int:
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


def _names_exclusive(names) -> bool:
    """Whether ``--detectors`` names an exclusive detector itself (``all`` leaves them out: each doubles the bench)."""
    from faultbench.detectors.api import all_detectors

    registry = all_detectors()
    return any(n in registry and registry[n].exclusive for n in names)


def _bench(args) -> int:
    from pathlib import Path

    from faultbench.detectors.api import all_detectors
    from faultbench.harness.bench import BenchConfig, run_bench
    from faultbench.harness.report import print_table

    seeds = tuple(range(args.seeds or (1 if args.quick or args.mutants else 3)))
    if args.mutants:  # the admitted mutant set, scored as its own set (results/mutants/ unless --out says)
        from faultbench.harness.mutants import ADMITTED_PLUGIN

        args.plugin = [*(args.plugin or ()), ADMITTED_PLUGIN]
        args.only_plugin_faults = True
        args.out = args.out or "results/mutants"
    args.out = check_output("results" if args.out is None else args.out, "--out", force=args.force,
                            folder_of="summary.json")
    if args.bundles is not None:
        check_output(args.bundles, "--bundles", force=args.force, folder_of="*/bundle.json")
    if args.only_plugin_faults and not args.plugin:
        raise ValueError("--only-plugin-faults needs a --plugin that registers faults")
    cfg = BenchConfig(seeds=seeds, targets=args.target, detectors=tuple(args.detectors or ("all",)),
                      plugins=tuple(args.plugin or ()),
                      exclusive=args.exclusive or _names_exclusive(args.detectors or ()),
                      per_subsystem=1 if args.quick and not args.fault else None,
                      only_plugin_faults=args.only_plugin_faults, faults=tuple(args.fault) if args.fault else None,
                      jobs=args.jobs, out=Path(args.out), use_cache=not args.no_cache, progress=not args.json,
                      blind=args.blind, bundles=Path(args.bundles) if args.bundles else None,
                      command=tuple(args.command_line))
    if args.fault:
        from faultbench.faults.registry import get_fault, load_plugin

        for plugin in cfg.plugins:
            load_plugin(plugin)
        for fault_id in args.fault:
            get_fault(fault_id)
    summary = run_bench(cfg)
    timings = json.loads((Path(args.out) / "timings.json").read_text())
    if args.blind:  # the aggregates only: the detector table and blind spots would name what the set missed
        from faultbench.harness.sets import aggregates_only

        summary = aggregates_only(summary)
        print(json.dumps(summary["targets"], indent=1), file=sys.stderr if args.json else sys.stdout)
    else:
        print_table(summary, all_detectors(), timings, file=sys.stderr if args.json else sys.stdout)
    _mutant_reports(args)
    print(f"results written to {args.out}/ (scores: bench.csv, summary.json, leaderboard.md, heatmap.png; "
          "timings: timings.csv, timings.json)", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary))
    return 0


def _golden_record(args) -> int:
    from faultbench.harness.atomic import check_output, write_text
    from faultbench.watch import golden_from_files

    out = check_output(args.out, "--out", force=args.force)
    golden = golden_from_files(args.runs)
    write_text(out, json.dumps(golden, indent=1))
    print(f"{out}: the envelope of {golden['runs']} known-good run{'s' * (golden['runs'] != 1)} over "
          f"{len(golden['steps'])} steps")
    return 0


def _contracts(args) -> int:
    from faultbench.detectors import contracts

    if args.json:
        print(json.dumps(contracts.as_json(), indent=2))
        return 0
    print(contracts.markdown(), end="")
    return 0


def _mutate(args) -> int:
    from pathlib import Path

    from faultbench.harness import mutants

    out = Path(args.out) if args.out else None
    if args.admit:
        path = check_output(out or mutants.admitted_path(), "--out", force=args.force)
        given = {k: v for k, v in (("per_cell", args.per_cell), ("jobs", args.jobs)) if v is not None}
        doc = mutants.admit(args.target, **given, limit=args.sample, progress=not args.json)
        mutants.write(doc, path)
        print(f"{len(doc['mutants'])} mutants admitted in {doc['wall_s']:.0f}s: written to {path}",
              file=sys.stderr if args.json else sys.stdout)
    doc = mutants.read(out)
    table = mutants.admission_table(doc, args.target)
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    print(mutants.admission_markdown(table, doc))
    return 0


def _mutant_reports(args) -> None:
    """After a bench of plugin faults alone: their scores beside the registry's (results/summary.json), with the
    ratio, printed and written to generalization.md; after ``bench --mutants``: the mutant set's scores per operator
    and subsystem (by_operator.md); after a bench into results/ or results/mutants/, results/sets.md again."""
    from pathlib import Path

    from faultbench.harness import sets
    from faultbench.harness.atomic import write_text

    out = Path(args.out)
    registry = sets.summary_of(Path("results") / "summary.json")
    if args.only_plugin_faults and registry is not None and out.resolve() != Path("results").resolve():
        lines = sets.generalization_lines(sets.generalization(sets.summary_of(out / "summary.json"), registry))
        write_text(out / "generalization.md", "\n".join(["# The plugin's faults beside the registry's", "",
                                                          *lines]) + "\n")
        print("\n".join(["beside the registry (results/summary.json):", *lines]),
              file=sys.stderr if args.json else sys.stdout)
    if args.mutants:
        from faultbench.harness.mutants import read

        doc = read()
        rows = sets.breakdown(sets.read_rows(out / "bench.csv"), {m["id"]: m for m in doc["mutants"]})
        write_text(out / "by_operator.md", sets.breakdown_markdown(rows, doc["version"]))
    results = Path("results").resolve()
    if out.resolve() in (results, results / "mutants"):
        sets.write_sets(results)


def _rubric_scores(pairs: list[str]) -> dict[str, int]:
    """``dimension=N`` words as a dict (ValueError naming the first malformed one)."""
    scores = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if not value.isdigit():
            raise ValueError(f"{pair!r} is not DIMENSION=N (e.g. reproduce=3)")
        scores[name] = int(value)
    return scores


def _practice(args) -> int:
    from faultbench.harness import practice, practice_session
    from faultbench.harness.rubric import rubric

    torch.set_num_threads(1)
    _load_plugins(args)
    cmd, keys = args.practice_command, getattr(args, "keys", None)
    if cmd in ("rubric", "runsheet"):
        if (args.fault is None) == (args.dir is None):
            raise ValueError(f"practice {cmd} takes an exercise folder or --fault ID (one of them)")
        key = practice.load_key(args.dir, keys)[0] if args.fault is None else {"fault": args.fault}
        if cmd == "rubric":
            print(rubric(key["fault"]), end="")
        else:
            from faultbench.harness.runsheet import runsheet

            print(runsheet(key["fault"], args.minutes, key.get("candidate")), end="")
    elif cmd in ("new", "export"):
        if args.fault == "":
            raise ValueError("--fault '' names no fault (leave it out for a hidden one)")
        if getattr(args, "archive", None) is not None:  # refused before the exercise and its key are written
            check_output(args.archive, "--archive", force=args.force)
        where = practice.new_exercise(args.dir, args.seed, args.fault, args.subsystem, args.difficulty, keys,
                                      candidate=args.candidate, max_answers=args.max_answers)
        if getattr(args, "archive", None):
            print(f"archive to hand over: {practice.export_archive(where, args.archive, keys)}")
        print(f"exercise written to {where}: it runs on its own (README.md, train.py, check.py); the answer key "
              f"stays in {practice.keys_dir(keys)}")
    elif cmd == "start":
        practice_session.start(args.dir, args.minutes, keys)
        print(f"session started: {args.minutes:g} minutes")
    elif cmd == "status":
        print(practice_session.status(args.dir, keys))
    elif cmd == "export-tasks":
        from faultbench.harness.agent_tasks import export_tasks

        index = export_tasks(args.dir, args.tasks, args.seed if args.seed is not None else 0)
        print(f"{len(index)} tasks written to {args.dir}/tasks (answer keys in {args.dir}/grader: keep them from "
              "the agent)")
    elif cmd == "run-agent":
        from faultbench.harness.agent_tasks import run_agent, summary

        passed = {}
        for name in args.pass_env or ():
            if name not in os.environ:
                raise ValueError(f"--pass-env {name}: not set in this environment")
            passed[name] = os.environ[name]
        s = summary(run_agent(args.dir, args.command, args.name, passed, args.only))
        print(f"{args.name}: subsystem {s['subsystem']:.2f}, function {s['function']:.2f}, repaired "
              f"{s['repaired']:.2f} over {s['tasks']} tasks: {args.dir}/runs/{args.name}/results.md")
    elif cmd == "validate":
        from faultbench.harness import offer_table
        from faultbench.harness.practice_offer import validate

        rows = validate(args.only, args.jobs)
        if args.only:  # a partial table never replaces the committed one
            print(offer_table.table(rows), end="")
        else:
            print(f"{sum(r['offered'] for r in rows)} of {len(rows)} faults offered: {offer_table.write(rows)}")
    elif cmd == "stop":
        practice.stop(args.dir, keys)
        print("session stopped: hints, answers and checks are closed; `report` and `reveal` still work")
    elif cmd == "score":
        practice_session.score(args.dir, _rubric_scores(args.scores), keys)
        mean = practice_session.summary(practice.load_key(args.dir, keys)[0], 0.0)["score"]
        print(f"scored: overall {mean:.2f} of 4 ({practice_session.band(mean)})")
    elif cmd == "history":
        print(practice_session.history_table(practice_session.history(keys)), end="")
    elif cmd == "report":
        if args.out is not None:
            check_output(args.out, "--out", force=args.force)
        text = practice_session.report(args.dir, keys)
        if args.out:
            from faultbench.harness.atomic import write_text

            write_text(args.out, text)
            print(f"session report written to {args.out}")
        else:
            print(text, end="")
    elif cmd == "hint":
        print(practice.hint(args.dir, keys))
    elif cmd == "answer":
        verdict = practice.answer(args.dir, args.subsystem, args.seam, keys)
        if not verdict["scored"]:
            print("recorded, not scored: the answer was revealed already")
        else:
            seam = "" if verdict["seam"] is None else f"; function: {verdict['seam']}"
            late = "; past the time budget" if verdict["late"] else ""
            print(f"subsystem: {verdict['subsystem']}{seam} (hints used: {verdict['hints_used']}; answers left: "
                  f"{verdict['left']}{late})")
    elif cmd == "check":
        result = practice.check(args.dir, keys)
        if not result["isolated"]:
            from faultbench.harness.sandbox import unavailable

            print(f"warning: the copy's code ran without the grading sandbox ({unavailable()}): it could have read "
                  "the answer keys", file=sys.stderr)
        if result["code"] == 2:
            print(result["problems"][0])
        else:
            print("not repaired yet:" if result["code"] else "repaired: the run now behaves like the reference")
            print("".join(f"  - {p}\n" for p in result["problems"]), end="")
        return result["code"]
    else:
        print(practice.reveal(args.dir, keys))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="faultbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train the clean reference and print its summary")
    train.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    train.add_argument("--steps", type=_at_most(MAX_STEPS), help="optimizer steps (default: the preset's)")
    train.add_argument("--precision", choices=PRECISIONS)
    train.add_argument("--pad-side", choices=PAD_SIDES)
    train.add_argument("--accum", type=_positive_int, help="micro-batches per optimizer step")
    train.add_argument("--seed", type=_seed, default=0)
    train.add_argument("--world-size", type=_positive_int, default=1,
                       help="data-parallel ranks (gloo on CPU); under torchrun its WORLD_SIZE wins")
    train.add_argument("--zero", action="store_true", help="shard optimizer state across ranks (ZeRO)")
    train.add_argument("--timeout", type=_positive_float,
                       help=f"seconds before a hung rank is killed (default {TRAIN_TIMEOUT_S:.0f})")
    train.add_argument("--threads", type=_at_most(MAX_JOBS), default=1,
                       help="torch threads (small models run fastest on 1)")
    train.add_argument("--log-every", type=_at_most(MAX_STEPS), default=50)
    train.add_argument("--save", metavar="DIR", help="write a checkpoint here at the end")
    train.add_argument("--resume", metavar="DIR", help="continue from this checkpoint")
    train.add_argument("--json", action="store_true", help="progress on stderr; last stdout line is a JSON summary")
    train.set_defaults(func=_train)

    seams = sub.add_parser("seams", help="list every seam of a target with its subsystem and file:line")
    seams.add_argument("--target", type=_target_name, default="ref", help="ref (default) or hf")
    seams.add_argument("--json", action="store_true")
    seams.set_defaults(func=_seams)

    faults = sub.add_parser("faults", help="list the registered faults")
    faults.add_argument("--subsystem", choices=SUBSYSTEMS)
    faults.add_argument("--target", type=_targets_or_all, default=("ref",), metavar="ref|hf|all",
                        help="whose faults (default ref)")
    faults.add_argument("--plugin", action="append", help="load faults from a .py file or module (repeatable)")
    faults.add_argument("--json", action="store_true")
    faults.set_defaults(func=_faults)

    show = sub.add_parser("show", help="a fault's metadata and its diff against the clean seam")
    show.add_argument("fault_id")
    show.add_argument("--plugin", action="append")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=_show)

    run = sub.add_parser("run", help="train with faults injected, next to the clean run, and report")
    run.add_argument("--fault", action="append", required=True, help="fault id (repeatable)")
    run.add_argument("--plugin", action="append", help="load faults from a .py file or module (repeatable)")
    run.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    run.add_argument("--steps", type=_at_most(MAX_STEPS),
                     help="optimizer steps (default: 100 on the reference; a fault of another target: its manifest's)")
    run.add_argument("--seed", type=_seed, default=0)
    run.add_argument("--precision", choices=PRECISIONS)
    run.add_argument("--pad-side", choices=PAD_SIDES)
    run.add_argument("--accum", type=_positive_int)
    run.add_argument("--world-size", type=int, default=1, choices=(1, 2))
    run.add_argument("--plot", metavar="FILE.png", help="draw loss, grad norm, LR, scale, tokens/s: faulty vs clean")
    run.add_argument("--force", action="store_true", help="replace an existing --plot file")
    run.add_argument("--detectors", nargs="+", metavar="ID",
                     help="run the fault in its bench recipe with these detectors ('all', 'suite', 'baselines' or "
                          "ids) and show the ranked findings")
    run.add_argument("--recipe", help="with --detectors: the bench recipe (default: the fault's)")
    run.add_argument("--bundle", metavar="DIR",
                     help="with --detectors: where the repro bundle goes (default bundles/FAULT-RECIPE-sSEED)")
    run.add_argument("--no-bundle", action="store_true", help="with --detectors: write no repro bundle")
    run.add_argument("--json", action="store_true", help="last stdout line is a JSON report")
    run.set_defaults(func=_run)

    rep = sub.add_parser("replay", help="run a repro bundle's case again and say whether its finding comes back")
    rep.add_argument("bundle")
    rep.add_argument("--plugin", action="append",
                     help="a plugin the bundle's case names, given again (a bundle never loads code by itself)")
    rep.add_argument("--json", action="store_true", help="last stdout line is the JSON result")
    rep.set_defaults(func=_replay)

    plug = sub.add_parser("plugins", help="list what loads code into faultbench: installed entry points, and when "
                                          "--plugin files load")
    plug.add_argument("--json", action="store_true")
    plug.set_defaults(func=_plugins)

    dets = sub.add_parser("detectors", help="list the registered detectors")
    dets.add_argument("--json", action="store_true")
    dets.set_defaults(func=_detectors)

    bench = sub.add_parser("bench", help="every fault x seeds plus the clean matrix, scored; writes results/")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke run: one seed unless --seeds says otherwise, and one fault per subsystem and "
                            "target (the first by id) unless --fault names them, with the whole clean matrix")
    bench.add_argument("--exclusive", action="store_true",
                       help="also run the exclusive detectors (anomaly mode: a second run of every case), as naming "
                            "one in --detectors does")
    bench.add_argument("--seeds", type=_at_most(MAX_SEEDS), help="seeds 0..N-1 (default 3; 1 with --quick)")
    bench.add_argument("--target", type=_targets_or_all, default="all", metavar="ref|hf|all",
                       help="the stacks whose faults and clean matrix run (default all)")
    bench.add_argument("--plugin", action="append", help="load faults/detectors from a .py file or module")
    bench.add_argument("--only-plugin-faults", action="store_true", help="score only the plugins' faults")
    bench.add_argument("--fault", action="append", help="only this fault (repeatable)")
    bench.add_argument("--blind", action="store_true",
                       help="a blind set: progress, table and messages name no case, fault or detector (aggregates "
                            "only; the full scores are still written to --out for the set's authors)")
    bench.add_argument("--detectors", nargs="+", metavar="ID", help="detector ids, 'all' (default), 'suite'")
    bench.add_argument("--jobs", type=_at_most(MAX_JOBS), default=2, help="cases run in parallel (default 2)")
    bench.add_argument("--mutants", action="store_true",
                       help="score the admitted mutant set (faults/mutants/mutants-v1.json) instead of the registry: "
                            "one seed unless --seeds says otherwise, written to results/mutants/ unless --out says")
    bench.add_argument("--out", help="output folder (default results/)")
    bench.add_argument("--force", action="store_true",
                       help="write into an --out or --bundles folder that holds files of something else")
    bench.add_argument("--no-cache", action="store_true", help="recompute every case")
    bench.add_argument("--bundles", metavar="DIR",
                       help="write a repro bundle for every case where a detector fires (runs every case anew)")
    bench.add_argument("--json", action="store_true", help="table on stderr; last stdout line is summary.json")
    bench.set_defaults(func=_bench)

    gold = sub.add_parser("golden", help="golden envelopes of your own loop, from its known-good runs")
    gold_sub = gold.add_subparsers(dest="golden_command", required=True)
    record = gold_sub.add_parser("record", help="a golden from watches saved with faultbench.watch(..., out=RUN.json)")
    record.add_argument("runs", nargs="+", metavar="RUN.json", help="known-good runs, each a watch's out= file")
    record.add_argument("--out", required=True, help="the golden's file, for faultbench.watch(..., golden=FILE)")
    record.add_argument("--force", action="store_true", help="replace an existing --out file")
    record.set_defaults(func=_golden_record)

    con = sub.add_parser("contracts", help="the contract catalogue: what every correct causal-LM run keeps, per "
                                           "component and kind, with the detectors that check each and the coverage")
    con.add_argument("--json", action="store_true",
                     help="a list of {id, component, kind, statement, source, tracks, detectors, uncheckable}")
    con.set_defaults(func=_contracts)

    mutate = sub.add_parser("mutate", help="the mutant set: machine-made faults over every seam, admitted by the "
                                           "bench's evidence; prints each operator's admit rate")
    mutate.add_argument("--target", type=_targets_or_all, default="all", metavar="ref|hf|all")
    mutate.add_argument("--admit", action="store_true",
                        help="generate, run and admit the set (about 30 minutes on 2 cores), then write it")
    mutate.add_argument("--per-cell", type=_at_most(MAX_SEEDS),
                        help="candidates run per (seam, operator), spread over its sites (default 4)")
    mutate.add_argument("--sample", type=_positive_int, help="with --admit: only the first N candidates per target")
    mutate.add_argument("--jobs", type=_at_most(MAX_JOBS), help="cases run in parallel (default 2)")
    mutate.add_argument("--out", help="the admitted set's file (default faults/mutants/mutants-v1.json)")
    mutate.add_argument("--force", action="store_true", help="with --admit: replace an existing file")
    mutate.add_argument("--json", action="store_true", help="the admission table as JSON")
    mutate.set_defaults(func=_mutate)

    practice = sub.add_parser("practice", help="practice and interview mode: exercises with one hidden fault")
    practice_sub = practice.add_subparsers(dest="practice_command", required=True)
    for name, text in (("new", "write a standalone broken copy with a colleague's report"),
                       ("export", "the same, and optionally a .tar.gz of it to hand over")):
        new = practice_sub.add_parser(name, help=text)
        new.add_argument("--dir", required=True)
        new.add_argument("--seed", type=_seed, help="chooses the hidden fault (default: random)")
        new.add_argument("--fault", help="this fault instead of a hidden choice (for interviewers)")
        new.add_argument("--subsystem", choices=SUBSYSTEMS)
        new.add_argument("--difficulty", choices=("easy", "medium", "hard"))
        new.add_argument("--candidate", help="the candidate's name, for history and the report")
        new.add_argument("--max-answers", type=_positive_int, default=3, help="scored answers allowed (default 3)")
    practice_sub.choices["export"].add_argument("--archive", metavar="FILE.tar.gz")
    practice_sub.choices["export"].add_argument("--force", action="store_true", help="replace an existing archive")
    for name, text in (("hint", "the next staged hint"), ("check", "is the edited copy repaired? (exit 0/1/2)"),
                       ("reveal", "the diff, the explanation, the fix, the real bug"),
                       ("status", "time used and left, hints, answers, checks"),
                       ("stop", "end the session: hints, answers and checks close"),
                       ("report", "the session's markdown report, for the interviewer")):
        p = practice_sub.add_parser(name, help=text)
        p.add_argument("dir")
    practice_sub.choices["report"].add_argument("--out", metavar="FILE.md")
    practice_sub.choices["report"].add_argument("--force", action="store_true", help="replace an existing --out file")
    start = practice_sub.add_parser("start", help="start the clock with a time budget")
    start.add_argument("dir")
    start.add_argument("--minutes", type=_positive_float, required=True)
    practice_sub.add_parser("history", help="every exercise's attempts, times, hints and reveals")
    tasks = practice_sub.add_parser("export-tasks", help="exercises as tasks for a coding agent, with a hidden grader")
    tasks.add_argument("dir")
    tasks.add_argument("--tasks", type=_at_most(100), required=True, help="how many (distinct faults)")
    tasks.add_argument("--seed", type=_seed, help="which faults (default 0)")
    agent = practice_sub.add_parser("run-agent", help="run an agent command on exported tasks and grade it")
    agent.add_argument("dir")
    agent.add_argument("--command", required=True, help="a shell command run in each task's folder ({python}: this "
                                                        "interpreter)")
    agent.add_argument("--name", required=True, help="the agent's name (results under DIR/runs/NAME)")
    agent.add_argument("--pass-env", action="append", metavar="VAR", help="an environment variable the agent needs")
    agent.add_argument("--only", nargs="+", metavar="TASK", help="these tasks only")
    validate = practice_sub.add_parser("validate", help="which faults show a symptom and are offered "
                                                         "(results/practice_offer.md)")
    validate.add_argument("--only", nargs="+", metavar="ID",
                          help="these faults only, printed (the table is left as it is)")
    validate.add_argument("--jobs", type=_at_most(MAX_JOBS), default=2, help="faults validated at once (default 2)")
    ans = practice_sub.add_parser("answer", help="grade a diagnosis")
    ans.add_argument("dir")
    ans.add_argument("--subsystem", required=True)
    ans.add_argument("--seam", help="the function: full (model.rope.apply_rope) or a unique short name")
    for name, text in (("rubric", "what a strong debugging answer covers for one fault"),
                       ("runsheet", "the interviewer's minute-by-minute sheet: hints, model answers, score bands")):
        sheet = practice_sub.add_parser(name, help=text)
        sheet.add_argument("dir", nargs="?", help="an exercise folder (its hidden fault's)")
        sheet.add_argument("--fault", help="a fault id instead of a folder")
    practice_sub.choices["runsheet"].add_argument("--minutes", type=_positive_int, default=45,
                                                  help="the interview slot (default 45)")
    score = practice_sub.add_parser("score", help="the interviewer's rubric scores, 1-4 per dimension")
    score.add_argument("dir")
    score.add_argument("scores", nargs="+", metavar="DIMENSION=N",
                       help="reproduce= isolate= instrument= fix= prevent= example= (each 1-4)")
    for p in practice_sub.choices.values():
        p.add_argument("--plugin", action="append")
        p.add_argument("--keys", metavar="DIR", help="where answer keys live (default: practice/ of the cache folder, "
                                                    "the checkout's .cache/ in a clone)")
    practice.set_defaults(func=_practice)
    return parser


def _torchrun() -> bool:
    """Whether torchrun (or another launcher that sets WORLD_SIZE > 1) started this process as one rank."""
    import os

    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def _ranks(args) -> bool:
    return args.world_size > 1 or _torchrun()


# A flag that means something only beside another would otherwise be ignored without a word: (command, flag,
# whether it was given, whether it applies, what it needs). Checked before any work.
_DETECTORS = "the fault runs in its bench recipe with --detectors (--recipe and --seed choose the case)"
_ONLY_WITH = [
    ("train", "--zero", lambda a: a.zero, _ranks, "with --world-size 2 or more (or torchrun): it shards across ranks"),
    ("train", "--timeout", lambda a: a.timeout is not None, _ranks,
     "with --world-size 2 or more: it is how long a hung rank may take"),
    *(("run", flag, given, lambda a: a.detectors, "with --detectors") for flag, given in (
        ("--recipe", lambda a: a.recipe), ("--bundle", lambda a: a.bundle is not None),
        ("--no-bundle", lambda a: a.no_bundle))),
    ("run", "--force", lambda a: a.force, lambda a: a.plot is not None, "with --plot (the file it replaces)"),
    *(("run", flag, given, lambda a: not a.detectors, f"to the clean-vs-faulty comparison: {_DETECTORS}")
      for flag, given in (("--plot", lambda a: a.plot is not None), ("--steps", lambda a: a.steps is not None),
                          ("--precision", lambda a: a.precision), ("--pad-side", lambda a: a.pad_side),
                          ("--accum", lambda a: a.accum), ("--world-size", lambda a: a.world_size != 1),
                          ("--preset", lambda a: a.preset != "tiny"))),
    ("run", "--bundle", lambda a: a.bundle is not None, lambda a: not a.no_bundle, "without --no-bundle"),
    *(("mutate", flag, given, lambda a: a.admit, "with --admit (it configures the admission)") for flag, given in (
        ("--per-cell", lambda a: a.per_cell is not None), ("--sample", lambda a: a.sample is not None),
        ("--jobs", lambda a: a.jobs is not None), ("--force", lambda a: a.force))),
    *((command, flag, given, lambda a: not a.fault, "without --fault: it helps choose the hidden fault")
      for command in ("practice new", "practice export") for flag, given in (
        ("--seed", lambda a: a.seed is not None), ("--subsystem", lambda a: a.subsystem),
        ("--difficulty", lambda a: a.difficulty))),
    ("practice export", "--force", lambda a: a.force, lambda a: a.archive is not None,
     "with --archive (the file it replaces)"),
    ("practice report", "--force", lambda a: a.force, lambda a: a.out is not None, "with --out (the file it replaces)"),
]


def _refuse_unused_flags(args) -> None:
    """One line (ValueError) for the first flag given where it would be ignored (``_ONLY_WITH``)."""
    command = " ".join(filter(None, (args.command, getattr(args, "practice_command", None))))
    for only_in, flag, given, applies, needs in _ONLY_WITH:
        if command == only_in and given(args) and not applies(args):
            raise ValueError(f"{flag} applies only {needs}; here it would be ignored")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = ["faultbench", *(sys.argv[1:] if argv is None else argv)]
    if not in_checkout():  # installed: the reference's tokenizer cache goes with the others, not into the package
        os.environ.setdefault("TOKENIZER_CACHE_DIR", str(cache_dir() / "tokenizers"))
    try:
        _refuse_unused_flags(args)
        return args.func(args)
    except ValueError as e:  # bad configs and checkpoints: a clear message, not a traceback
        print(f"faultbench: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader (head, less) closed the pipe: stop quietly, as a pipeline expects
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1
