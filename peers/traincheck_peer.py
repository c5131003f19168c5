"""TrainCheck 0.2.0 as a peer tool, scored on the bench's own cases.

TrainCheck (https://github.com/OrderLab/TrainCheck) rewrites a training *script* to trace PyTorch API
calls, infers invariants from traces of healthy runs, and checks a new run's trace against them. It
cannot be a plugin detector (it instruments a whole process before the model is imported), so this
module runs its documented command-line workflow on every case, each step a subprocess with a timeout:

1. reference traces, per recipe: ``traincheck-collect --pyscript peers/traincheck_case.py`` on clean
   runs with the golden seeds 1000 and 1001 (never a bench seed);
2. ``traincheck-infer -t <both API traces> -o invariants.json``;
3. validation: one checking-mode collection of golden seed 1000 is checked, and the invariants it
   violates are dropped. They fail on the very run they were inferred from, so they are artifacts of
   the two collection modes (full tracing vs ``--invariants`` selective tracing), not of training;
4. per case: ``traincheck-collect --invariants invariants.json --sampling-interval 1
   --warm-up-steps <steps> --API-dump-stack-trace`` (every step of the 16-step run is traced; the
   stack trace is what localizes a violation), then ``traincheck-check -f trace -i invariants.json``.

Settings, and why: torch is instrumented (``-t torch``, the default). No ``--models-to-track``:
inference on traces with the ``sampler`` model tracker crashes (``KeyError: 'proxy_obj_names'`` in
``APIContainRelation`` with the default pandas backend, a polars ``ComputeError`` with ``-b polars``);
the other two trackers were not tried, as their source shows they cannot see this training: ``proxy``
wraps only the script's variable (training goes through ``run.model``), ``subclass`` swaps the
parameters for new objects after ``build_run`` handed the old ones to the optimizer. Instrumenting the
reference too (``-t torch model``) traces the synthetic corpus generator (400K calls, 240 MB per
trace), and inference then progressed at ~65 s per API (estimated 45+ minutes for one relation of one
recipe; stopped), so the reference is located through stack traces instead.
Invariants are cached per recipe and the digest of ``model/`` under ``.cache/peers/traincheck/``,
case records (with TrainCheck's raw violations; findings are mapped on load, so editing the mapping
needs no re-run) under ``.cache/peers/traincheck/cases/``, keyed by the case and the digest of
``model/``, ``faults/`` and the case script.

The 2-rank recipes (``ddp``, ``zero``, ``ddp_resume``) are not run: traincheck-collect runs one
script as one process, the bench's ranks live in a pool of workers it cannot instrument; those cases
are recorded with no findings and an error, and count as missed.

Mapping a violation to a finding (``violation_finding``) sees only TrainCheck's output (``failed.log``):
- step: the violating event's ``meta_vars.step``; TrainCheck counts training iterations from 1, so a
  training-stage event at trace step k is optimizer step k - 1; other stages keep the counter (init: 0,
  the evaluation after the run: the number of steps taken);
- seam: the innermost frame of the event's stack trace inside ``model/`` that is a seam of
  ``model.seams.SEAMS`` (a method's frame names the function only: the line picks the class);
  subsystem: that seam's, confidence 0.6;
- otherwise the subsystem comes from the API the event (or the invariant's first API) names, by
  ``API_SUBSYSTEMS`` (longest matching prefix), seam None, confidence 0.4.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import inspect
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "peers" / "traincheck"
CASE_SCRIPT = Path(__file__).resolve().parent / "traincheck_case.py"
TOOL = "traincheck"
GOLDEN_SEEDS = (1000, 1001)
DEFAULT_SEEDS = (0,)  # one seed fits the ~15-minute budget on 2 cores (a case costs ~35 s of CPU)
STEP_TIMEOUT_S = 300.0  # one collect or check subprocess
INFER_TIMEOUT_S = 1200.0
SETTINGS = "tc0.2.0/torch/no-model-tracking/interval1/stack/validated"  # part of every cache key

# API prefix -> subsystem, for violations with no frame of the reference on their stack. Longest prefix wins.
API_SUBSYSTEMS = {
    "torch.optim": "optimizer",
    "torch.nn.utils.clip_grad": "optimizer",
    "torch.amp": "precision",
    "torch.cuda.amp": "precision",
    "torch.autocast": "precision",
    "torch.distributed": "distributed",
    "torch.nn.parallel": "distributed",
    "torch.nn.functional.scaled_dot_product_attention": "model",  # where the mask is applied, but model math
    "torch.nn.functional.cross_entropy": "loss",
    "torch.nn.modules.loss": "loss",
    "torch.nn": "model",
    "torch.serialization": "checkpoint",
    "torch.utils.data": "data",
}
DEFAULT_SUBSYSTEM = "model"
FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


# ---- mapping TrainCheck's output to findings -------------------------------------------------------

def parse_failed_log(text: str) -> list[dict]:
    """The violations in a ``failed.log``: a sequence of pretty-printed JSON objects, not a JSON list."""
    decoder, pos, out = json.JSONDecoder(), 0, []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return out
        obj, pos = decoder.raw_decode(text, pos)
        out.append(obj)


def api_subsystem(api: str | None) -> str:
    """The subsystem of a torch API by ``API_SUBSYSTEMS`` (longest prefix), ``DEFAULT_SUBSYSTEM`` if none."""
    matches = [p for p in API_SUBSYSTEMS if api and (api == p or api.startswith(p + "."))]
    return API_SUBSYSTEMS[max(matches, key=len)] if matches else DEFAULT_SUBSYSTEM


@functools.cache
def _seam_lines(seam: str) -> range | None:
    """The source lines of a seam's definition (None if it cannot be found)."""
    from faultbench.model.seams import resolve

    try:
        lines, start = inspect.getsourcelines(inspect.unwrap(resolve(seam)))
    except (OSError, TypeError, ValueError):
        return None
    return range(start, start + len(lines))


