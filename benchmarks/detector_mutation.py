"""Mutation test over detectors: does each detector have a positive test?

    .venv/bin/python -m benchmarks.detector_mutation [--only ID ...] [--force] [--timeout S] [--out PATH]

For every registered detector (read from the registry, both tracks): run the tests likely to exercise it with
that detector made a no-op (``FAULTBENCH_STUB_DETECTOR=<id>``, tests/detector_stub/: it records no finding, in
every process of the run). A detector is *red* when some test fails (it has a positive test) and *green* when a
no-op version passes everything: a survivor, missing a positive test.

The tests: every tests/**/test_*.py that mentions the id, the detector's class name or its module, plus
tests/<folder>/test_<module>.py; the files naming the id run first. A white-box detector that survives them runs
again with tests/detectors/test_suite.py (every registry fault through the whole suite: minutes), the table says
which stage killed it ("own" / "wide"). One pytest at a time, single process, ``-x`` (a red needs one failure, a
green runs them all). A red is confirmed by rerunning its failing test alone: it must fail with the stub and pass
with the stub machinery on and nothing stubbed (``FAULTBENCH_STUB_DETECTOR=-``); a failure that is not confirmed
(pre-existing, flaky, or order-dependent) is deselected and the stubbed run repeated.

Results are cached per detector in .cache/detector_mutation/<id>.json, keyed by its test files, its module's source
and the stub module (``--force`` reruns); results/detector_mutation.md is rewritten atomically after each detector.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
CACHE = ROOT / ".cache" / "detector_mutation"
STUB_ENV = "FAULTBENCH_STUB_DETECTOR"
STUB = TESTS / "detector_stub" / "faultbench_detector_stub.py"
NOTHING = "-"  # the stub machinery on, no detector stubbed (the control)
MAX_RETRIES = 3  # stubbed reruns after deselecting unconfirmed failures
# registry-wide tests of a track (every fault of the registry through the whole suite, baselines left out): run only
# for a suite detector that survives its own tests, since they take minutes
WIDE = {"white-box": ("tests/detectors/test_suite.py",)}


def test_files() -> dict[Path, str]:
    skip = TESTS / "detector_stub"
    return {p: p.read_text() for p in sorted(TESTS.rglob("test_*.py")) if skip not in p.parents}


def _word(name: str) -> re.Pattern:
    return re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w)" if "." not in name else rf"{re.escape(name)}(?!\w)")


def select(det_id: str, cls: type, files: dict[Path, str]) -> list[Path]:
    """The test files for ``cls``: those naming its id first, then those naming its class or module."""
    module = cls.__module__.removeprefix("faultbench.")  # detectors.blackbox.monitors
    tail = module.rsplit(".", 1)[-1]
    by_id = [p for p, text in files.items() if _word(det_id).search(text)]
    others = [p for p, text in files.items() if p not in by_id and (
        _word(cls.__name__).search(text) or _word(module).search(text) or p.name == f"test_{tail}.py"
        or re.search(rf"from faultbench\.{re.escape(module.rsplit('.', 1)[0])} import [^\n]*\b{tail}\b", text))]
    return by_id + others


def cache_key(det_id: str, cls: type, paths: list[Path]) -> str:
    h = hashlib.sha256(det_id.encode())
    wide = [ROOT / w for w in WIDE.get(cls.track, ()) if (ROOT / w).exists() and not cls.baseline]
    for p in [Path(inspect.getfile(cls)), STUB, *paths, *wide]:
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def pytest(paths: list, stub: str, deselect=(), timeout_s: float = 900) -> tuple[str, list[str], str, float]:
    """(status "pass" | "fail" | "timeout" | "error", failing node ids, summary line, seconds)."""
    cmd = [sys.executable, "-m", "pytest", *map(str, paths), "-x", "-q", "-p", "no:cacheprovider", "-n", "0",
           "--tb=no", "-rfE", *[f"--deselect={d}" for d in deselect]]
    env = {**os.environ, STUB_ENV: stub}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout", [], f"timed out after {timeout_s:.0f}s", time.perf_counter() - start
    seconds = time.perf_counter() - start
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.MULTILINE)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    summary = lines[-1].strip("= ") if lines else proc.stderr.strip().splitlines()[-1:]
    status = {0: "pass", 1: "fail"}.get(proc.returncode, "error")
    if status == "fail" and not failed:
        status = "error"
    if status == "error":
        summary = f"pytest exit {proc.returncode}: {summary} {proc.stderr.strip()[-300:]}"
    return status, failed, str(summary), seconds


def mutate(det_id: str, paths: list[Path], timeout_s: float) -> dict:
    """One detector stubbed, on ``paths``: red, green, or unknown (timeout, pytest error, too many unconfirmed)."""
    rel = [str(p.relative_to(ROOT)) if isinstance(p, Path) else p for p in paths]
    out = {"files": rel, "failed": None, "seconds": 0.0, "deselected": []}
    if not paths:
        return {**out, "result": "green", "summary": "no test file names it"}
    for _ in range(MAX_RETRIES + 1):
        status, failed, summary, spent = pytest(rel, det_id, out["deselected"], timeout_s)
        out["seconds"] = round(out["seconds"] + spent, 1)
        if status != "fail":
            return {**out, "result": {"pass": "green"}.get(status, "unknown"), "summary": summary}
        node = failed[0]
        # confirmed: it fails alone with the stub, and then passes alone with the machinery on and nothing stubbed
        # (else it fails anyway, or only after the tests before it: deselected, and the run repeated). Never reused
        # across detectors: the tree may change while the script runs
        if (pytest([node], det_id, timeout_s=timeout_s)[0] == "fail"
                and pytest([node], NOTHING, timeout_s=timeout_s)[0] == "pass"):
            return {**out, "result": "red", "failed": node, "summary": summary}
        out["deselected"].append(node)
    return {**out, "result": "unknown", "summary": f"{len(out['deselected'])} failures not confirmed"}


def mutate_staged(det_id: str, cls: type, paths: list[Path], timeout_s: float) -> dict:
    """``mutate`` on the detector's own tests, then, if it survives them, on its track's registry-wide tests."""
    result = {**mutate(det_id, paths, timeout_s), "stage": "own"}
    wide = [w for w in WIDE.get(cls.track, ()) if (ROOT / w).exists() and ROOT / w not in paths and not cls.baseline]
    if result["result"] == "green" and wide:
        second = mutate(det_id, wide, timeout_s)
        second["seconds"] = round(second["seconds"] + result["seconds"], 1)
        second["files"] = result["files"] + second["files"]
        result = {**second, "stage": "wide"}
    return result


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(text)
    os.chmod(f.name, 0o644)
    os.replace(f.name, path)


def report(rows: dict[str, dict], registry: dict) -> str:
    done = {d: r for d, r in rows.items() if r is not None}
    survivors = [d for d, r in done.items() if r["result"] == "green"]
    unknown = [d for d, r in done.items() if r["result"] == "unknown"]
    lines = [
        "# Mutation test over detectors",
        "",
        "`.venv/bin/python -m benchmarks.detector_mutation`: each registered detector made a no-op "
        "(`FAULTBENCH_STUB_DETECTOR=<id>`, tests/detector_stub/) and the tests that name it (id, class or module) "
        "run with `-x`. **red**: a test failed, so the detector has a positive test; **green**: a no-op detector "
        "passes them all (a survivor). *(stale)*: its tests or its module changed since that result (`--only` "
        "kept it); a plain run redoes it.",
        "",
        f"**{sum(r['result'] == 'red' for r in done.values())}/{len(done)} detectors red**"
        + (f" ({len(rows) - len(done)} not run yet)" if len(done) < len(rows) else "") + ".",
        "",
        "| detector | track | result | test files | first failing test (own: its tests; wide: test_suite.py) | "
        "seconds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for det_id, r in rows.items():
        if r is None:
            lines.append(f"| `{det_id}` | {registry[det_id].track} | not run | | | |")
            continue
        failed = (f"{r['stage']}: `{r['failed'].split('/')[-1]}`" if r["failed"]
                  else r["summary"].replace("|", "/")[:80])
        result = r["result"] + (" (stale)" if r.get("stale") else "")
        lines.append(f"| `{det_id}` | {registry[det_id].track} | {result} | {len(r['files'])} | {failed} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", f"## Survivors ({len(survivors)})", ""]
    lines += [f"- `{d}` ({registry[d].__module__.removeprefix('faultbench.')}.{registry[d].__name__})"
              for d in survivors] or ["none"]
    if unknown:
        lines += ["", f"## Unknown ({len(unknown)}: timeout, pytest error or pre-existing failures)", ""]
        lines += [f"- `{d}`: {done[d]['summary']}" for d in unknown]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="ID", help="only these detectors (the table keeps the others' "
                        "cached results)")
    parser.add_argument("--force", action="store_true", help="ignore the cache")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default 900)")
    parser.add_argument("--out", default=str(ROOT / "results" / "detector_mutation.md"))
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from faultbench.detectors.api import all_detectors

    registry = dict(sorted(all_detectors().items(), key=lambda kv: (kv[1].track, kv[0])))
    unknown_ids = [d for d in args.only or () if d not in registry]
    if unknown_ids:
        print(f"unknown detector id(s): {', '.join(unknown_ids)}", file=sys.stderr)
        return 2
    files = test_files()
    rows: dict[str, dict | None] = {}
    plan = []
    for det_id, cls in registry.items():
        paths = select(det_id, cls, files)
        key = cache_key(det_id, cls, paths)
        cached_path = CACHE / f"{det_id}.json"
        cached = json.loads(cached_path.read_text()) if cached_path.exists() else None
        fresh = cached is not None and cached.get("key") == key
        kept = fresh or (args.only and det_id not in args.only and cached)  # --only: the others as last run
        rows[det_id] = {**cached, "stale": not fresh} if kept else None
        if (not args.only or det_id in args.only) and (args.force or not fresh):
            plan.append((det_id, paths, key))
    out = Path(args.out)
    start = time.perf_counter()
    print(f"{len(registry)} detectors, {len(plan)} to run", flush=True)
    for det_id, paths, key in plan:
        result = {"key": key, **mutate_staged(det_id, registry[det_id], paths, args.timeout)}
        write_atomic(CACHE / f"{det_id}.json", json.dumps(result, indent=1) + "\n")
        rows[det_id] = result
        write_atomic(out, report(rows, registry))
        print(f"{result['result']:<7} {det_id:<28} {len(paths):2d} files {result['seconds']:6.1f}s  "
              f"{result['failed'] or result['summary']}", flush=True)
    write_atomic(out, report(rows, registry))
    survivors = [d for d, r in rows.items() if r and r["result"] == "green"]
    print(f"done in {time.perf_counter() - start:.0f}s; survivors: {', '.join(survivors) or 'none'}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
