"""One case with a detector suite, for people: ``faultbench run --fault ID --detectors all``."""

from __future__ import annotations

import json
import tempfile

from faultbench import targets
from faultbench.detectors.api import all_detectors, rank_key, resolve_ids
from faultbench.harness.case import execute
from faultbench.harness.matcher import recipe_for
from faultbench.harness.record import Case


def detector_groups(ids) -> list[tuple[str, ...]]:
    """The detectors that can share a run, then each exclusive one (it changes the run) on its own."""
    registry = all_detectors()
    shared = tuple(d for d in ids if not registry[d].exclusive)
    return ([shared] if shared else []) + [(d,) for d in ids if registry[d].exclusive]


def case_target(fault_ids) -> str:
    """The target the faults belong to (none: the reference); faults of two targets raise ``ValueError``. An
    unknown fault id raises here, with its "did you mean"."""
    from faultbench.faults.registry import get_fault

    stacks = sorted({get_fault(f).target for f in fault_ids}) or ["ref"]
    if len(stacks) > 1:
        raise ValueError(f"the faults belong to different targets ({', '.join(stacks)}): one case runs on one")
    return stacks[0]


def case_recipe(fault_ids, recipe: str | None = None) -> str:
    """The recipe of the faults' target they run in: ``recipe`` if given (checked), else the first fault's, else
    fp32."""
    from faultbench.faults.registry import get_fault

    target = case_target(fault_ids)
    recipes = targets.get(target).recipes()
    if recipe is None:
        recipe = recipe_for(get_fault(fault_ids[0]).manifest, target) if fault_ids else "fp32"
    if recipe not in recipes:
        raise ValueError(f"unknown {target} recipe {recipe!r}; expected one of {', '.join(recipes)}")
    return recipe


def detect(fault_ids=(), seed: int = 0, detectors=("suite",), recipe: str | None = None, plugins=(),
           bundle=None, command=()) -> dict:
    """Run the faults (none: clean) in their recipe with the detectors; the case record, with the findings
    of exclusive detectors (run in their own cases) merged into its ranked list. With ``bundle`` (a folder)
    and a finding, the repro bundle of the top finding is written there (``record["bundle"]``)."""
    from faultbench.faults.registry import load_plugin
    from faultbench.harness.bundle import write_bundle
    from faultbench.harness.golden import load_golden

    for plugin in plugins:
        load_plugin(plugin)
    recipe = case_recipe(fault_ids, recipe)
    target = case_target(fault_ids)
    stack = targets.get(target)
    bundle = bundle if stack.captures else None  # a target that captures no steps makes no repro bundle
    cases = [Case(recipe, seed, tuple(fault_ids), group, tuple(plugins), target) for group in
             detector_groups(resolve_ids(detectors))]
    pool = None
    world_size = stack.recipes()[recipe].world_size
    if world_size > 1:
        from faultbench.harness.launch import RankPool

        pool = RankPool(world_size, preload=stack.preload)
    with tempfile.TemporaryDirectory(prefix="faultbench-capture-") as capture:
        try:
            golden = load_golden([recipe], pool, target=target)[recipe]
            records = [execute(case, golden, pool, capture_dir=f"{capture}/{i}" if bundle else None)
                       for i, case in enumerate(cases)]
        finally:
            if pool is not None:
                pool.close()
        merged = {**records[0], "findings": sorted((f for r in records for f in r["findings"]), key=rank_key),
                  "detector_errors": {d: e for r in records for d, e in r["detector_errors"].items()}}
        if bundle and merged["findings"]:
            top = merged["findings"][0]["detector"]
            which = next(i for i, case in enumerate(cases) if top in case.detectors)
            merged["bundle"] = str(write_bundle(bundle, records[which], f"{capture}/{which}", list(command)))
    return merged


def describe_findings(record: dict, limit: int = 20) -> str:
    """The ranked findings of a case record with their evidence, and its crash and detector errors."""
    case = record["case"]
    lines = [f"case {case.get('target', 'ref')}: {'+'.join(case['faults']) or 'clean'} / {case['recipe']} / "
             f"seed {case['seed']}: "
             f"{len(record['history'])} steps, val_loss {record['val_loss']}"]
    if record["crash"]:
        c = record["crash"]
        lines.append(f"crash at step {c['step']}: {c['type']}: {c['message'][:200]}")
    if not record["findings"]:
        lines.append("no findings")
    for i, f in enumerate(record["findings"][:limit], 1):
        lines.append(f"{i:>2}. [{f['confidence']:.2f}] step {f['step']}  {f['subsystem']} / {f['seam'] or '-'}  "
                     f"({f['detector']})\n      {f['message']}\n      evidence: {json.dumps(f['evidence'])[:300]}")
    for det, err in record["detector_errors"].items():
        lines.append(f"detector error: {det}: {err}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m faultbench.harness.detect FAULT|clean [RECIPE] [SEED]``: print the ranked findings (dev helper)."""
    import sys

    import torch

    torch.set_num_threads(1)
    fault, recipe, seed = ([*(argv or sys.argv[1:])] + [None, None])[:3]
    record = detect(() if fault == "clean" else (fault,), int(seed or 0), ("all",), recipe)
    print(describe_findings(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
