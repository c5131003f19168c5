"""Many machines: a bench cut into N shards of equal measured cost, run apart, merged into one bench's results.

``bench --shard K/N`` builds the whole matrix, cuts it (``harness.costs.partition``), runs the K-th part (cached
cases reused, as ever) and writes ``shard.json``: the digest of its configuration (the matrix, the faults, the
seeds, the options, the code) and of its cut, the matrix itself, the faults' metadata and its cases' records.
``merge`` refuses in one line (ValueError) shards of different configurations or cuts, a shard or a case given
twice, a case no shard holds, a failure of the machinery; then it scores the records as one bench does (the
matrix's order, the same manifested marks) and writes the same results files, atomically, only once all is there.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from faultbench.harness.atomic import write_text
from faultbench.harness.bench import (
    BenchConfig,
    nonempty_matrix,
    record_problem,
    refuse_machinery_failures,
    run_cases,
    score_records,
)
from faultbench.harness.costs import cut_digest, partition, read_costs
from faultbench.harness.digest import code_digest
from faultbench.harness.record import case_from_dict

SHARD_FILE = "shard.json"
FORMAT = 1
# what a shard file holds, and of which type
FIELDS = {"format": int, "config": str, "cut": str, "shard": list, "seeds": list, "options": dict, "cases": list,
          "faults": dict, "records": list, "wall_s": (int, float), "cached_cases": int}


def run_shard(cfg: BenchConfig, shard: tuple[int, int], costs, options: dict) -> dict:
    """Run the ``shard`` = (K, N)-th part of ``cfg``'s matrix, cut by the cost table at ``costs``, and write its
    shard file into ``cfg.out``; ``options`` (how the results are reported: blind, mutants, ...) go with it."""
    start = time.monotonic()
    k, n = shard
    cases, faults = nonempty_matrix(cfg)
    owner = partition(cases, n, read_costs(costs))
    mine = [c for c, s in zip(cases, owner, strict=True) if s == k - 1]
    records, cached = run_cases(cfg, mine)
    matrix = [c.to_dict() for c in cases]
    config = {"cases": matrix, "faults": faults, "seeds": list(cfg.seeds), "options": options,
              "code": code_digest(cfg.plugins)}
    doc = {"format": FORMAT, "config": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16],
           "cut": cut_digest(owner), "shard": [k, n], "seeds": list(cfg.seeds), "options": options, "cases": matrix,
           "faults": faults, "records": [records[c] for c in mine], "wall_s": round(time.monotonic() - start, 1),
           "cached_cases": cached}
    write_text(Path(cfg.out) / SHARD_FILE, json.dumps(doc))
    return doc


def read_shard(path) -> dict:
    """The shard file in folder ``path`` (or at ``path``); anything else is refused in one line (ValueError)."""
    path = Path(path)
    file = path / SHARD_FILE if path.is_dir() else path
    try:
        doc = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no {SHARD_FILE} (not the --out of a bench --shard K/N)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not a shard file ({type(e).__name__}: {e})") from None
    wrong = [k for k, kind in FIELDS.items() if not isinstance(doc, dict) or not isinstance(doc.get(k), kind)]
    if wrong or doc["format"] != FORMAT:
        raise ValueError(f"{file}: not a shard file of this faultbench (format {FORMAT}; missing or mistyped "
                         f"{', '.join(wrong) or 'format'})")
    return doc


def merge(paths: list[str], out: Path, plugins: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Score the shards at ``paths`` as one bench and write its results into ``out``: the summary and the
    shards' options. The shards' plugins load only when ``plugins`` names them (a shard never loads code)."""
    from faultbench.faults.registry import load_plugin

    shards = [(p, read_shard(p)) for p in paths]
    first_path, first = shards[0]
    n = first["shard"][1]
    given: dict[int, str] = {}
    for path, doc in shards:
        if doc["shard"][1] != n or doc["config"] != first["config"]:
            raise ValueError(f"{path} (shard {'/'.join(map(str, doc['shard']))}) and {first_path} (shard "
                             f"{'/'.join(map(str, first['shard']))}) are shards of different configurations: their "
                             "cases, faults, seeds, options, code or N differ")
        if doc["cut"] != first["cut"]:
            raise ValueError(f"{path} and {first_path} were cut by different cost tables: run every shard from the "
                             "same checkout (results/costs.json) or give each the same --costs")
        k = doc["shard"][0]
        if k in given:
            raise ValueError(f"shard {k}/{n} given twice ({given[k]} and {path})")
        given[k] = path
    cases = _cases(first_path, first["cases"])
    needed = sorted({p for c in cases for p in c.plugins})
    if sorted(set(needed) - set(plugins)):
        raise ValueError(f"the shards' cases load {', '.join(needed)}: name each with --plugin to merge them (a "
                         "shard never loads code by itself)")
    for plugin in needed:
        load_plugin(plugin)
    wanted = set(cases)
    records: dict = {}
    for path, doc in shards:
        held = _cases(path, [r.get("case") if isinstance(r, dict) else None for r in doc["records"]])
        for record, case in zip(doc["records"], held, strict=True):
            problem = record_problem(record, case) if case in wanted else "a case outside the configuration"
            if problem or case in records:
                raise ValueError(f"{path}: the record of {record.get('name')} cannot be merged ("
                                 f"{problem or 'another shard holds it too'})")
            records[case] = record
    missing = [c for c in cases if c not in records]
    if missing:
        absent = sorted(set(range(1, n + 1)) - set(given))
        raise ValueError(f"{len(missing)} of {len(cases)} cases have no record (the first: {missing[0].name}): "
                         f"shard{'s' * (len(absent) != 1)} {', '.join(f'{k}/{n}' for k in absent)} missing")
    refuse_machinery_failures(records)
    cfg = BenchConfig(seeds=tuple(first["seeds"]), out=out, progress=False)
    summary = score_records(records, cases, first["faults"], cfg, wall_s=max(d["wall_s"] for _, d in shards),
                            cached=sum(d["cached_cases"] for _, d in shards))
    return summary, first["options"]


def _cases(path, dicts: list) -> list:
    """The cases of a shard's case dicts (its matrix, its records'), or one line (ValueError) naming the file."""
    try:
        return [case_from_dict(d) for d in dicts]
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"{path}: a case that is not a case: not a shard file of this faultbench") from None
