"""Mutation score: run each target's clean-guarantee tests once per fault of it, injected; which do they kill?

    python -m faultbench.harness.mutation [--tests "tests/model tests/distributed"] [--out results/mutation.md]
                                      [--fault ID ...]

A fault is run against the tests of its own target (``Target.clean_guarantees``: the reference's
tests/model and tests/distributed modules, the HF target's tests/hf modules); ``--tests`` overrides that
for every fault.

The suite stops at its first failure (-x): a killed fault needs one failing test, a survivor runs all.

A fault is killed when the suite fails with it injected (and passes clean). Survivors are the gaps a
careful engineer would close with a regression test.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from faultbench import targets
from faultbench.faults.registry import all_faults
from faultbench.harness.atomic import write_text


def guarantee_tests(target: str) -> str:
    """The test folders holding ``target``'s clean-guarantee modules, space-separated (``tests.hf.test_ddp`` ->
    ``tests/hf``): every test of those folders runs."""
    folders = (m.rsplit(".", 1)[0].replace(".", "/") for m in targets.get(target).clean_guarantees)
    return " ".join(dict.fromkeys(folders))


def run_suite(tests: str, fault_id: str | None, timeout_s: float = 900) -> tuple[str, list[str], float]:
    """("killed" | "survived" | "timeout", failing test ids, seconds)."""
    cmd = [sys.executable, "-m", "pytest", *tests.split(), "-q", "-x", "-n", "2", "--dist", "loadgroup",
           "-p", "no:cacheprovider", "--tb=no"]
    if fault_id:
        cmd += ["--inject-fault", fault_id]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout", [], time.perf_counter() - start
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.MULTILINE)
    status = "survived" if proc.returncode == 0 else "killed"
    return status, failed, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", help="space-separated test paths (default: each fault's target's "
                                       "clean-guarantee tests)")
    parser.add_argument("--out", default="results/mutation.md")
    parser.add_argument("--fault", action="append", help="only these faults (default: all)")
    args = parser.parse_args(argv)

    faults = all_faults(None)
    ids = args.fault or sorted(faults)
    unknown = [f for f in ids if f not in faults]
    if unknown:
        print(f"unknown fault id(s) {', '.join(unknown)} (`faultbench faults --target all` lists them)",
              file=sys.stderr)
        return 2
    tests = {f: args.tests or guarantee_tests(faults[f].target) for f in ids}
    for suite in dict.fromkeys(tests.values()):
        baseline, failed, _ = run_suite(suite, None)
        if baseline != "survived":
            print(f"the clean suite {suite} fails ({failed[:5]}); fix it before scoring mutations", file=sys.stderr)
            return 1
    rows = []
    for fault_id in ids:
        status, failed, seconds = run_suite(tests[fault_id], fault_id)
        rows.append((fault_id, status, failed, seconds))
        print(f"{status:<9} {fault_id:<40} {len(failed):3d} failing  {seconds:5.1f}s", flush=True)
    killed = sum(status != "survived" for _, status, _, _ in rows)
    lines = [
        "# Mutation score of the unit tests",
        "",
        "`python -m faultbench.harness.mutation` (`make mutation`): each fault's target's clean-guarantee tests "
        f"({'`' + args.tests + '`' if args.tests else 'ref: tests/model, tests/distributed; hf: tests/hf'}) run "
        "once per fault, injected with `pytest --inject-fault ID`. A fault is *killed* when the suite fails (a "
        "timeout counts as killed).",
        "",
        f"**{killed}/{len(rows)} faults killed ({100 * killed / max(len(rows), 1):.1f}%).**",
        "",
        "| fault | target | subsystem | trigger | result | failing tests (-x) | first failing test |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for fault_id, status, failed, _ in rows:
        spec = faults[fault_id]
        example = failed[0].split("::")[-1] if failed else ""
        lines.append(f"| `{fault_id}` | {spec.target} | {spec.subsystem} | {spec.trigger} | {status} | "
                     f"{len(failed)} | {example} |")
    survivors = [r[0] for r in rows if r[1] == "survived"]
    lines += ["", "Survivors: " + (", ".join(f"`{s}`" for s in survivors) if survivors else "none."), ""]
    write_text(args.out, "\n".join(lines))
    print(f"{killed}/{len(rows)} killed; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