def frame_seam(path: str, line: int, func: str, seams: dict[str, str], root: Path = ROOT) -> str | None:
    """The seam a stack frame is in: its module under ``model/`` and function name, the line picking
    among methods of the same name (``Block.forward`` vs ``GPT.forward``)."""
    try:
        rel = Path(path).resolve().relative_to(root)
    except ValueError:
        return None
    if rel.parts[0] != "model" or rel.suffix != ".py":
        return None
    module = ".".join(rel.with_suffix("").parts)
    candidates = [s for s in seams if s.startswith(module + ".") and s.rsplit(".", 1)[1] == func]
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    return next((s for s in candidates if line in (_seam_lines(s) or ())), None)


def stack_seam(stack: list[str], seams: dict[str, str], root: Path = ROOT) -> tuple[str | None, str | None]:
    """The innermost seam on a TrainCheck stack trace (outermost first) and that frame as ``file:line in f``."""
    for entry in reversed(stack or []):
        match = FRAME.search(entry)
        if match is None:
            continue
        seam = frame_seam(match["path"], int(match["line"]), match["func"], seams, root)
        if seam is not None:
            rel = os.path.relpath(match["path"], root)
            return seam, f"{rel}:{match['line']} in {match['func']}"
    return None, None


def trace_step(event: dict) -> int | None:
    """The optimizer step of a trace event (see the module docstring)."""
    step, stage = event.get("meta_vars.step"), event.get("meta_vars.stage")
    if not isinstance(step, (int, float)) or step != step:  # missing or NaN
        return None
    return max(int(step) - 1, 0) if stage == "training" else int(step)


def violation_finding(violation: dict, seams: dict[str, str], root: Path = ROOT) -> dict:
    """One finding for one violated invariant of TrainCheck's ``failed.log``."""
    inv = violation["invariant"]
    apis = [p["api_full_name"] for p in inv.get("params", []) if p.get("param_type") == "APIParam"]
    events = violation.get("trace") or [{}]
    event = events[0]
    api = event.get("function") if isinstance(event.get("function"), str) else (apis[0] if apis else None)
    seam, frame = stack_seam(event.get("stack_trace") if isinstance(event.get("stack_trace"), list) else [],
                             seams, root)
    evidence = {"invariant": inv.get("text_description", ""), "relation": inv.get("relation", ""), "apis": apis,
                "api": api, "stage": event.get("meta_vars.stage")}
    if frame:
        evidence["frame"] = frame
    return {"detector": TOOL, "step": trace_step(event), "subsystem": seams[seam] if seam else api_subsystem(api),
            "seam": seam, "message": f"invariant violated: {inv.get('text_description', inv.get('relation', ''))}",
            "evidence": evidence, "confidence": 0.6 if seam else 0.4}


