"""Start-up cost of a tiny 2-rank DDP case: a fresh spawn per case vs the persistent rank pool.

    python -m benchmarks.dist_startup [--cases 3] [--steps 20] [--json]

"Naive" starts two interpreters per case (spawn), imports torch, joins a new gloo group, runs the
case and tears everything down. "Pool" keeps one ``RankPool`` (forkserver workers that keep their
process group) and, after one warm-up case, runs the same cases in it. Per case we report the wall
time and its start-up part: wall minus the time rank 0 spent in the training loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from faultbench.harness.launch import RankPool
from faultbench.harness.training import train_on_rank
from faultbench.model.config import get_preset


def _case(pool: RankPool, cfg: dict) -> tuple[float, float]:
    start = time.perf_counter()
    summary = pool.run(train_on_rank, cfg, {})[0]
    wall = time.perf_counter() - start
    return wall, wall - summary["train_s"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cfg = get_preset("tiny").replace(train={"steps": args.steps, "warmup_steps": 0, "world_size": 2}).to_dict()

    naive = []
    for _ in range(args.cases):
        start = time.perf_counter()
        with RankPool(2, start_method="spawn") as pool:
            _case(pool, cfg)
        naive.append(time.perf_counter() - start)  # includes process start and teardown

    with RankPool(2) as pool:
        warmup_start = time.perf_counter()
        _case(pool, cfg)
        warmup = time.perf_counter() - warmup_start
        pooled = [_case(pool, cfg) for _ in range(args.cases)]

    result = {
        "steps_per_case": args.steps,
        "naive_case_s": statistics.median(naive),
        "pool_first_case_s": warmup,
        "pool_case_s": statistics.median(w for w, _ in pooled),
        "pool_startup_s": statistics.median(s for _, s in pooled),
    }
    result["speedup"] = result["naive_case_s"] / result["pool_case_s"]
    print(f"tiny 2-rank case, {args.steps} steps, median of {args.cases}:")
    print(f"  naive spawn + init per case   {result['naive_case_s']:6.2f} s")
    print(f"  pool, first case (cold start) {result['pool_first_case_s']:6.2f} s")
    print(f"  pool, after warm-up           {result['pool_case_s']:6.2f} s  "
          f"(of which start-up {result['pool_startup_s']:.2f} s; target <= 3 s)")
    print(f"  speed-up                      {result['speedup']:6.1f}x")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
