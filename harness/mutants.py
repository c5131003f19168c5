"""The mutant set: machine-made faults admitted by the bench's own evidence (``faultbench mutate``).

Admission, per target:
1. **Candidates**: every operator on every seam (``faults.mutants.generate.candidates``).
2. **Reach**: each clean recipe runs once with a line tracer on the seams; a candidate's home is the plainest
   recipe (fewest switched-on paths, as the matcher orders them) that executes a line it touches. Its
   manifest names that recipe, so the bench's matcher puts it there. A candidate no recipe reaches cannot
   show: it is counted as unreached and never run.
3. **Sample**: at most ``per_cell`` candidates per (seam, operator), spread evenly over the seam's sites.
4. **Register** like any fault (signature, names, closure, splice): a refused candidate would crash at import.
5. **Show**: the case (no detectors) runs on seeds 0 and 1 beside its clean twin, seed 2 only when they split;
   a candidate that behaves unlike its twin (``harness.case.behaviour``) on >= 2 of 3 seeds shows.
   Equivalent mutants (never different) are dropped, and so are mutants that hang (each would cost every bench
   run its case timeout; a hang is not a fault a detector can be scored on in a bounded run).
6. **Distinct**: a candidate whose records (behaviour, crash message and frames, on every seed) equal an
   earlier candidate's is a duplicate and dropped.
The admitted list is written with each mutant's operator, seam, recipe, observed symptoms and diff
(``faults/mutants/mutants-v1.json``); ``faults.mutants.admitted`` registers it for ``bench --mutants``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import inspect
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from faultbench import targets
from faultbench.faults.mutants import VERSION, admitted_path
from faultbench.faults.mutants.generate import Candidate, candidates, register
from faultbench.faults.registry import _code_tree, load_plugin, seam_table
from faultbench.harness.atomic import write_text
from faultbench.harness.case import behaviour
from faultbench.harness.record import Case
from faultbench.model.seams import resolve
from faultbench.paths import cache_dir

CANDIDATES_PLUGIN = "faultbench.faults.mutants.candidates"
PER_CELL = 4  # candidates run per (seam, operator)
ADMIT_SEEDS = (0, 1, 2)


# ---- reach: which recipe executes which seam lines -------------------------------------------------------

def _seam_codes(target: str) -> dict:
    """Every code object of ``target``'s seams (nested functions included) -> the seam's source file."""
    out = {}
    for seam in seam_table(target):
        fn = inspect.unwrap(resolve(seam))
        for code in _code_tree(fn.__code__):
            out[code] = code.co_filename
    return out


def traced(target: str, fn, *args) -> tuple[object, list[tuple[str, int]]]:
    """``fn(*args)``'s result and the (file, line) pairs of ``target``'s seams it executed."""
    codes = _seam_codes(target)
    hits: set[tuple[str, int]] = set()

    def local(frame, event, arg):
        if event == "line":
            hits.add((codes[frame.f_code], frame.f_lineno))
        return local

    def calls(frame, event, arg):
        return local if frame.f_code in codes else None

    sys.settrace(calls)
    threading.settrace(calls)
    try:
        result = fn(*args)
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return result, sorted(hits)


def _traced_case(rank: int, case_dict: dict, workdir: str | None = None) -> tuple[dict, list]:
    """The case on this process (or rank, a ``RankPool`` entry) under ``traced``: (record, seam lines run)."""
    from faultbench.harness.case import run_target_case
    from faultbench.harness.record import case_from_dict

    case = case_from_dict(case_dict)
    return traced(case.target, run_target_case, case, None, rank, workdir)


def _child_traced(case_dict: dict, conn) -> None:
    import torch

    torch.set_num_threads(1)
    conn.send(_traced_case(0, case_dict))
    conn.close()


def reach(target: str, pool=None) -> dict[str, set[tuple[str, int]]]:
    """{recipe: the seam lines its clean seed-0 run executes}, cached by the sources' digest."""
    from faultbench.harness.digest import code_digest

    path = cache_dir() / "mutants" / f"reach-{target}-{code_digest()}.json"
    if path.exists():
        return {r: {tuple(h) for h in hits} for r, hits in json.loads(path.read_text()).items()}
    import multiprocessing as mp
    import tempfile

    out = {}
    for name, recipe in targets.get(target).recipes().items():
        case = Case(name, 0, (), (), (), target)
        if recipe.world_size == 1:  # in a child: the tracer and the run's state stay out of this process
            parent, child = mp.get_context("fork").Pipe(duplex=False)
            proc = mp.get_context("fork").Process(target=_child_traced, args=(case.to_dict(), child))
            proc.start()
            child.close()
            _, hits = parent.recv()
            proc.join()
        else:
            with tempfile.TemporaryDirectory(prefix="faultbench-reach-") as workdir:
                hits = [h for _, rank_hits in pool.run(_traced_case, case.to_dict(), workdir, timeout_s=600)
                        for h in rank_hits]
        out[name] = {tuple(h) for h in hits}
    write_text(path, json.dumps({r: sorted(h) for r, h in out.items()}))
    return out