def findings_for(violations: list[dict], seams: dict[str, str], root: Path = ROOT) -> list[dict]:
    """Every violation as a finding, ranked like the bench ranks findings (confidence, then step)."""
    from faultbench.detectors.api import rank_key

    return sorted((violation_finding(v, seams, root) for v in violations), key=rank_key)


# ---- running TrainCheck ---------------------------------------------------------------------------

class StepFailed(RuntimeError):
    """A TrainCheck command failed or timed out."""


def _tool(name: str) -> str:
    """A TrainCheck entry point of this interpreter's environment."""
    return str(Path(sys.executable).parent / name)


def _env(**extra: str) -> dict:
    # one thread per process: the machine has 2 cores and runs two cases at a time
    return {**os.environ, "OMP_NUM_THREADS": "1", "POLARS_MAX_THREADS": "1", "NUMBA_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", **extra}


def _run(cmd: list[str], cwd: Path, timeout_s: float, env: dict | None = None) -> float:
    """Run ``cmd`` in its own process group (killed whole on timeout); its wall seconds."""
    start = time.perf_counter()
    with open(cwd / f"{Path(cmd[0]).name}.log", "a") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env or _env(),
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise StepFailed(f"{Path(cmd[0]).name} did not finish within {timeout_s:.0f}s (hung?)") from None
    if code != 0:
        tail = (cwd / f"{Path(cmd[0]).name}.log").read_text(errors="replace")[-400:]
        raise StepFailed(f"{Path(cmd[0]).name} exited with {code}: {tail}")
    return time.perf_counter() - start


def collect(case_dict: dict, work: Path, invariants: Path | None, steps: int) -> tuple[dict, float]:
    """Train one case under ``traincheck-collect`` into ``work/trace``; the script's record and the seconds."""
    shutil.copy(CASE_SCRIPT, work / CASE_SCRIPT.name)  # the runner writes its rewritten copy next to the script
    cmd = [_tool("traincheck-collect"), "--pyscript", str(work / CASE_SCRIPT.name), "--output-dir", str(work / "trace")]
    if invariants is not None:
        cmd += ["--invariants", str(invariants), "--sampling-interval", "1", "--warm-up-steps", str(steps),
                "--API-dump-stack-trace"]
    record_path = work / "record.json"
    seconds = _run(cmd, work, STEP_TIMEOUT_S, _env(TRAINCHECK_CASE=json.dumps(case_dict),
                                                   TRAINCHECK_CASE_RECORD=str(record_path)))
    return json.loads(record_path.read_text()), seconds


def check(work: Path, invariants: Path) -> tuple[list[dict], float]:
    """``traincheck-check`` of ``work/trace``; the violations and the seconds."""
    seconds = _run([_tool("traincheck-check"), "-f", str(work / "trace"), "-i", str(invariants), "-o",
                    str(work / "checked"), "--no-html-report"], work, STEP_TIMEOUT_S)
    failed = list((work / "checked").rglob("failed.log"))
    return (parse_failed_log(failed[0].read_text()) if failed else []), seconds


def _api_traces(trace_dir: Path) -> list[str]:
    return sorted(str(p) for p in trace_dir.glob("trace_API_*"))


def _invariant_key(inv: dict) -> str:
    """What identifies an invariant in both the invariants file and ``failed.log``."""
    return json.dumps([inv.get("relation"), inv.get("params")], sort_keys=True)


