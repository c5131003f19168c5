"""Which faults practice offers: those whose run shows the candidate a symptom, and that the reference repair clears.

An exercise is fair only if the colleague's run (what the README shows, what ``python check.py`` judges) differs
from the healthy one, and the repair passes. ``validate`` builds each reference fault's folder, runs its train.py
as the colleague did, judges it as the folder's check.py does (it must differ), splices the clean functions back
and runs it again (it must behave), and says what the run shows (a crash, a non-finite loss, other numbers) next to
the symptom the fault is labelled with. ``faultbench practice validate`` (``make practice-validate``) writes the
table to results/practice_offer.md; ``practice new`` offers only the faults it marks offered (every fault when the
file is absent).
"""

from __future__ import annotations

import math
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from faultbench.faults.registry import all_faults, get_fault
from faultbench.harness.exercise_check import parse_log, verdict


def repair(folder: Path, spec) -> None:
    """What a correct fix amounts to: each replaced function's clean definition back in the copy."""
    from faultbench.faults.inject import seam_function_source, splice_module

    for seam in spec.seams:
        _, module, qualname = seam.split(".", 2)
        path = folder / "model" / f"{module}.py"
        path.write_text(splice_module(path.read_text(), {qualname: seam_function_source(seam)}))


def shows(log: str, code: int) -> str:
    """What a run visibly does first, in the symptom classes' words: nan (a non-finite loss logged, even if a
    crash follows), crash, or differs (other numbers)."""
    run = parse_log(log)
    if any(not math.isfinite(x) for x in run["losses"]) or (run["validation"] is not None
                                                              and not math.isfinite(run["validation"])):
        return "nan"
    return "crash" if code != 0 else "differs"


def _label_matches(label: str, seen: str) -> bool:
    """A crash or NaN label must show as one; any other label as other numbers (a divergence may end in NaN)."""
    if label in ("crash", "nan"):
        return seen == label
    return seen == "differs" or (label == "divergence" and seen == "nan")


def validate_fault(fault_id: str) -> dict:
    """One fault's row: its label, what its run shows, whether it matches, whether the repair passes, offered."""
    from faultbench.harness.practice import _healthy, build_folder
    from faultbench.harness.practice_level import symptom_class
    from faultbench.harness.practice_runs import run_train, train_args

    spec = get_fault(fault_id)
    args = train_args(spec.manifest)
    healthy = parse_log(_healthy(args)[0])
    with tempfile.TemporaryDirectory(prefix="faultbench-offer-") as tmp:
        folder = build_folder(Path(tmp) / "ex", fault_id)
        log, code = run_train(folder / "train.py", folder, args, folder)
        broken, problems = verdict(log, None if code == -1 else code, healthy)
        repair(folder, spec)
        fixed, _ = verdict(*run_train(folder / "train.py", folder, args, folder), healthy)
    label = symptom_class(spec)
    seen = shows(log, code) if broken == 1 else "nothing" if broken == 0 else "cannot run"
    row = {"fault": fault_id, "symptom label": label, "the run shows": seen,
           "label matches": _label_matches(label, seen), "repair passes": fixed == 0}
    why = ("its run looks healthy: the README would show no symptom" if broken == 0
           else "the broken copy cannot even start" if broken == 2
           else "the reference repair does not pass check" if fixed != 0 else "")
    return {**row, "offered": not why, "why not": why or (problems[0] if problems else "")}


def _worker(fault_id: str) -> dict:
    import torch

    torch.set_num_threads(1)
    return validate_fault(fault_id)


def validate(fault_ids=None, jobs: int = 2) -> list[dict]:
    """``validate_fault`` over ``fault_ids`` (every reference fault), ``jobs`` at a time (ValueError, before any
    run, for an unknown id or another target's)."""
    fault_ids = sorted(fault_ids or all_faults("ref"))
    for fault_id in fault_ids:
        if get_fault(fault_id).target != "ref":
            raise ValueError(f"{fault_id!r} is a fault of the {get_fault(fault_id).target} target: practice offers "
                             "reference faults")
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_worker, fault_ids))