def manifest_for(target: str, recipe: str) -> dict:
    """The manifest fields (scenario, variant, steps) whose plainest fitting recipe is ``recipe``."""
    r = targets.get(target).recipes()[recipe]
    scenario = {(False, False): "train", (True, False): "resume", (False, True): "ddp",
                (True, True): "ddp_resume"}[(r.resume_at is not None, r.world_size > 1)]
    if target == "ref":
        variant = copy.deepcopy(r.overrides)
        variant.get("train", {}).pop("world_size", None)
    else:
        variant = {"recipe": recipe}
    return {"scenario": scenario, "variant": variant, "steps": r.steps}


def home_recipes(target: str, cands: list[Candidate], lines_run: dict[str, set]) -> dict[str, str]:
    """{candidate id: the plainest recipe that executes a line the candidate touches} (unreached ones absent)."""
    stack = targets.get(target)
    recipes = stack.recipes()
    order = sorted(recipes, key=lambda name: stack.features(recipes[name]))
    files = {seam: inspect.getsourcefile(inspect.unwrap(resolve(seam))) for seam in {c.seam for c in cands}}
    homes = {}
    for c in cands:
        touched = {(files[c.seam], line) for line in range(c.lines[0], c.lines[1] + 1)}
        home = next((name for name in order if touched & lines_run[name]), None)
        if home is not None:
            homes[c.id] = home
    return homes


def sample(cands: list[Candidate], per_cell: int) -> list[Candidate]:
    """At most ``per_cell`` candidates of each (seam, operator), evenly spread over its sites, order kept."""
    cells: dict[tuple[str, str], list[Candidate]] = {}
    for c in cands:
        cells.setdefault((c.seam, c.operator), []).append(c)
    keep = set()
    for cell in cells.values():
        step = len(cell) / per_cell
        keep |= {cell[int(i * step)].id for i in range(min(per_cell, len(cell)))}
    return [c for c in cands if c.id in keep]


# ---- running cases ----------------------------------------------------------------------------------------

def run_records(cases: list[Case], jobs: int, timeout_s: float, progress: bool = True) -> dict[Case, dict]:
    """Every case's record, from the bench cache where it is there (the same cache and keys as ``bench``)."""
    from faultbench.harness.bench import ForkRunner, Progress, _warm_up, cached_or_todo, code_digest, keep, preload
    from faultbench.harness.case import execute
    from faultbench.harness.launch import RankPool

    digest = code_digest(tuple(dict.fromkeys(p for c in cases for p in c.plugins)))
    records, todo = cached_or_todo(cases, digest)
    bar = Progress(len(todo), progress)

    def done(case: Case, record: dict) -> None:
        keep(case, record, digest)
        records[case] = record
        bar.update(case.name)

    _warm_up(todo)  # every forked case starts with its stack imported and its corpus built
    ForkRunner(jobs, timeout_s).run([c for c in todo if c.world_size == 1], {}, done)
    ranked = [c for c in todo if c.world_size > 1]
    if ranked:
        with RankPool(2, preload=preload(ranked)) as pool:
            for case in ranked:
                done(case, execute(case, None, pool, timeout_s))
    return records


def _fingerprint(record: dict) -> str:
    """What makes two records the same outcome: the behaviour, and a crash's message and innermost frames."""
    crash = record["crash"] or {}
    return behaviour(record) + json.dumps([crash.get("message", "")[:200], crash.get("frames", [])[-3:]])