def golden_invariants(recipe: str, digest: str) -> Path:
    """The validated invariants of a recipe (cached): steps 1-3 of the module docstring."""
    from faultbench.harness.atomic import write_text
    from faultbench.targets.ref.recipes import RECIPES

    path = CACHE / f"invariants-{recipe}-{digest}.json"
    if path.exists():
        return path
    steps = RECIPES[recipe].steps
    with tempfile.TemporaryDirectory(prefix="traincheck-golden-") as tmp:
        traces, timings = [], {}
        for seed in GOLDEN_SEEDS:
            work = Path(tmp) / f"s{seed}"
            work.mkdir()
            record, timings[f"collect_s{seed}"] = collect({"recipe": recipe, "seed": seed, "faults": []}, work, None,
                                                          steps)
            if record["crash"]:
                raise StepFailed(f"golden run {recipe}/s{seed} crashed: {record['crash']['message']}")
            traces += _api_traces(work / "trace")
        raw = Path(tmp) / "raw.json"
        # API traces only: the variable traces make inference crash (see the module docstring)
        timings["infer"] = _run([_tool("traincheck-infer"), "-t", *traces, "-o", str(raw)], Path(tmp),
                                INFER_TIMEOUT_S)
        work = Path(tmp) / "validate"
        work.mkdir()
        _, timings["validate_collect"] = collect({"recipe": recipe, "seed": GOLDEN_SEEDS[0], "faults": []}, work, raw,
                                                 steps)
        violations, timings["validate_check"] = check(work, raw)
        dropped = {_invariant_key(v["invariant"]) for v in violations}
        kept = [line for line in raw.read_text().splitlines()
                if line.strip() and _invariant_key(json.loads(line)) not in dropped]
        write_text(path, "\n".join(kept) + "\n")
        write_text(path.with_suffix(".meta.json"), json.dumps({"recipe": recipe, "inferred": len(kept) + len(dropped),
                                                                "dropped": len(dropped), "kept": len(kept),
                                                                "seconds": timings}, indent=1))
    return path


# ---- cases, the matrix, results -------------------------------------------------------------------

def unsupported(recipe: str) -> str | None:
    """Why TrainCheck cannot run a recipe here (None: it can)."""
    from faultbench.targets.ref.recipes import RECIPES

    if RECIPES[recipe].world_size > 1:
        return "not run: traincheck-collect instruments one script process, not the bench's 2-rank worker pool"
    return None


def run_case(case, invariants: Path) -> dict:
    """One case collected and checked; its record in the bench's format with TrainCheck's raw violations
    under "violations" and no findings yet (``with_findings`` maps them); never raises."""
    from faultbench.harness.record import empty_record, failed_record
    from faultbench.targets.ref.recipes import RECIPES

    start = time.perf_counter()
    case_dict = case.to_dict()
    with tempfile.TemporaryDirectory(prefix="traincheck-case-") as tmp:
        work = Path(tmp)
        try:
            record, collect_s = collect(case_dict, work, invariants, RECIPES[case.recipe].steps)
        except StepFailed as exc:
            kind = "Hang" if "did not finish" in str(exc) else "TrainCheckError"
            out = failed_record(case, kind, str(exc))
            out["detector_errors"] = {TOOL: str(exc)[:500]}
            return out
        out = {**empty_record(case), **{k: record[k] for k in ("history", "crash", "val_loss", "train_s",
                                                                 "resumed_at", "wall_s")}}
        out["traincheck_s"] = {"collect": round(collect_s, 2)}
        try:
            out["violations"], check_s = check(work, invariants)
            out["traincheck_s"]["check"] = round(check_s, 2)
        except StepFailed as exc:
            out["detector_errors"] = {TOOL: str(exc)[:500]}
    out["traincheck_s"]["case"] = round(time.perf_counter() - start, 2)
    return out


def unsupported_record(case, reason: str) -> dict:
    from faultbench.harness.record import empty_record

    return {**empty_record(case), "detector_errors": {TOOL: reason}}


def build_cases(seeds, fault_ids=None) -> tuple[list, dict[str, dict]]:
    """The bench's matrix with TrainCheck as the only detector, and the faults' metadata (the answer key)."""
    from faultbench.faults.registry import all_faults, get_fault
    from faultbench.harness.matcher import recipe_for
    from faultbench.harness.record import Case
    from faultbench.targets.ref.recipes import RECIPES

    specs = dict(all_faults()) if fault_ids is None else {f: get_fault(f) for f in fault_ids}  # "did you mean"
    cases = []
    for seed in seeds:
        cases += [Case(recipe_for(spec.manifest), seed, (f,), (TOOL,)) for f, spec in specs.items()]
        cases += [Case(recipe, seed, (), (TOOL,)) for recipe in RECIPES]
    return cases, {f: spec.metadata() for f, spec in specs.items()}


def code_digest() -> str:
    """What a case's TrainCheck output depends on (the mapping is applied on load, so it is not part of it)."""
    from faultbench.harness.digest import source_digest

    blob = f"{source_digest('model', 'faults', 'peers/traincheck_case.py')}/{SETTINGS}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def invariants_digest() -> str:
    """What a recipe's invariants depend on: the reference and the settings."""
    from faultbench.harness.digest import source_digest

    return hashlib.sha256(f"{source_digest('model')}/{SETTINGS}".encode()).hexdigest()[:16]


