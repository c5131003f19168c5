"""Golden runs: recorded traces of the clean stack for every recipe of every target, the envelope detectors
compare to.

Detectors may compare a run with traces of clean reference runs (as TrainCheck infers invariants
from clean runs). The traces come from seeds the bench never uses (``GOLDEN_SEEDS``), so a detector
learns what a healthy run of the recipe looks like, never the numbers of the case it watches. They
are cached in ``.cache/golden/<target>-<digest>.json``, the digest of ``model/``, the target's package and
this file, and recorded again whenever any changes; an entry belongs to one target's recipe.
The recorder needs only what every target's run context has (``ctx.run.model``, the hooks), so the HF
target's traces hold the same fields.

A golden entry per recipe: {"seeds": [...], "runs": [trace, ...]} where a trace holds the step
history (loss, grad_norm, lr, scale, skipped, tokens_per_s), the val loss, the model's structure
(parameter count, shared parameters, shapes), each parameter's RMS at init, each module's output
RMS in the first training forward, and the largest per-token L1 norm of d(loss)/d(logits) in the
first micro-batches.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from faultbench import targets
from faultbench.harness.atomic import read_cached_json, write_text
from faultbench.harness.case import execute
from faultbench.harness.digest import source_digest
from faultbench.harness.record import Case
from faultbench.harness.recorder import GoldenRecorder
from faultbench.harness.watched import WATCH_HISTORY, WATCH_RECORDER
from faultbench.paths import cache_dir

GOLDEN_SEEDS = (1000, 1001)
CACHE = cache_dir() / "golden"


def golden_cases(recipes, target: str = "ref") -> list:
    """The clean cases whose traces make the golden entries of ``target``'s ``recipes``."""
    return [Case(recipe, seed, detectors=(GoldenRecorder.id, WATCH_RECORDER), target=target) for recipe in recipes
            for seed in GOLDEN_SEEDS]


def trace_of(record: dict) -> dict:
    """A golden trace from a finished golden case: its step history plus what the recorder saw."""
    case = record["case"]
    if record["crash"]:
        raise RuntimeError(f"the clean {case.get('target', 'ref')} stack crashed in golden run "
                           f"{case['recipe']}/s{case['seed']}: "
                           f"{record['crash']['message']}")
    trace = dict(record["summaries"][GoldenRecorder.id])
    trace[WATCH_HISTORY] = record["summaries"].get(WATCH_HISTORY, [])  # what a watch saw (the black-box golden)
    history = record["history"]
    trace.update({k: [h[k] for h in history] for k in ("loss", "grad_norm", "lr", "scale", "skipped", "tokens_per_s")})
    return trace


def digest(target: str = "ref") -> str:
    """The sources ``target``'s clean runs depend on: the reference's model, the target's package, the runner's glue."""
    stack = (f"targets/{target}", "targets/__init__.py")
    # a golden run's envelope for the black-box track is what the watch recorded (faultbench/watch.py, with the
    # step records and the readers of detectors/blackbox/: a new field there is a new golden)
    return source_digest("model", *stack, "harness/golden.py", "harness/recorder.py", "harness/suite.py",
                         "harness/record.py", "harness/case.py", "faultbench/watch.py",
                         "harness/watched.py", "detectors/blackbox")[:16]


def _key(recipe: str, target: str = "ref") -> str:
    """A golden entry belongs to the target's recipe as defined now (a changed step count is another entry)."""
    definition = repr(targets.get(target).recipes()[recipe])
    return f"{target}/{recipe}-{hashlib.sha1(definition.encode()).hexdigest()[:8]}"


def read_cache(path: Path) -> dict:
    """The golden cache at ``path``: {key: {"seeds": [...], "runs": [trace, ...]}}; a file that is not one
    (truncated, not JSON, another shape) is reported by path, deleted and recorded again ({})."""
    def problem(golden) -> str | None:
        ok = isinstance(golden, dict) and all(isinstance(e, dict) and isinstance(e.get("runs"), list)
                                              and all(isinstance(r, dict) for r in e["runs"]) for e in golden.values())
        return None if ok else "not a golden cache ({key: {seeds, runs}})"

    return read_cached_json(path, "golden cache", problem) or {}


def load_golden(recipes, pool=None, run_cases=None, target: str = "ref") -> dict:
    """The golden entry of every recipe of ``target`` in ``recipes``, recorded (and cached) where missing.

    ``run_cases(cases) -> records`` runs the missing golden cases (the bench runs them in parallel);
    by default they run one after the other here (on ``pool`` for the data-parallel recipes).
    """
    path = CACHE / f"{target}-{digest(target)}.json"
    golden = read_cache(path)
    missing = golden_cases([r for r in recipes if _key(r, target) not in golden], target)
    if missing:
        records = run_cases(missing) if run_cases else [execute(case, None, pool) for case in missing]
        # a clean run that crashed or hung is the machinery's failure (a rank killed, a worker lost): never kept
        failed = {case.recipe: (record["crash"] or {}).get("type", "Hang") for case, record in
                  zip(missing, records, strict=True) if record.get("hang") or record["crash"]}
        for case, record in zip(missing, records, strict=True):
            if case.recipe not in failed:
                entry = golden.setdefault(_key(case.recipe, target), {"seeds": list(GOLDEN_SEEDS), "runs": []})
                entry["runs"].append(trace_of(record))
        write_text(path, json.dumps(golden))
        if failed:
            raise ValueError(f"a golden run of {target} recipe(s) {', '.join(f'{r} ({t})' for r, t in failed.items())} "
                             "failed: nothing was scored or cached with it; run again to record it anew")
    return {r: golden[_key(r, target)] for r in recipes}