def symptoms(record: dict, clean: dict) -> tuple[str, ...]:
    """The symptom a mutant showed, in the registry's vocabulary (observed, not designed)."""
    crash = record["crash"]
    if record.get("hang"):
        return ("hang",)
    if crash:
        message = f"{crash['type']}: {crash.get('message', '')}".lower()
        if crash["type"] == "IndexError" or "index" in message:
            return ("crash-index",)
        if any(w in message for w in ("dtype", "half", "bfloat16", "float", "long", "expected scalar type")):
            return ("crash-dtype",)
        if any(w in message for w in ("size", "shape", "dimension", "broadcast", "mat1")):
            return ("crash-shape",)
        return ("crash-state",)
    losses = [h.get("loss") for h in record["history"]]
    if any(v is None or v != v or abs(v) == float("inf") for v in losses) or record["val_loss"] != record["val_loss"]:
        return ("nan",)
    if clean["val_loss"] and record["val_loss"] and record["val_loss"] > 1.1 * clean["val_loss"]:
        return ("divergence",)
    return ("silent-quality",)


TRIGGERS = {"resume": "on-resume", "ddp": "multi-rank", "ddp_resume": "multi-rank", "train": "always"}


def admit(targets_: tuple[str, ...], per_cell: int = PER_CELL, jobs: int = 2, timeout_s: float = 60.0,
          limit: int | None = None, progress: bool = True) -> dict:
    """Admit the mutant set of ``targets_``; returns the versioned document (see the module docstring).
    ``limit``: only the first N sampled candidates of each target (a smoke run)."""
    from faultbench.harness.launch import RankPool

    start = time.monotonic()
    doc = {"version": VERSION, "per_cell": per_cell, "seeds": list(ADMIT_SEEDS), "targets": {}, "mutants": []}
    for target in targets_:
        cands = candidates(target)
        stats = {op: Counter() for op in dict.fromkeys(c.operator for c in cands)}
        for c in cands:
            stats[c.operator]["candidates"] += 1
        needs_pool = any(r.world_size > 1 for r in targets.get(target).recipes().values())
        pool = RankPool(2, preload=targets.get(target).preload) if needs_pool else None
        try:
            homes = home_recipes(target, cands, reach(target, pool))
        finally:
            if pool is not None:
                pool.close()
        for c in cands:
            stats[c.operator]["unreached" if c.id not in homes else "reached"] += 1
        chosen = sample([c for c in cands if c.id in homes], per_cell)[:limit]
        meta = {c.id: _metadata(target, homes[c.id]) for c in chosen}
        refused = register([(c, meta[c.id]) for c in chosen])
        for c in chosen:
            stats[c.operator]["run"] += 1
            stats[c.operator]["refused"] += c.id in refused
        chosen = [c for c in chosen if c.id not in refused]
        rejected: dict[str, dict] = {}
        admitted = _show_and_dedup(target, chosen, homes, jobs, timeout_s, stats, progress, rejected)
        for c, sym, differing in admitted:
            doc["mutants"].append({
                "id": c.id, "target": target, "seam": c.seam, "subsystem": c.subsystem, "operator": c.operator,
                "label": c.label, "lines": list(c.lines), "recipe": homes[c.id],
                **meta[c.id], "symptoms": list(sym), "seeds_shown": differing,
                "digest": hashlib.sha256(c.function.encode()).hexdigest()[:16], "diff": c.diff})
        doc["targets"][target] = {"candidates": len(cands), "operators": {op: dict(s) for op, s in stats.items()},
                                  "admitted": len(admitted), "refused": refused, "rejected": rejected}
    doc["wall_s"] = round(time.monotonic() - start, 1)
    return doc


def _metadata(target: str, recipe: str) -> dict:
    manifest = manifest_for(target, recipe)
    return {"manifest": manifest, "trigger": TRIGGERS[manifest["scenario"]] if recipe not in ("fp16", "bf16")
            else "amp-only"}