def with_findings(record: dict) -> dict:
    """The record with its violations mapped to ranked findings (the bench's "findings")."""
    from faultbench.model.seams import SEAMS

    return {**record, "findings": findings_for(record.get("violations", []), SEAMS)}


def run_matrix(cases: list, jobs: int, use_cache: bool = True, progress=print) -> list[dict]:
    """Every case's record (cached ones reused), ``jobs`` cases at a time; invariants first, per recipe."""
    from faultbench.harness.atomic import write_text
    from faultbench.harness.digest import case_hash
    from faultbench.harness.record import failed_record

    inv_digest = invariants_digest()
    digest = code_digest()
    recipes = sorted({c.recipe for c in cases if not unsupported(c.recipe)})
    invariants: dict[str, Path | Exception] = {}

    def infer(recipe: str) -> None:
        try:
            invariants[recipe] = golden_invariants(recipe, inv_digest)
        except StepFailed as exc:
            invariants[recipe] = exc

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(infer, recipes))
    records: dict = {}

    def one(case) -> None:
        path = CACHE / "cases" / f"{case_hash(case, digest)}.json"
        if use_cache and path.exists():
            records[case] = with_findings(json.loads(path.read_text()))
            return
        reason = unsupported(case.recipe)
        inv = invariants.get(case.recipe)
        if reason:
            record = unsupported_record(case, reason)
        elif isinstance(inv, Exception):
            record = failed_record(case, "TrainCheckError", f"no invariants: {inv}")
        else:
            record = run_case(case, inv)
        record["name"] = case.name
        if not record.get("hang"):
            write_text(path, json.dumps(record))
        records[case] = record = with_findings(record)
        progress(f"{len(records)}/{len(cases)} {case.name} findings={len(record['findings'])} "
                 f"{record.get('traincheck_s', '')}")

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, cases))
    return [records[c] for c in cases]


def write_results(records: list[dict], faults: dict[str, dict], out: Path, seeds, wall_s: float) -> dict:
    """bench.csv (one row per case) and summary.json under ``out``, atomically; the summary."""
    from faultbench.harness.atomic import write_text
    from faultbench.harness.report import write_csv
    from faultbench.harness.score import aggregate, case_rows

    rows = [row for record in records for row in case_rows(record, faults, suite_ids=[])]
    scores = aggregate(rows, {TOOL: False})  # TrainCheck's cost is its own runs, not hooks: see "timings"
    timings = [r["traincheck_s"] for r in records if "traincheck_s" in r]
    summary = {
        "tool": "traincheck 0.2.0",
        "detectors": {TOOL: scores},
        "cases": len(records),
        "faults": len(faults),
        "seeds": list(seeds),
        "not_run": sorted({r["name"] for r in records if "not run" in r["detector_errors"].get(TOOL, "")}),
        "errors": {r["name"]: r["detector_errors"][TOOL] for r in records
                   if TOOL in r["detector_errors"] and "not run" not in r["detector_errors"][TOOL]},
        "crashed_cases": sum(bool(r["crash"]) for r in records),
        "hung_cases": sum(bool(r.get("hang")) for r in records),
        "timings": {
            "median_collect_s": statistics.median(t["collect"] for t in timings) if timings else None,
            "median_check_s": statistics.median(t["check"] for t in timings if "check" in t) if timings else None,
            "median_case_s": statistics.median(t["case"] for t in timings if "case" in t) if timings else None,
        },
        "wall_s": round(wall_s, 1),
    }
    write_csv(out / "bench.csv", rows)
    write_text(out / "summary.json", json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faultbench.peers.traincheck_peer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--faults", nargs="+", default=None, help="fault ids (default: every registered fault)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "peers" / "traincheck")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args(argv)
    start = time.monotonic()
    cases, faults = build_cases(args.seeds, args.faults)
    records = run_matrix(cases, args.jobs, use_cache=not args.no_cache,
                         progress=lambda line: print(line, file=sys.stderr, flush=True))
    summary = write_results(records, faults, args.out, args.seeds, time.monotonic() - start)
    print(json.dumps(summary["detectors"][TOOL], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
