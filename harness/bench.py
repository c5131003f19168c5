"""The bench: every fault x seeds plus the clean matrix, each case isolated, scored, written to results/.

Cases: each registered fault runs in the plainest recipe that meets its manifest's needs, and a recipe
left holding faults of fewer than 3 subsystems gets faults of others it can show (``assign_recipes``); a
fault no recipe can show is "not runnable in the matrix". Each runs with the whole
suite plus the non-exclusive baselines; an exclusive detector (one that changes the run, like anomaly
mode) gets its own case. The clean matrix is every recipe x seed with the same detectors.

Isolation: a single-process case runs in a child forked from this process (which has imported torch
and built the corpora once), with one torch thread and a timeout; a child that hangs is killed and
recorded as a hang, one that dies as a crash. Data-parallel cases run on a 2-rank ``RankPool`` whose
failures (raise, death, hang) come back as crash records. Each finished case is cached under
``.cache/bench/<case hash>.json`` (the hash covers the case and every source it depends on), so a
re-run recomputes only what changed; an unreadable entry (bad JSON, a wrong record) is reported by path,
deleted and recomputed. Results are written atomically once every case has finished, and never for an
empty matrix; scores and timings go to separate files (``harness.report``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from faultbench import targets
from faultbench.detectors.api import all_detectors, black_box_suite_ids, resolve_ids, suite_ids
from faultbench.harness.atomic import write_text
from faultbench.harness.case import behaviour, execute
from faultbench.harness.costs import write_costs
from faultbench.harness.detect import detector_groups
from faultbench.harness.digest import case_hash, code_digest
from faultbench.harness.launch import die_with_parent
from faultbench.harness.matcher import assign_recipes
from faultbench.harness.record import Case, failed_record
from faultbench.harness.report import split_timings
from faultbench.harness.score import (
    BLACKBOX,
    SUITE,
    aggregate,
    case_rows,
    exclusive_overhead,
    not_runnable,
    per_fault,
    target_of,
)
from faultbench.paths import cache_dir

ROOT = Path(__file__).resolve().parent.parent
CACHE = cache_dir() / "bench"
SEEDS = (0, 1, 2)
CASE_TIMEOUT_S = 180.0
GOALS = {  # per track's suite, printed next to the measured values: the white-box track's (issue 5)
    SUITE: {"detection_rate": (">=", 0.95), "false_positive_rate": ("<=", 0.0), "top1_subsystem": (">=", 0.90),
            "top1_seam": (">=", 0.75), "median_latency_steps": ("<=", 0), "overhead_ratio": ("<=", 1.05)},
    # the black-box track's (issue 14), on the registries of both targets
    BLACKBOX: {"detection_rate": (">=", 0.90), "false_positive_rate": ("<=", 0.0), "top1_subsystem": (">=", 0.80),
               "median_latency_steps": ("<=", 0), "overhead_ratio": ("<=", 1.05)},
}


@dataclass
class BenchConfig:
    seeds: tuple[int, ...] = SEEDS
    targets: tuple[str, ...] = targets.names()  # the stacks whose faults (and clean matrix) run
    detectors: tuple[str, ...] = ("all",)
    plugins: tuple[str, ...] = ()
    only_plugin_faults: bool = False
    faults: tuple[str, ...] | None = None  # None: every registered fault
    clean: bool = True
    exclusive: bool = False  # also run the exclusive detectors (each needs its own run of every case)
    per_subsystem: int | None = None  # --quick: only the first N faults (by id) of each target and subsystem
    jobs: int = max(1, min(os.cpu_count() or 1, 2))
    out: Path = ROOT / "results"
    use_cache: bool = True
    timeout_s: float = CASE_TIMEOUT_S
    progress: bool = True
    blind: bool = False  # a blind set: nothing printed names a case (its fault ids stay with the set's authors)
    bundles: Path | None = None  # a repro bundle per case where a detector fired (every case is run anew)
    command: tuple[str, ...] = ()  # the command line, recorded in the bundles


def recipes_of(target: str) -> dict:
    """The clean matrix's recipes of ``target`` (every recipe it has)."""
    return targets.get(target).recipes()


