"""Running one bench case on its target: here, or on every rank of a ``RankPool``.

``run_target_case`` loads the case's plugins, injects its faults and hands the recipe to the target's
``run_case`` (``faultbench.targets``); ``execute`` does it here for a one-process recipe, or on every rank of a
pool for a data-parallel one, and merges the ranks' findings. A rank failure (raise, death, hang) is a crash
record. The warnings a run raises go into its record (``"warnings"``, each once), never onto the bench's
terminal; the filters in force decide which (a blind bench ignores them all). ``behaviour`` is what a run did,
the bench's evidence that a fault showed.
"""

from __future__ import annotations

import json
import random
import tempfile
import warnings

import torch

from faultbench import targets
from faultbench.detectors.api import rank_key
from faultbench.harness.record import Case, case_from_dict, failed_record


def behaviour(record: dict) -> str:
    """What a case's run did, timing left out, as one string: the step history, crash (type, step), val loss,
    decoded tokens and logits, final parameters, positions computed and graphs kept. A fault manifested in a
    case iff this differs from the clean case of the same recipe, seed and detectors."""
    crash = record["crash"] or {}
    history = [{k: v for k, v in h.items() if k not in ("seconds", "tokens_per_s")} for h in record["history"]]
    return json.dumps({"history": history, "crash": [crash.get("type"), crash.get("step")],
                       "val_loss": record["val_loss"], "outputs": record.get("outputs", {})}, sort_keys=True)


def run_target_case(case: Case, golden: dict | None = None, rank: int = 0, workdir: str | None = None,
                    capture_dir: str | None = None) -> dict:
    """``case`` on its target, in this process (or on this rank): plugins loaded, faults injected around the
    target's ``run_case``; never raises (a crash is recorded). ``capture_dir`` (a repro bundle's steps) is
    passed on only to a target that captures (``Target.captures``)."""
    from faultbench.faults.inject import injected
    from faultbench.faults.registry import load_plugin

    for plugin in case.plugins:
        load_plugin(plugin)
    stack = targets.get(case.target)
    options = {"capture_dir": capture_dir} if capture_dir is not None and stack.captures else {}
    random.seed(case.seed)
    with injected(*case.faults), warnings.catch_warnings(record=True) as caught:  # the record's, not the terminal's
        record = stack.run_case(case.recipe, case.seed, case.detectors, golden, rank, workdir, **options)
    record["case"] = case.to_dict()
    record["warnings"] = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
    return record


def run_case_on_rank(rank: int, case_dict: dict, golden: dict | None, workdir: str,
                     capture_dir: str | None = None) -> dict:
    """RankPool entry: the case on this rank (the process group is initialized), on its target."""
    torch.set_num_threads(1)
    return run_target_case(case_from_dict(case_dict), golden, rank, workdir, capture_dir)


def execute(case: Case, golden: dict | None = None, pool=None, timeout_s: float = 120.0,
            capture_dir: str | None = None) -> dict:
    """Run a case on its target where its recipe needs it: here, or on every rank of ``pool`` (findings of
    all ranks merged, the record of rank 0 otherwise). A rank failure (raise, death, hang) is a crash record."""
    if case.world_size == 1:
        return run_target_case(case, golden, capture_dir=capture_dir)
    from faultbench.harness.launch import RankFailure

    try:
        with tempfile.TemporaryDirectory(prefix="faultbench-case-") as workdir:
            ranks = pool.run(run_case_on_rank, case.to_dict(), golden, workdir, capture_dir, timeout_s=timeout_s,
                             retire=bool(case.faults or case.plugins))
    except RankFailure as exc:
        return failed_record(case, "RankFailure", str(exc))
    out = ranks[0]
    seen = {(f["detector"], f["subsystem"], f["seam"]) for f in out["findings"]}
    for other in ranks[1:]:
        for f in other["findings"]:
            if (f["detector"], f["subsystem"], f["seam"]) not in seen:
                seen.add((f["detector"], f["subsystem"], f["seam"]))
                out["findings"].append({**f, "evidence": {**f["evidence"], "rank": other["rank"]}})
        out["crash"] = out["crash"] or other["crash"]
        out["warnings"] = list(dict.fromkeys(out["warnings"] + other["warnings"]))
        for d, err in other["detector_errors"].items():
            out["detector_errors"].setdefault(d, f"rank {other['rank']}: {err}")
    out["findings"].sort(key=rank_key)
    return out
