"""Practice and interview mode: exercises with one hidden fault, and the interviewer's rubric.

- ``new``: a runnable broken copy of the model (the fault spliced into the source: no id, no fault
  machinery) with ``train.py`` and a README that says only what a colleague would report: the command,
  the log excerpt or the crash, the loss curve, and what a healthy run of the same config reached.
  The answer key lives outside the exercise folder (``.cache/practice/<token>.json`` of this checkout,
  or ``$FAULTBENCH_PRACTICE_KEYS``); the folder holds only the token.
- ``hint`` (staged: the symptom that matters, then the subsystem, then the seam), ``answer`` (grades a
  subsystem and optionally a seam), ``reveal`` (diff, explanation, fix, the real bug).
- ``rubric``: what a strong answer covers, in the order a strong answer takes: reproduce, isolate by
  subsystem, instrument, fix, prevent. It draws on the fault's metadata and manifest, and on the
  committed results: the detectors that localized it in the bench (results/bench.csv), its manifest
  evidence (results/faults.md) and the unit test that fails with it injected (results/mutation.md).
"""

from __future__ import annotations

import csv
import hashlib
import json
import multiprocessing
import os
import random
import re
import runpy
import secrets
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from faults.registry import all_faults, get_fault
from harness.atomic import write_text

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
DIFFICULTIES = ("easy", "medium", "hard")
TRAIN_TIMEOUT_S = 600.0  # a colleague's train.py run that takes longer hangs
# how hard a trigger is to reproduce, and a symptom to trace back to its cause
_TRIGGER_COST = {"always": 0, "amp-only": 1, "eval-only": 1, "after-step": 1, "rare-batch": 2, "on-resume": 2,
                 "multi-rank": 2}
_SYMPTOM_COST = {"crash-shape": 0, "crash-dtype": 0, "crash-index": 0, "crash-state": 0, "nan": 0, "divergence": 1,
                 "stall": 1, "eval-metric": 1, "hang": 1, "slowdown": 2, "memory-growth": 2, "silent-quality": 2,
                 "desync": 2}
SYMPTOM_HINTS = {
    "crash": "The traceback says where it failed, not where the bad value was made: follow the failing value back "
             "to the code that produced it.",
    "nan": "Find the first step and the first operation that produce a non-finite value; check what is special "
           "about that batch or that precision.",
    "stall": "The loss barely moves: check that gradients exist, reach the optimizer, and have a sensible size.",
    "divergence": "Compare the run step by step with a healthy one: the learning rate, the gradient norm and the "
                  "optimizer state tell where they part.",
    "quality": "Nothing crashes, so test invariants: the loss floor, padding and causality invariance, cached vs "
               "uncached decoding, a resumed run vs an uninterrupted one.",
}


def difficulty(spec) -> str:
    """easy / medium / hard from how the fault triggers and how its symptom relates to its cause
    (an intermittent crash is harder than a NaN at step 0, a silent quality loss harder still)."""
    cost = _TRIGGER_COST[spec.trigger] + min(_SYMPTOM_COST[s] for s in spec.symptoms)
    return "easy" if cost <= 1 else "medium" if cost == 2 else "hard"


def _table_row(path: Path, fault_id: str) -> list[str] | None:
    """The cells of the markdown table row of ``fault_id`` in a results file (None if absent)."""
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == fault_id:
            return cells
    return None