def _show_and_dedup(target, chosen, homes, jobs, timeout_s, stats, progress, rejected):
    """[(candidate, symptoms, seeds shown)] of the chosen candidates that show and are distinct; ``rejected`` gets
    why each other one was dropped, ``stats`` the counts per operator."""
    load_plugin(CANDIDATES_PLUGIN)  # rank workers register every candidate through it; here, those not yet
    plugins = (CANDIDATES_PLUGIN,)

    def cases(seed, ids):
        fault_cases = [Case(homes[i], seed, (i,), (), plugins, target) for i in ids]
        clean = [Case(r, seed, (), (), plugins, target) for r in sorted({homes[i] for i in ids})]
        return fault_cases, clean

    hung: set[str] = set()
    shown: dict[str, list[int]] = {c.id: [] for c in chosen}
    prints: dict[str, list[str]] = {c.id: [] for c in chosen}
    first: dict[str, tuple[dict, dict]] = {}
    pending = [c.id for c in chosen]
    for seed in ADMIT_SEEDS:
        if seed == ADMIT_SEEDS[-1]:  # the third seed decides only a split
            pending = [i for i in pending if len(shown[i]) == 1 and i not in hung]
        if not pending:
            continue
        fault_cases, clean = cases(seed, pending)
        records = run_records(fault_cases + clean, jobs, timeout_s, progress)
        for case in fault_cases:
            fid = case.faults[0]
            twin = records[dataclasses.replace(case, faults=())]
            record = records[case]
            if record.get("hang"):
                hung.add(fid)
            elif behaviour(record) != behaviour(twin):
                shown[fid].append(seed)
            prints[fid].append(_fingerprint(record))
            first.setdefault(fid, (record, twin))
    out, seen = [], {}
    for c in chosen:
        key = "\n".join(prints[c.id][:2])
        if len(shown[c.id]) >= 2 and key not in seen and c.id not in hung:
            seen[key] = c.id
            stats[c.operator]["admitted"] += 1
            out.append((c, symptoms(*first[c.id]), shown[c.id]))
            continue
        stage = "hang" if c.id in hung else "not_shown" if len(shown[c.id]) < 2 else "duplicate"
        stats[c.operator][stage] += 1
        rejected[c.id] = {"recipe": homes[c.id], "stage": stage, "seeds_shown": shown[c.id],
                          **({"duplicate_of": seen[key]} if stage == "duplicate" else {})}
    return out


def write(doc: dict, path: Path | None = None) -> Path:
    path = path or admitted_path()
    return write_text(path, json.dumps(doc, indent=1, sort_keys=False) + "\n")


# ---- reading and reporting ---------------------------------------------------------------------------------

ADMITTED_PLUGIN = "faultbench.faults.mutants.admitted"
STAGES = ("candidates", "unreached", "run", "refused", "hang", "not_shown", "duplicate", "admitted")


def read(path: Path | None = None) -> dict:
    """The admitted set's document; a missing or unreadable file raises ``ValueError`` naming it."""
    path = path or admitted_path()
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the mutant set {path}: {e} (`faultbench mutate --admit` writes it)") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("mutants"), list):
        raise ValueError(f"{path} is not a {VERSION} mutant set")
    return doc


def admission_table(doc: dict, targets_: tuple[str, ...]) -> list[dict]:
    """One row per (target, operator): how many candidates reached each stage, and the admit rate (admitted over
    run: the candidates that were registered and run beside their clean twins)."""
    rows = []
    for target in targets_:
        for op, stats in doc["targets"].get(target, {}).get("operators", {}).items():
            row = {"target": target, "operator": op, **{k: stats.get(k, 0) for k in STAGES}}
            row["admit_rate"] = round(row["admitted"] / row["run"], 3) if row["run"] else None
            rows.append(row)
    return rows


def subsystem_counts(doc: dict) -> dict[str, Counter]:
    return {t: Counter(m["subsystem"] for m in doc["mutants"] if m["target"] == t) for t in doc["targets"]}


def admission_markdown(rows: list[dict], doc: dict) -> str:
    head = ["target", "operator", *STAGES, "admit rate"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rate = "-" if r["admit_rate"] is None else f"{r['admit_rate']:.2f}"
        lines.append("| " + " | ".join([r["target"], r["operator"], *(str(r[k]) for k in STAGES), rate]) + " |")
    per = subsystem_counts(doc)
    subs = "; ".join(f"{t}: " + ", ".join(f"{s} {n}" for s, n in sorted(c.items())) for t, c in per.items())
    return "\n".join([f"{VERSION}: {len(doc['mutants'])} admitted mutants (per cell {doc['per_cell']}, seeds "
                      f"{doc['seeds']}); by subsystem: {subs}", "", *lines])