def select_faults(cfg: BenchConfig) -> dict:
    """The faults the bench runs: every registered fault of ``cfg.targets`` (plugins included; only theirs
    with ``only_plugin_faults``), or ``cfg.faults``; a listed fault of another target raises ``ValueError``."""
    from faultbench.faults.registry import all_faults, get_fault, load_plugin

    builtin = {f for t in cfg.targets for f in all_faults(t)}
    for plugin in cfg.plugins:
        load_plugin(plugin)
    if cfg.faults is not None:
        specs = {f: get_fault(f) for f in cfg.faults}
        outside = [f"{f} (target {s.target})" for f, s in specs.items() if s.target not in cfg.targets]
        if outside:
            raise ValueError(f"--fault {', '.join(outside)} is not a fault of --target {','.join(cfg.targets)}")
        return specs
    specs = {k: v for t in cfg.targets for k, v in all_faults(t).items()}
    if cfg.only_plugin_faults:
        specs = {k: v for k, v in specs.items() if k not in builtin}
    return specs if cfg.per_subsystem is None else sample_per_subsystem(specs, cfg.per_subsystem)


def sample_per_subsystem(specs: dict, n: int) -> dict:
    """The first ``n`` faults by id of each (target, subsystem): a quick run still touches every subsystem."""
    kept: dict[tuple[str, str], list[str]] = {}
    for fault_id in sorted(specs):
        kept.setdefault((specs[fault_id].target, specs[fault_id].subsystem), []).append(fault_id)
    return {f: specs[f] for ids in kept.values() for f in ids[:n]}


def build_matrix(cfg: BenchConfig) -> tuple[list[Case], dict[str, dict]]:
    """The cases to run and the metadata of the faults they inject (the scorer's answer key).

    The clean matrix covers the targets of the selected faults (every recipe x seed), or ``cfg.targets`` when
    no fault is selected: a clean case serves the faults of its own target (false positives, manifested)."""
    specs = select_faults(cfg)
    groups = [g for g in detector_groups(resolve_ids(cfg.detectors)) if cfg.exclusive or len(g) > 1
              or not all_detectors()[g[0]].exclusive]
    runs, not_runnable = assign_recipes(specs)  # a fault no recipe can show gets no case, only its reason
    clean_targets = [t for t in cfg.targets if t in {s.target for s in specs.values()}] or list(cfg.targets)
    cases = []
    for seed in cfg.seeds:
        for fault_id, recipes in runs.items():
            cases += [Case(recipe, seed, (fault_id,), group, cfg.plugins, specs[fault_id].target)
                      for recipe in recipes for group in groups]
        if cfg.clean:
            cases += [Case(recipe, seed, (), group, cfg.plugins, target) for target in clean_targets
                      for recipe in recipes_of(target) for group in groups]
    faults = {k: v.metadata() for k, v in specs.items()}
    for fault_id, reason in not_runnable.items():
        faults[fault_id]["not_runnable"] = reason
    return cases, faults


# ---- isolated execution -------------------------------------------------------------------------

def run_and_bundle(case: Case, golden: dict | None, bundles: Path | None, command, pool=None,
                   timeout_s: float = CASE_TIMEOUT_S) -> dict:
    """``execute`` the case; with ``bundles``, capture its steps and bundle its top finding (if any) there."""
    if bundles is None:
        return execute(case, golden, pool, timeout_s)
    from faultbench.harness.bundle import bundle_name, write_bundle

    with tempfile.TemporaryDirectory(prefix="faultbench-capture-") as capture:
        record = execute(case, golden, pool, timeout_s, capture_dir=capture)
        if record["findings"] and not record.get("hang"):
            name = bundle_name(record["case"]) + ("" if len(case.detectors) > 1 else f"-{case.detectors[0]}")
            record["bundle"] = str(write_bundle(bundles / name, record, capture, list(command)))
    return record