def _localizing_detectors(fault_id: str, results: Path) -> list[str]:
    """Detectors that named an acceptable subsystem first on this fault, on every seed of the bench."""
    path = results / "bench.csv"
    if not path.exists():
        return []
    hits: dict[str, list[bool]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if row["fault"] == fault_id and row["detector"] != "suite":
                hits.setdefault(row["detector"], []).append(float(row["rr_subsystem"] or 0) == 1.0)
    return sorted(d for d, ok in hits.items() if ok and all(ok))


def rubric(fault_id: str, results: Path = RESULTS) -> str:
    spec = get_fault(fault_id)
    m = spec.manifest
    variant = json.dumps(m.variant) if m.variant else "the default tiny preset"
    acceptable = ", ".join((spec.subsystem, *spec.also_acceptable))
    evidence = _table_row(results / "faults.md", fault_id)
    mutation = _table_row(results / "mutation.md", fault_id)
    detectors = _localizing_detectors(fault_id, results)
    lines = [
        f"# Rubric: {spec.title}",
        "",
        f"(fault `{spec.id}`; trigger {spec.trigger}; symptoms {', '.join(spec.symptoms)})",
        "",
        "## 1. Reproduce",
        f"- A strong candidate makes it happen on demand: the `{m.scenario}` scenario, {m.steps} steps, with "
        f"{variant}; seeds {', '.join(map(str, m.seeds))}.",
        f"- `faultbench run --fault {spec.id}` runs it next to the clean run; "
        f"`faultbench run --fault {spec.id} --detectors all` adds the ranked findings.",
        "",
        "## 2. Isolate by subsystem",
        f"- The bug lives in **{spec.subsystem}** (a diagnosis naming {acceptable} is acceptable), in "
        + ", ".join(f"`{s}`" for s in spec.seams) + ".",
        "- Credit for narrowing down by experiment (a smaller batch, fp32 vs fp16, no padding vs left padding, "
        "one rank vs two, with vs without resume) rather than by reading code at random.",
        "",
        "## 3. Instrument: the check that exposes it and the metric that shows it",
        f"- Manifest check `{m.check}` {json.dumps(m.params) if m.params else ''}".rstrip()
        + (f": {evidence[-1]}" if evidence else "."),
    ]
    if detectors:
        lines.append("- Detectors that localize it first on every bench seed: "
                     + ", ".join(f"`{d}`" for d in detectors) + " (`faultbench detectors` says what each checks).")
    lines += [
        "",
        "## 4. Fix",
        f"- What is wrong: {spec.explanation}",
        f"- The fix: {spec.fix}",
        f"- `faultbench show {spec.id}` prints the diff against the clean seam.",
        "",
        "## 5. Prevent",
    ]
    if mutation:
        lines.append(f"- A regression test that fails with this bug in place: `{mutation[-1]}` (tests/model or "
                     "tests/distributed; `make mutation` lists them for every fault).")
    lines += [
        "- A strong answer proposes a test of the seam's contract (not of this one symptom), so the whole class "
        "of bug is caught.",
        "",
        "## The real bug it models",
        *[f"- {ref}" for ref in spec.references],
    ]
    return "\n".join(lines) + "\n"


# ---- exercises --------------------------------------------------------------------------------------

def _keys_dir() -> Path:
    return Path(os.environ.get("FAULTBENCH_PRACTICE_KEYS", ROOT / ".cache" / "practice"))


def _load(directory) -> tuple[dict, Path]:
    marker = Path(directory) / ".exercise"
    if not marker.exists():
        raise ValueError(f"{directory} is not a practice exercise (no .exercise file); make one with "
                         "`faultbench practice new --dir DIR`")
    try:
        token = json.loads(marker.read_text())["token"]
    except (UnicodeDecodeError, ValueError, TypeError, KeyError):
        token = None
    if not (isinstance(token, str) and re.fullmatch(r"[0-9a-f]{16}", token)):  # as new_exercise writes it
        raise ValueError(f"{marker} is not an exercise marker (expected {{\"token\": <16 hex digits>}}); make a "
                         "new exercise with `faultbench practice new --dir DIR`")
    path = _keys_dir() / f"{token}.json"
    if not path.exists():
        raise ValueError(f"the answer key of {directory} is not on this machine ({path})")
    return json.loads(path.read_text()), path


def choose_fault(seed: int | None, fault: str | None, subsystem: str | None, level: str | None) -> str:
    if fault:
        return get_fault(fault).id
    if level is not None and level not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {level!r}")
    pool = sorted(f for f, spec in all_faults().items()
                  if subsystem in (None, spec.subsystem) and level in (None, difficulty(spec)))
    if not pool:
        raise ValueError(f"no fault matches subsystem={subsystem!r} difficulty={level!r}")
    return random.Random(seed).choice(pool)


_FLAGS = {  # (config section, field) -> the train.py option that sets it
    ("train", "precision"): "--precision", ("train", "accum"): "--accum", ("train", "batch_size"): "--batch-size",
    ("train", "grad_clip"): "--grad-clip", ("data", "pad_side"): "--pad-side", ("data", "seq_len"): "--seq-len",
    ("data", "vocab_size"): "--vocab-size", ("model", "dropout"): "--dropout", ("model", "init_std"): "--init-std",
}


def train_args(manifest) -> list[str]:
    """The train.py command line that shows the fault (its manifest's scenario and config)."""
    args = ["--steps", str(manifest.steps), "--seed", str(manifest.seeds[0])]
    for section, values in manifest.variant.items():
        for key, value in values.items():
            if (section, key) == ("train", "zero"):
                args += ["--zero"] if value else []
            elif (section, key) in _FLAGS:
                args += [_FLAGS[section, key], str(value)]
            else:
                raise ValueError(f"train.py has no option for {section}.{key}")
    if manifest.scenario in ("ddp", "ddp_resume"):
        args += ["--world-size", "2"]
    if manifest.scenario in ("resume", "ddp_resume"):
        args += ["--resume-at", str(manifest.steps // 2)]
    if manifest.scenario == "generate":
        args += ["--generate"]
    return args


def _reference_cached(kind: str, key: dict, sources: tuple[str, ...], compute):
    """What the clean reference does for ``key``, computed once per key and digest of ``sources`` and kept
    under .cache/practice-reference/ (every exercise of the same config compares with the same run)."""
    from harness.case import source_digest

    blob = json.dumps({"key": key, "code": source_digest(*sources)}, sort_keys=True)
    path = ROOT / ".cache" / "practice-reference" / kind / f"{hashlib.sha256(blob.encode()).hexdigest()[:20]}.json"
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    write_text(path, json.dumps(value))
    return value


def _fresh_interpreter(argv: list[str], cwd, pythonpath: str, timeout_s: float):
    """``python argv`` in a new interpreter with ``pythonpath`` first: the CompletedProcess (text), None if it
    outlived the timeout."""
    env = {**os.environ, "PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "false"}
    try:
        return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


def _run_train(script: Path, cwd: Path, args: list[str], pythonpath: Path) -> tuple[str, int]:
    """``python script args`` in ``cwd`` with ``pythonpath`` first: its output and exit code (-1: it hung).
    One process runs in a child forked from this warm one (the script run as ``__main__`` with the project's
    modules imported afresh from ``pythonpath``); two ranks need a fresh interpreter to spawn from."""
    if "--world-size" not in args or args[args.index("--world-size") + 1] == "1":
        with tempfile.TemporaryDirectory(prefix="faultbench-train-") as tmp:
            log = Path(tmp) / "log"
            code = _forked(_script_in_fork, (str(script), str(cwd), args, str(pythonpath), str(log)), TRAIN_TIMEOUT_S)
            if code is not None:
                return log.read_text(errors="replace"), code
    else:
        proc = _fresh_interpreter([str(script), *args], cwd, str(pythonpath), TRAIN_TIMEOUT_S)
        if proc is not None:
            return proc.stdout + proc.stderr, proc.returncode
    return f"the run did not finish within {TRAIN_TIMEOUT_S:.0f} s (it hangs)\n", -1


def _fresh_project_modules(root: str) -> None:
    """In a forked child: forget the project's modules and put ``root`` first on the path, so that ``model``
    (and whatever imports it) is imported again, from ``root``."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("model", "faults", "harness", "detectors")]:
        del sys.modules[name]
    sys.path.insert(0, root)


def _forked(target, args: tuple, timeout_s: float) -> int | None:
    """``target(*args)`` in a child forked from this process; its exit code, None if it outlived the timeout."""
    import torch._dynamo  # noqa: F401  (the first optimizer imports it lazily: 1.5 s in every child otherwise)

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # tokenizers' threads do not survive a fork
    child = multiprocessing.get_context("fork").Process(target=target, args=args, daemon=True)
    child.start()
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        child.join()
        return None
    return child.exitcode


def _script_in_fork(script: str, cwd: str, args: list[str], root: str, log: str) -> None:
    """Forked child: run ``script`` as ``__main__`` as the interpreter would (its stdout and stderr to ``log``,
    an uncaught exception printed from the script's frames on, exit code 1)."""
    _fresh_project_modules(root)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(cwd)
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:  # drop this harness's frames
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb or exc.__traceback__)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _losses(log: str) -> list[float]:
    return [float(line.split()[3]) for line in log.splitlines() if line.startswith("step ")]


def _plot(path: Path, curves: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, losses in curves.items():
        ax.plot(range(len(losses)), losses, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _excerpt(log: str, lines: int = 14) -> str:
    kept = log.strip().splitlines()
    return "\n".join(kept if len(kept) <= lines else kept[:4] + ["..."] + kept[-(lines - 5):])


def new_exercise(directory, seed: int | None = None, fault: str | None = None, subsystem: str | None = None,
                 level: str | None = None) -> Path:
    """Write the exercise into ``directory`` (which must not exist or be empty); returns it."""
    from faults.inject import render_tree

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} is a file; give a new folder")
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory} is not empty; give a new folder")
    fault_id = choose_fault(seed, fault, subsystem, level)
    spec = get_fault(fault_id)
    render_tree(directory, [fault_id])
    shutil.copy(ROOT / "harness" / "exercise_train.py", directory / "train.py")
    args = train_args(spec.manifest)
    log, code = _run_train(directory / "train.py", directory, args, directory)
    healthy, _ = _reference_cached("train", {"args": args}, ("model", "harness/exercise_train.py"),
                                   lambda: _run_train(ROOT / "harness" / "exercise_train.py", ROOT, args, ROOT))
    curves = {"this run": _losses(log), "last week's run": _losses(healthy)}
    if "--resume-at" in args:  # the same job, never interrupted, for comparison
        cut = args.index("--resume-at")
        whole, _ = _run_train(directory / "train.py", directory, args[:cut] + args[cut + 2:], directory)
        curves["the same job without the restart"] = _losses(whole)
    _plot(directory / "loss.png", {k: v for k, v in curves.items() if v})
    healthy_lines = healthy.splitlines()
    healthy_tail = ([line for line in healthy_lines if line.startswith("step ")][:2]
                    + [line for line in healthy_lines if line.startswith(("validation", "generation"))])
    report = [
        "# Exercise: a training run that does not behave",
        "",
        "A colleague ran this and asks for help. Find the bug in `model/`, say where it is, fix it.",
        "",
        "```bash",
        f"python train.py {' '.join(args)}",
        "```",
        "",
        f"It {'crashed' if code else 'finished'}; here is the log:" if code >= 0 else "It never finished:",
        "",
        "```",
        _excerpt(log),
        "```",
        "",
        "Their loss curve is in `loss.png`" + (", next to last week's run of the same config, before the recent "
                                                "changes, which began and ended with:" if healthy_tail else "."),
        "",
        *[f"    {line}" for line in healthy_tail],
        "",
        "Commands (from the faultbench checkout): `faultbench practice hint DIR` (staged hints), "
        "`faultbench practice answer DIR --subsystem S [--seam X]`, `faultbench practice check DIR` (is your fix "
        "right?), `faultbench practice reveal DIR`. `faultbench seams` lists the subsystems and seams.",
    ]
    write_text(directory / "README.md", "\n".join(report) + "\n")
    token = secrets.token_hex(8)
    write_text(directory / ".exercise", json.dumps({"token": token}) + "\n")
    write_text(_keys_dir() / f"{token}.json", json.dumps({"fault": fault_id, "seed": seed, "args": args,
                                                          "difficulty": difficulty(spec), "hints": 0,
                                                          "answers": []}))
    return directory


def _symptom_class(spec) -> str:
    for symptom in spec.symptoms:
        if symptom.startswith("crash"):
            return "crash"
        if symptom in ("nan", "stall", "divergence"):
            return symptom
    return "quality"


def hint(directory) -> str:
    """The next hint: the symptom that matters, then the subsystem, then the seam (then nothing new)."""
    key, path = _load(directory)
    spec = get_fault(key["fault"])
    stages = [
        f"Hint 1 (the symptom): {SYMPTOM_HINTS[_symptom_class(spec)]}"
        + ("" if spec.trigger == "always" else f" It only shows under a particular condition ({spec.trigger})."),
        f"Hint 2 (the subsystem): look in `{spec.subsystem}` (`faultbench seams` lists its functions).",
        "Hint 3 (the seam): " + " and ".join(f"`{s}`" for s in spec.seams) + ".",
    ]
    key["hints"] = min(key["hints"] + 1, len(stages))
    write_text(path, json.dumps(key))
    return "\n".join(stages[: key["hints"]])


def answer(directory, subsystem: str, seam: str | None = None) -> dict:
    """Grade a diagnosis: the subsystem (exact, acceptable, wrong) and the seam if given."""
    key, path = _load(directory)
    spec = get_fault(key["fault"])
    if subsystem == spec.subsystem:
        sub = "right"
    elif subsystem in spec.also_acceptable:
        sub = "acceptable"
    else:
        sub = "wrong"
    verdict = {"subsystem": sub, "seam": None if seam is None else ("right" if seam in spec.seams else "wrong"),
               "hints_used": key["hints"]}
    key["answers"].append({"subsystem": subsystem, "seam": seam, **verdict})
    write_text(path, json.dumps(key))
    return verdict


def reveal(directory) -> str:
    from faults.inject import diff

    key, _ = _load(directory)
    spec = get_fault(key["fault"])
    return "\n".join([
        f"{spec.title}  (fault `{spec.id}`, {spec.subsystem}, {difficulty(spec)})", "",
        "What is wrong:", f"  {spec.explanation}", "", "The fix:", f"  {spec.fix}", "",
        "The real bug it models:", *[f"  - {ref}" for ref in spec.references], "",
        diff(spec.id),
    ])


def _scenario_in_fork(root: str, manifest_args: tuple, out: str) -> None:
    """Forked child: the scenario on ``root``'s ``model``; its Outcome dict (or the error) written to ``out``."""
    _fresh_project_modules(root)
    try:
        import torch

        from harness.scenario import run_scenario

        torch.set_num_threads(1)
        result = {"outcome": run_scenario(*manifest_args).to_dict()}
    except BaseException:  # the copy does not even import: the check reports it
        result = {"error": traceback.format_exc()[-3000:]}
    Path(out).write_text(json.dumps(result, default=str))


def scenario_outcome(model_root: Path, manifest, timeout_s: float = 600.0) -> dict:
    """The fault's manifest scenario run on the ``model/`` package under ``model_root`` (no injection), as
    the Outcome dict of ``harness.scenario``. A crash of the run is in the outcome; a copy that cannot even
    run the scenario (it does not import) raises RuntimeError with the error's tail.

    Single-process scenarios run in a child forked from this process (torch already imported: seconds
    saved per run) that imports ``model`` afresh from ``model_root``; the data-parallel ones in a new
    interpreter, whose rank processes must import the copy too."""
    args = (manifest.scenario, manifest.variant, manifest.steps, manifest.seeds[0])
    if manifest.scenario.startswith("ddp"):
        proc = _fresh_interpreter(["-m", "harness.scenario", args[0], str(args[2]), str(args[3]), json.dumps(args[1])],
                                  model_root, f"{model_root}{os.pathsep}{ROOT}", timeout_s)
        if proc is None:
            raise RuntimeError(f"the scenario did not finish within {timeout_s:.0f} s (it hangs)")
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        return json.loads(proc.stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory(prefix="faultbench-scenario-") as tmp:
        out = Path(tmp) / "outcome.json"
        code = _forked(_scenario_in_fork, (str(Path(model_root).resolve()), args, str(out)), timeout_s)
        if code is None:
            raise RuntimeError(f"the scenario did not finish within {timeout_s:.0f} s (it hangs)")
        if not out.exists():
            raise RuntimeError(f"the scenario's process died (exit code {code})")
        result = json.loads(out.read_text())
    if "error" in result:
        raise RuntimeError(result["error"])
    return result["outcome"]


def reference_outcome(manifest) -> dict:
    """The clean reference's outcome of a manifest's scenario (cached per manifest and source digest)."""
    key = {"scenario": manifest.scenario, "steps": manifest.steps, "seed": manifest.seeds[0],
           "variant": manifest.variant}
    return _reference_cached("scenario", key, ("model", "harness/scenario.py"),
                             lambda: scenario_outcome(ROOT, manifest))


def repair_problems(edited: dict, clean: dict, manifest) -> list[str]:
    """How the edited copy's outcome still differs from the clean reference's on the same scenario: a crash
    where there is none, other losses (1e-5), other probe metrics (1e-4 relative), or the symptom the fault's
    manifest checks for. Empty when the copy behaves like the reference. Never names the fault."""
    from harness.manifest import CHECKS
    from harness.scenario import Outcome

    problems = []
    if bool(edited["crash"]) != bool(clean["crash"]):
        problems.append(f"it crashes: {edited['crash']['type']}: {edited['crash']['message']}" if edited["crash"]
                        else "the reference crashes here but the edited copy does not")
    pairs = zip(edited["losses"], clean["losses"], strict=False)  # a length mismatch is reported below
    diffs = [i for i, (a, b) in enumerate(pairs) if not abs(a - b) <= 1e-5]
    if diffs or len(edited["losses"]) != len(clean["losses"]):
        problems.append(f"the training losses differ from a correct run from step {diffs[0] if diffs else 0}")
    for name in sorted(set(clean["extra"]) & set(edited["extra"])):
        a, b = edited["extra"][name], clean["extra"][name]
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) > 1e-4 * max(1.0, abs(b)):
            problems.append(f"{name} is {a:.4g}, a correct run gives {b:.4g}")
    to_outcome = lambda d: Outcome(**{k: v for k, v in d.items() if k in Outcome.__dataclass_fields__})  # noqa: E731
    still, _ = CHECKS[manifest.check]([to_outcome(clean)], [to_outcome(edited)], **manifest.params)
    if still:
        problems.append("the reported symptom is still there")
    return problems


def check(directory) -> dict:
    """Is the edited copy repaired? The colleague's scenario must now behave exactly like the reference
    (``repair_problems``). Says what still differs, never which fault it was."""
    key, _ = _load(directory)
    manifest = get_fault(key["fault"]).manifest
    try:
        edited = scenario_outcome(Path(directory).resolve(), manifest)
    except RuntimeError as exc:
        return {"repaired": False, "problems": [f"the copy does not run: {str(exc).strip().splitlines()[-1]}"]}
    problems = repair_problems(edited, reference_outcome(manifest), manifest)
    return {"repaired": not problems, "problems": problems}
