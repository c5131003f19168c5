"""What each bench case costs, measured, and the cut of a matrix into shards of equal cost.

The cost table (``costs.json`` beside a bench's results: case name -> seconds) is written by every bench and
merge from its records, on top of the table already there, so a quick or filtered run adds to it and never empties
it. A shard reads the committed ``results/costs.json`` (or ``--costs FILE``): every host of a sharded bench cuts
the matrix from the same checkout, hence the same way. A case the table lacks costs the mean of its recipe's
measured cases, or else an estimate from its recipe alone (steps x ranks), so the cut is deterministic with any
table and with none.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from pathlib import Path

from faultbench import targets
from faultbench.harness.atomic import read_cached_json, write_text
from faultbench.harness.record import Case

COSTS = Path("results") / "costs.json"  # the committed table shards cut by (relative: a bench's default --out)
SECONDS_PER_STEP = 0.05  # the estimate's rate, about a tiny preset's step on one CPU core


def _not_a_table(value) -> str | None:
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and v >= 0 for v in value.values()):
        return "not an object of case names to seconds"
    return None


def read_costs(path) -> dict[str, float]:
    """The cost table at ``path``: {} where there is none; a bad one is reported, deleted and read as none."""
    return read_cached_json(path, "cost table", _not_a_table) or {}


def measured(record: dict, timeout_s: float) -> float:
    """What a case's run took: a hang its timeout, else its run's wall time (its training time where that is
    all it recorded)."""
    return timeout_s if record.get("hang") else max(record.get("wall_s") or 0.0, record["train_s"])


def write_costs(path, records: list[dict], timeout_s: float) -> None:
    """``path``'s table updated with the cost of each record's case (rounded to 10 ms, sorted by name)."""
    table = {**read_costs(path), **{r["name"]: round(measured(r, timeout_s), 2) for r in records}}
    write_text(path, json.dumps(dict(sorted(table.items())), indent=0) + "\n")


def estimate(case: Case, table: dict[str, float]) -> float:
    """The case's measured cost, else the mean of its recipe's measured cases, else steps x ranks x a rate."""
    if case.name in table:
        return table[case.name]
    same = [v for k, v in table.items() if _target_recipe(k) == (case.target, case.recipe)]
    if same:
        return sum(same) / len(same)
    recipe = targets.get(case.target).recipes()[case.recipe]
    return recipe.steps * recipe.world_size * SECONDS_PER_STEP


def _target_recipe(name: str) -> tuple[str, str]:
    """The target and recipe of a case's name (``[target:]faults/recipe/sSEED``, see ``Case.name``)."""
    head, recipe, _ = name.rsplit("/", 2) if name.count("/") >= 2 else ("", "", "")
    return (head.partition(":")[0] if ":" in head else "ref"), recipe


def partition(cases: list[Case], shards: int, table: dict[str, float]) -> list[int]:
    """Each case's shard (0-based): the costliest case first onto the least loaded shard (ties: the case
    listed first, the lower shard), a deterministic function of the cases and the table."""
    costs = [estimate(c, table) for c in cases]
    loads = [(0.0, s) for s in range(shards)]
    owner = [0] * len(cases)
    for i in sorted(range(len(cases)), key=lambda i: (-costs[i], i)):
        load, s = heapq.heappop(loads)
        owner[i] = s
        heapq.heappush(loads, (load + costs[i], s))
    return owner


def cut_digest(owner: list[int]) -> str:
    """A short digest of a cut: shards that disagree on it were cut by different cost tables."""
    return hashlib.sha256(json.dumps(owner).encode()).hexdigest()[:16]
