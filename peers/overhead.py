"""A peer tool's cost, measured side by side: the same clean case with and without the tool, interleaved.

    python -m faultbench.peers.overhead TOOL [--recipes fp32 accum left_pad] [--repeats 3] [--out results/peers]

TOOL is a plugin detector (``torcheck``, ``smdebug``: its module ``peers.<tool>_peer`` is loaded) or
``traincheck``. A plugin peer runs in this process through ``harness.case.run_target_case``, the plain case
without any detector; TrainCheck runs the case script under ``traincheck-collect`` with the recipe's
invariants (as the matrix does), the plain case is the same script run directly. The figure is the
median training time per step with the tool over the median without it, per recipe; written to
``OUT/<tool>/overhead.json`` (``peers.report`` prints it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from faultbench.harness.atomic import write_text

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = {"torcheck": "faultbench.peers.torcheck_peer", "smdebug": "faultbench.peers.smdebug_peer"}


def _plugin_pair(tool: str, recipe: str):
    """(plain, with the tool): each a function returning one clean case's seconds per training step."""
    from faultbench.faults.registry import load_plugin
    from faultbench.harness.case import run_target_case
    from faultbench.harness.record import Case

    load_plugin(PLUGINS[tool])

    def timed(detectors: tuple[str, ...]):
        def run() -> float:
            record = run_target_case(Case(recipe, 0, (), detectors, (PLUGINS[tool],)))
            if record["crash"] or record["findings"]:
                raise RuntimeError(f"the clean {recipe} case is not clean: {record['crash'] or record['findings']}")
            return record["train_s"] / len(record["history"])
        return run

    return timed(()), timed((tool,))


def _traincheck_pair(recipe: str):
    from faultbench.peers.traincheck_peer import CASE_SCRIPT, _env, collect, golden_invariants, invariants_digest
    from faultbench.targets.ref.recipes import RECIPES

    invariants = golden_invariants(recipe, invariants_digest())
    case = {"recipe": recipe, "seed": 0, "faults": []}

    def plain() -> float:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "record.json"
            subprocess.run([sys.executable, str(CASE_SCRIPT)], check=True, cwd=tmp, capture_output=True,
                           env=_env(TRAINCHECK_CASE=json.dumps(case), TRAINCHECK_CASE_RECORD=str(path)))
            record = json.loads(path.read_text())
        return record["train_s"] / len(record["history"])

    def traced() -> float:
        with tempfile.TemporaryDirectory() as tmp:
            record, _ = collect(case, Path(tmp), invariants, RECIPES[recipe].steps)
        return record["train_s"] / len(record["history"])

    return plain, traced


def measure(tool: str, recipe: str, repeats: int) -> dict:
    plain, with_tool = _traincheck_pair(recipe) if tool == "traincheck" else _plugin_pair(tool, recipe)
    times: dict[str, list[float]] = {"plain": [], "tool": []}
    for _ in range(repeats):  # interleaved, so a change of machine load hits both alike
        times["plain"].append(plain())
        times["tool"].append(with_tool())
    base, cost = statistics.median(times["plain"]), statistics.median(times["tool"])
    return {"recipe": recipe, "repeats": repeats, "ms_per_step_plain": 1e3 * base, "ms_per_step_tool": 1e3 * cost,
            "ratio": cost / base}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tool", choices=[*PLUGINS, "traincheck"])
    parser.add_argument("--recipes", nargs="+", default=["fp32", "accum", "left_pad"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "results" / "peers"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(args.tool, recipe, args.repeats) for recipe in args.recipes]
    result = {"tool": args.tool, "recipes": rows, "median_ratio": statistics.median(r["ratio"] for r in rows)}
    write_text(Path(args.out) / args.tool / "overhead.json", json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"{args.tool} {r['recipe']:<9} plain {r['ms_per_step_plain']:7.1f} ms/step  with the tool "
              f"{r['ms_per_step_tool']:8.1f} ms/step  ratio {r['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
