"""A scripted baseline agent for practice tasks (``harness.agent_tasks``): it looks, it repairs nothing.

Run in a task's folder (``practice run-agent OUT --command "{python} -m faultbench.baseline_agent"``):
it trains the folder's model once as the colleague's run is configured (``healthy_run.json``'s arguments; one
process), under ``faultbench.watch`` with the black-box detectors and no golden, and writes ``ANSWER.json`` from
the top finding: its subsystem, and its place in code when that is a function of the folder's model. No finding:
it answers the subsystem that holds the most faults of a training stack (``model``), as a guess would. It reads
neither the faults nor the answer keys (the sandbox hides them) and edits no code.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

FALLBACK = "model"


def diagnose(folder: Path) -> dict:
    """The top black-box finding of one training run of ``folder``'s model, as an answer."""
    import faultbench

    sys.path.insert(0, str(folder))
    exercise = runpy.run_path(str(folder / "train.py"), run_name="exercise")
    args = exercise["parse_args"](json.loads((folder / "healthy_run.json").read_text())["args"])
    args.world_size, args.resume_at, args.zero = 1, 0, False  # one process, one uninterrupted run
    run = exercise["build_run"](exercise["config"](args), 0)
    try:
        with faultbench.watch(run.model, run.optimizer, scheduler=run.scheduler, scaler=run.scaler,
                              report=False) as watched:
            exercise["train"](run)
    except Exception:  # noqa: BLE001 - a crash is evidence too: the watch located it
        pass
    if not watched.findings:
        return {"subsystem": FALLBACK, "note": "no finding"}
    top = watched.findings[0]
    code = (top.evidence or {}).get("code") or {}
    qualname = code.get("qualname", "") if isinstance(code, dict) else ""
    answer = {"subsystem": top.subsystem, "note": top.message[:300]}
    if qualname.startswith("model.") and not code.get("library"):
        answer["function"] = qualname.split(".<locals>")[0]
    return answer


def main() -> int:
    folder = Path.cwd()
    try:
        answer = diagnose(folder)
    except Exception as exc:  # noqa: BLE001 - the folder's job cannot even be set up: still an answer, a guess
        answer = {"subsystem": FALLBACK, "note": f"the run could not be watched: {type(exc).__name__}: {exc}"[:300]}
    (folder / "ANSWER.json").write_text(json.dumps(answer, indent=1) + "\n")
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