def _child(case: Case, golden: dict | None, conn, bundles: Path | None, command) -> None:
    die_with_parent()
    torch.set_num_threads(1)
    try:
        conn.send(run_and_bundle(case, golden, bundles, command))
    except BaseException as exc:  # run_case contains crashes; this is the harness itself failing
        conn.send({"harness_error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


class ForkRunner:
    """Runs single-process cases in forked children, ``jobs`` at a time, each with a timeout."""

    def __init__(self, jobs: int, timeout_s: float, bundles: Path | None = None, command=()):
        self.jobs, self.timeout_s, self.bundles, self.command = jobs, timeout_s, bundles, command
        self.ctx = mp.get_context("fork")

    def run(self, cases: list[Case], golden: dict, done) -> None:
        pending = list(cases)
        running: dict = {}  # conn -> (process, case, deadline)
        while pending or running:
            while pending and len(running) < self.jobs:
                case = pending.pop(0)
                parent, child = self.ctx.Pipe(duplex=False)
                args = (case, golden_of(golden, case), child, self.bundles, self.command)
                proc = self.ctx.Process(target=_child, args=args, daemon=True)
                proc.start()
                child.close()
                running[parent] = (proc, case, time.monotonic() + self.timeout_s)
            ready = mp.connection.wait(list(running), timeout=0.2)
            for conn in ready:
                proc, case, _ = running.pop(conn)
                try:
                    record = conn.recv()
                except EOFError:
                    proc.join(5)
                    record = failed_record(case, "WorkerDied", f"the case's process died (exit code {proc.exitcode})")
                if "harness_error" in record:
                    record = failed_record(case, "HarnessError", record["harness_error"])
                proc.join(5)
                done(case, record)
            for conn, (proc, case, deadline) in list(running.items()):
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.join()
                    running.pop(conn)
                    done(case, failed_record(case, "Hang", f"killed after {self.timeout_s:.0f}s without finishing"))


def golden_of(golden: dict, case: Case) -> dict | None:
    """The golden entry of the case's recipe (``golden``: target -> recipe -> entry)."""
    return golden.get(case.target, {}).get(case.recipe)


def _warm_up(cases: list[Case]) -> None:
    """Import each target of ``cases`` and warm each single-process recipe here once (``Target.warm_up``), so
    every forked case starts with its stack imported (transformers costs seconds) and its corpus in memory."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # tokenizers' threads do not survive a fork
    for target, recipe in dict.fromkeys((c.target, c.recipe) for c in cases if c.world_size == 1):
        targets.get(target).warm_up(recipe)


def preload(cases: list[Case]) -> tuple[str, ...]:
    """The modules the rank pool's forkserver imports for the targets of ``cases``."""
    return tuple(m for t in dict.fromkeys(c.target for c in cases) for m in targets.get(t).preload)


class Progress:
    """Cases done, on stderr: a tqdm bar where tqdm is installed (it comes with the bench extra's transformers),
    else a plain line per case. ``named=False`` (a blind set) shows no case's name."""

    def __init__(self, total: int, enabled: bool, named: bool = True):
        self.total, self.enabled, self.named, self.done, self.start = total, enabled, named, 0, time.monotonic()
        self.bar = None
        if enabled and total:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="case", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def update(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        label = label if self.named else ""
        if self.bar is not None:
            self.bar.set_postfix_str(label[:50], refresh=False)
            self.bar.update()
            if self.done == self.total:
                self.bar.close()
            return
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        print(f"{self.done}/{self.total} {elapsed:.0f}s eta {eta:.0f}s {label}".rstrip(), file=sys.stderr, flush=True)


# what a cached record must hold for the scorer (harness.score.case_rows) and mark_manifested to read it
RECORD_FIELDS = {"case": dict, "name": str, "history": list, "crash": (dict, type(None)), "findings": list,
                 "detector_errors": dict, "step_seconds": dict, "other_seconds": dict, "train_s": (int, float),
                 "val_loss": (int, float, type(None)), "outputs": dict}
FINDING_FIELDS = {"detector": str, "step": int, "subsystem": str, "seam": (str, type(None)),
                  "confidence": (int, float)}


def record_problem(record, case: Case) -> str | None:
    """Why ``record`` cannot be ``case``'s record (None: it can)."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    wrong = [k for k, kind in RECORD_FIELDS.items() if not isinstance(record.get(k), kind)]
    if wrong:
        return f"missing or mistyped {', '.join(wrong)}"
    if record["case"] != case.to_dict():
        return f"it is the record of another case ({record['name']})"
    if not all(isinstance(f, dict) and all(isinstance(f.get(k), kind) and not isinstance(f.get(k), bool)
                                           for k, kind in FINDING_FIELDS.items()) for f in record["findings"]):
        return f"a finding without (or mistyping) {', '.join(FINDING_FIELDS)}"
    if not all(isinstance(h, dict) and isinstance(h.get("step"), int) for h in record["history"]):
        return "a history entry that is not a step record"
    return None


def read_cached(path: Path, case: Case) -> dict | None:
    """The cached record of ``case`` at ``path``, or None: absent, or unreadable (bad JSON, a wrong record),
    in which case it is reported on stderr by path and deleted, so the case is run again."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        problem = record_problem(record, case)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problem = str(e)
    if problem is None:
        return record
    print(f"faultbench: discarding the bad cache entry {path} ({problem}); running the case again",
          file=sys.stderr)
    path.unlink(missing_ok=True)
    return None


# failures of the machinery, not outcomes of the case: never cached, so a re-run runs the case again
NOT_OUTCOMES = ("WorkerDied", "HarnessError", "RankFailure")


def cached_or_todo(cases: list[Case], digest: str, use_cache: bool = True) -> tuple[dict[Case, dict], list[Case]]:
    """The cached record of each case that has one, and the cases left to run."""
    records, todo = {}, []
    for case in cases:
        cached = read_cached(CACHE / f"{case_hash(case, digest)}.json", case) if use_cache else None
        if cached is not None:
            records[case] = cached
        else:
            todo.append(case)
    return records, todo


def refuse_machinery_failures(records: dict[Case, dict]) -> None:
    """A case whose worker died, whose rank failed or whose harness raised has no outcome to score: one line
    (ValueError) before anything is written, so the existing results stay; they are not cached, so a rerun runs
    those cases alone again."""
    failed = [(case, record["crash"]) for case, record in records.items()
              if (record.get("crash") or {}).get("type") in NOT_OUTCOMES]
    if failed:
        kinds = ", ".join(sorted({crash["type"] for _, crash in failed}))
        first = " ".join(failed[0][1]["message"].split())[:160]
        raise ValueError(f"{len(failed)} of {len(records)} cases failed in the machinery ({kinds}; the first: "
                         f"{first}): nothing scored or written; run again (the others are cached)")


def keep(case: Case, record: dict, digest: str) -> None:
    """Name ``record`` after its case and cache it, unless it is a hang or a failure of the machinery."""
    record["name"] = case.name
    if not record.get("hang") and (record["crash"] or {}).get("type") not in NOT_OUTCOMES:
        write_text(CACHE / f"{case_hash(case, digest)}.json", json.dumps(record))


def run_bench(cfg: BenchConfig) -> dict:
    """Run the matrix (cached cases reused), score it, write results/, return summary.json's object."""
    start = time.monotonic()
    cases, faults = nonempty_matrix(cfg)
    records, cached = run_cases(cfg, cases)
    return score_records(records, cases, faults, cfg, wall_s=time.monotonic() - start, cached=cached)


def nonempty_matrix(cfg: BenchConfig) -> tuple[list[Case], dict[str, dict]]:
    """``build_matrix``, refused in one line (ValueError) when it holds no case: an empty bench must not replace
    existing results."""
    cases, faults = build_matrix(cfg)
    if not cases:
        raise ValueError("the bench matrix is empty (no fault and no clean case to run): nothing written")
    return cases, faults


def run_cases(cfg: BenchConfig, cases: list[Case]) -> tuple[dict[Case, dict], int]:
    """Every case's record (cached ones reused, the others run and cached) and how many came from the cache;
    a failure of the machinery in any case is refused (``refuse_machinery_failures``)."""
    from faultbench.harness.golden import load_golden
    from faultbench.harness.launch import RankPool

    torch.set_num_threads(1)
    if cfg.blind:  # a warning of a blind fault's code names its file and line: none is shown (the workers inherit it)
        warnings.simplefilter("ignore")
        os.environ["PYTHONWARNINGS"] = "ignore"
    digest = code_digest(cfg.plugins)
    records, todo = cached_or_todo(cases, digest, cfg.use_cache and cfg.bundles is None)
    progress = Progress(len(cases), cfg.progress, named=not cfg.blind)
    for case in records:
        progress.update(f"cached {case.name}")

    def done(case: Case, record: dict) -> None:
        keep(case, record, digest)
        records[case] = record
        progress.update(case.name)

    ranked = [c for c in todo if c.world_size > 1]
    pool = RankPool(2, preload=preload(ranked)) if ranked else None

    def run_all(batch: list[Case], golden: dict, on_done, bundles: Path | None = None) -> None:
        runner = ForkRunner(cfg.jobs, cfg.timeout_s, bundles, cfg.command)
        runner.run([c for c in batch if c.world_size == 1], golden, on_done)
        for case in (c for c in batch if c.world_size > 1):
            on_done(case, run_and_bundle(case, golden_of(golden, case), bundles, cfg.command, pool, cfg.timeout_s))

    def run_golden(golden_cases: list[Case]) -> list[dict]:
        finished: dict[Case, dict] = {}
        run_all(golden_cases, {}, finished.__setitem__)
        return [finished[c] for c in golden_cases]

    try:
        _warm_up(todo)
        # what the warm-up left (modules, corpora) is never garbage: out of the collector's sight, a forked case's
        # collections stay young (Trainer's accelerate collects at every train(): 0.4 s of a 2 s HF case)
        gc.freeze()
        golden = {t: load_golden(sorted({c.recipe for c in todo if c.target == t}), run_cases=run_golden, target=t)
                  for t in dict.fromkeys(c.target for c in todo)}
        run_all(todo, golden, done, cfg.bundles)
    finally:
        if pool is not None:
            pool.close()
    refuse_machinery_failures(records)
    return records, len(cases) - len(todo)


def score_records(records: dict[Case, dict], cases: list[Case], faults: dict[str, dict], cfg: BenchConfig,
                  wall_s: float, cached: int) -> dict:
    """Mark which faults showed, score ``cases``' records in the matrix's order and write the results."""
    mark_manifested(records)
    return score_and_write([records[c] for c in cases], faults, cfg, wall_s=wall_s, cached=cached)


def mark_manifested(records: dict[Case, dict]) -> None:
    """Set every fault case's "manifested": its run behaved unlike the clean case of the same recipe, seed and
    detectors (``harness.case.behaviour``); None where the matrix holds no such clean case (scored as shown)."""
    for case, record in records.items():
        if case.faults:
            clean = records.get(dataclasses.replace(case, faults=()))
            record["manifested"] = None if clean is None else behaviour(record) != behaviour(clean)


def target_scores(rows: list[dict], records: list[dict], faults: dict[str, dict], registry,
                  passive: dict[str, bool]) -> tuple[dict, dict]:
    """One target's summary (its rows, records and faults) and its detectors' timings, apart."""
    detector_ids = list(dict.fromkeys(r["detector"] for r in rows))
    scores = {d: aggregate([r for r in rows if r["detector"] == d], passive) for d in detector_ids}
    for d in detector_ids:
        if d in registry and registry[d].exclusive:
            scores[d]["overhead_ratio"] = exclusive_overhead(rows, d)
    timings = split_timings(scores)  # the clock's readings apart, so that a re-run rewrites the same scores
    return {
        "suite": scores.pop(SUITE, None),
        "blackbox": scores.pop(BLACKBOX, None),
        "detectors": scores,
        "cases": len(records),
        "faults": len(faults),
        "per_fault": per_fault(rows, faults),
        "not_runnable": not_runnable(faults),
        "crashed_cases": sum(bool(r["crash"]) for r in records),
        "hung_cases": sum(bool(r.get("hang")) for r in records),
    }, timings


def score_and_write(records: list[dict], faults: dict[str, dict], cfg: BenchConfig, wall_s: float,
                    cached: int = 0) -> dict:
    """Score every target apart (summary.json's "targets"), write the results, return the summary."""
    from faultbench.harness.report import write_results
    from faultbench.harness.sets import sets_rows, sets_section

    registry = all_detectors()
    passive = {d: cls.passive for d, cls in registry.items()}  # detector id -> its step hooks count in overhead
    rows = [row for record in records for row in case_rows(record, faults, suite_ids(), black_box_suite_ids(), passive)]
    names = [t for t in targets.names() if any(target_of(r) == t for r in records)]
    per_target, per_timings = {}, {}
    for t in names:
        per_target[t], per_timings[t] = target_scores(
            [r for r in rows if r["target"] == t], [r for r in records if target_of(r) == t],
            {f: m for f, m in faults.items() if m["target"] == t}, registry, passive)
    timings = {"wall_s": round(wall_s, 1), "cached_cases": cached,  # from .cache/bench: wall_s covers the rest
               "detectors": per_timings}
    summary = {"cases": len(records), "faults": len(faults), "seeds": list(cfg.seeds),
               "goals": {track: {k: list(v) for k, v in goals.items()} for track, goals in GOALS.items()},
               "targets": per_target}
    write_results(cfg.out, rows, summary, timings, faults, registry, sets_section(Path(cfg.out), summary),
                  sets_rows(Path(cfg.out), registry=summary))
    write_costs(Path(cfg.out) / "costs.json", records, cfg.timeout_s)
    return summary
