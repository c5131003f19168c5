"""One bench case as a plain training script, the input ``traincheck-collect --pyscript`` expects.

It reads the case (``Case.to_dict()`` as JSON) from ``$TRAINCHECK_CASE`` and trains it exactly as
``targets.ref.case.run_case`` does without detectors (same recipe, seed, injected faults, save and resume
half-way, evaluation), then writes the case record (history, crash, val_loss, train_s) as JSON to
``$TRAINCHECK_CASE_RECORD``. The environment carries them because traincheck-collect runs the
script without arguments.

It is shaped for TrainCheck's source instrumentation (``traincheck.instrumentor.source_file``), which
rewrites this file before running it:
- ``import torch`` comes before the project's imports, so torch is instrumented before the reference
  binds any of its functions;
- the training loop is visible here (``train_one_step`` marks it as one, so each iteration calls
  ``start_step()`` and the trace's step meta variable counts optimizer steps from 1);
- ``.train()`` before the loop and ``.eval()`` before the evaluation get TrainCheck's automatic
  stage annotations (training, testing).
"""

import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from faultbench.faults.inject import injected
from faultbench.harness.record import Case, empty_record
from faultbench.model import checkpoint, evaluate, train
from faultbench.model import run as run_module
from faultbench.targets.ref.case import EVAL_DOCS, crash_record
from faultbench.targets.ref.recipes import RECIPES


def train_one_step(run) -> dict:
    """One optimizer step of the reference; its step record as plain numbers."""
    record = train.train_step(run, train.next_micro_batches(run))
    return {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in record.to_dict().items()}


def train_until(run, until: int, out: dict) -> None:
    """Train ``run`` to step ``until``, appending step records and training time to ``out``."""
    run.model.train()
    while run.step < until:
        start = time.perf_counter()
        out["history"].append(train_one_step(run))
        out["train_s"] += time.perf_counter() - start


def run_recipe(case: Case, workdir: Path) -> dict:
    """The case's training run (the crash, if any, is the outcome); its record."""
    recipe = RECIPES[case.recipe]
    cfg = recipe.config(case.seed)
    out = empty_record(case)
    start = time.perf_counter()
    run = None
    try:
        run = run_module.build_run(cfg)
        if recipe.resume_at is not None:
            train_until(run, recipe.resume_at, out)
            checkpoint.save_checkpoint(run, workdir / "ckpt")
            resumed = run_module.build_run(cfg)
            checkpoint.load_checkpoint(resumed, workdir / "ckpt")
            run = resumed
            out["resumed_at"] = run.step
        train_until(run, cfg.train.steps, out)
        run.model.eval()
        out["val_loss"] = evaluate.evaluate(run.model, run.corpus.val[:EVAL_DOCS], run.tokenizer.pad_id,
                                            cfg.train.eval_batch_size, cfg.train.precision, cfg.data.pad_side)
    except Exception as exc:  # the crash is the outcome, recorded like the bench records it
        out["crash"] = crash_record(exc, run.step if run is not None else None)
    out["wall_s"] = time.perf_counter() - start
    return out


def main() -> None:
    torch.set_num_threads(1)
    spec, record_path = json.loads(os.environ["TRAINCHECK_CASE"]), Path(os.environ["TRAINCHECK_CASE_RECORD"])
    case = Case(spec["recipe"], spec["seed"], tuple(spec["faults"]))
    random.seed(case.seed)
    with injected(*case.faults), tempfile.TemporaryDirectory(prefix="traincheck-case-") as tmp:
        record = run_recipe(case, Path(tmp))
    record_path.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
