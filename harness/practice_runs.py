"""Running an exercise's code: the colleague's train.py, the hidden scenario, the clean reference's side.

``run_train`` runs a train.py on a given ``model/`` (a child forked from this warm process for one rank, a
fresh interpreter for two); ``scenario_outcome`` runs a fault's manifest scenario on a copy's ``model/``
(the interviewer's stricter check, with probe metrics the log does not show); the reference's side of
each comparison is cached in .cache/practice-reference/ per config and source digest. What a candidate wrote
runs only through ``candidate_train`` and ``candidate_outcome``: in ``harness.sandbox``, out of the grader's reach.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from faultbench.harness.atomic import read_cached_json, write_text
from faultbench.harness.sandbox import run_sandboxed
from faultbench.paths import cache_dir

ROOT = Path(__file__).resolve().parent.parent
TRAIN_TIMEOUT_S = 600.0  # a colleague's train.py run that takes longer hangs
OUTCOME_LINE = "faultbench-outcome: "  # how ``python -m faultbench.harness.scenario`` prints its Outcome


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


def reference_cached(kind: str, key: dict, sources: tuple[str, ...], compute):
    """What the clean reference does for ``key``, computed once per key and digest of ``sources`` and kept
    under .cache/practice-reference/ (every exercise of the same config compares with the same run)."""
    from faultbench.harness.digest import source_digest

    blob = json.dumps({"key": key, "code": source_digest(*sources)}, sort_keys=True)
    path = cache_dir() / "practice-reference" / kind / f"{hashlib.sha256(blob.encode()).hexdigest()[:20]}.json"
    cached = read_cached_json(path, "practice reference")
    if cached is not None:
        return cached
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


def run_train(script: Path, cwd: Path, args: list[str], pythonpath: Path) -> tuple[str, int]:
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
    return _HUNG, -1


_HUNG = f"the run did not finish within {TRAIN_TIMEOUT_S:.0f} s (it hangs)\n"


def candidate_train(folder: Path, args: list[str], hidden) -> tuple[str, int, bool]:
    """The folder's own train.py (the candidate's code) run in the sandbox with ``hidden`` folders out of its
    sight: its output, exit code (-1: it hung) and whether the sandbox isolated it (``harness.sandbox``)."""
    ran = run_sandboxed([str(folder / "train.py"), *args], folder, hidden, str(folder), TRAIN_TIMEOUT_S)
    return (_HUNG, -1, ran.isolated) if ran.code is None else (ran.output, ran.code, ran.isolated)


def _fresh_project_modules(root: str) -> None:
    """In a forked child: forget the project's modules and put ``root`` first on the path, so that ``model``
    (a candidate's script imports it top level) and ``faultbench.model`` (the harness's scenario imports it)
    are imported again, from ``root`` (see ``faultbench_with_model``)."""
    shim = faultbench_with_model(root)
    for name in [m for m in sys.modules if m.split(".")[0] in ("model", "faultbench")]:
        del sys.modules[name]
    sys.path[:0] = [shim, root]


def faultbench_with_model(root) -> str:
    """A folder holding a ``faultbench`` package that is this one but for its ``model``, found first under
    ``root`` (a candidate's copy): first on the path of a scenario run on the copy and of its rank processes.
    Its ``__init__`` runs the installed one's with the copy's folder first in ``__path__``."""
    import faultbench

    folder = cache_dir() / "practice-shims" / hashlib.sha256(str(root).encode()).hexdigest()[:20]
    search = [str(root), *(p for p in faultbench.__path__ if p != str(root)), str(ROOT)]
    init = faultbench.__file__
    write_text(folder / "faultbench" / "__init__.py",
               f"__path__ = {search!r}  # the copy's model first, then the installed package's folders\n"
               f"exec(compile(open({init!r}).read(), {init!r}, 'exec'))\n")
    return str(folder)


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
    # sys.stdout/stderr may not write to fds 1 and 2 (pytest's capture swaps them for files of its own)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
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


def _scenario_in_fork(root: str, manifest_args: tuple, out: str) -> None:
    """Forked child: the scenario on ``root``'s ``model``; its Outcome dict (or the error) written to ``out``."""
    _fresh_project_modules(root)
    try:
        import torch

        from faultbench.harness.scenario import run_scenario

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
        proc = _fresh_interpreter(["-m", "faultbench.harness.scenario", args[0], str(args[2]), str(args[3]),
                                   json.dumps(args[1])],
                                  model_root, f"{faultbench_with_model(model_root)}{os.pathsep}{model_root}", timeout_s)
        if proc is None:
            raise RuntimeError(f"the scenario did not finish within {timeout_s:.0f} s (it hangs)")
        return outcome_of(proc.stdout + proc.stderr, proc.returncode)
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


def outcome_of(output: str, code: int) -> dict:
    """The Outcome dict a ``python -m faultbench.harness.scenario`` run printed (RuntimeError with the output's
    tail when it failed)."""
    lines = [line for line in output.splitlines() if line.startswith(OUTCOME_LINE)]
    if code != 0 or not lines:
        raise RuntimeError(output[-3000:] or f"exit code {code}")
    return json.loads(lines[-1].removeprefix(OUTCOME_LINE))


def candidate_outcome(folder: Path, manifest, hidden, timeout_s: float = 600.0) -> dict:
    """``scenario_outcome`` of the folder's ``model/`` (the candidate's code), run in the sandbox."""
    argv = ["-m", "faultbench.harness.scenario", manifest.scenario, str(manifest.steps), str(manifest.seeds[0]),
            json.dumps(manifest.variant)]
    ran = run_sandboxed(argv, folder, hidden, f"{faultbench_with_model(folder)}{os.pathsep}{folder}", timeout_s)
    if ran.code is None:
        raise RuntimeError(f"the scenario did not finish within {timeout_s:.0f} s (it hangs)")
    return outcome_of(ran.output, ran.code)


def reference_outcome(manifest) -> dict:
    """The clean reference's outcome of a manifest's scenario (cached per manifest and source digest)."""
    key = {"scenario": manifest.scenario, "steps": manifest.steps, "seed": manifest.seeds[0],
           "variant": manifest.variant}
    return reference_cached("scenario", key, ("model", "harness/scenario.py"),
                             lambda: scenario_outcome(ROOT, manifest))


def repair_problems(edited: dict, clean: dict, manifest) -> list[str]:
    """How the edited copy's outcome still differs from the clean reference's on the same scenario: a crash
    where there is none, other losses (1e-5), other probe metrics (1e-4 relative), or the symptom the fault's
    manifest checks for. Empty when the copy behaves like the reference. Never names the fault."""
    from faultbench.harness.manifest import CHECKS
    from faultbench.harness.scenario import Outcome

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
