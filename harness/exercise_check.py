"""Does the training run behave like the healthy one now? (the `check.py` of a practice exercise)

    python check.py            run train.py as the colleague did; compare with healthy_run.json
    python check.py --seams    list the functions of model/ by subsystem, with their files

Exit code 0: the run behaves like the healthy run; 1: something still differs (listed); 2: the check
cannot run (a file missing or not valid Python, train.py refusing its command line or failing to import).
Uses only the Python standard library and this folder.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOSS_TOL = 2e-4  # train.py prints 4 decimals
TIMEOUT_S = 600
CANNOT_START = ("ImportError", "ModuleNotFoundError", "SyntaxError", "IndentationError", "NameError")


def seam_listing(root: Path = HERE) -> list[tuple[str, str, str, bool]]:
    """(name, subsystem, file, whether its ``def`` is there) for every function model/seams.py lists, read from
    the files as they are. No line numbers: a replaced function longer or shorter than the clean one would move
    every ``def`` below it, and two exercises' listings side by side would point at the changed file."""
    table = next(node.value for node in ast.parse((root / "model" / "seams.py").read_text()).body
                 if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "SEAMS")
    trees: dict[str, ast.Module] = {}
    out = []
    for name, subsystem in ast.literal_eval(table).items():
        _, module, *qualname = name.split(".")
        file = f"model/{module}.py"
        if file not in trees:
            trees[file] = ast.parse((root / file).read_text())
        out.append((name, subsystem, file, _has_def(trees[file], qualname)))
    return out


def _has_def(node: ast.AST, qualname: list[str]) -> bool:
    """Whether the ``def`` reached by ``qualname`` (classes, then the function) is there."""
    for part in qualname:
        node = next((c for c in getattr(node, "body", []) if isinstance(c, (ast.ClassDef, ast.FunctionDef))
                     and c.name == part), None)
        if node is None:
            return False
    return True


def parse_log(log: str) -> dict:
    """The numbers a run's log reports: per-step losses, the validation loss, the cached-decoding gap."""
    losses, validation, generation = [], None, None
    for line in log.splitlines():
        words = line.split()
        if line.startswith("step ") and len(words) > 3:
            losses.append(float(words[3]))
        elif line.startswith("validation loss "):
            validation = float(words[2])
        elif line.startswith("generation: "):
            generation = float(words[-1])
    return {"losses": losses, "validation": validation, "generation": generation}


def differences(run: dict, healthy: dict, finished: bool = True) -> list[str]:
    """How a parsed run differs from the healthy one (empty: it behaves the same); for a run that did not
    finish, only in the steps it logged."""
    out = []
    pairs = list(zip(run["losses"], healthy["losses"], strict=False))
    step = next((i for i, (a, b) in enumerate(pairs) if not abs(a - b) <= LOSS_TOL), None)
    if step is not None:
        out.append(f"the training loss differs from a healthy run from step {step} "
                   f"({pairs[step][0]:.4f}, healthy {pairs[step][1]:.4f})")
    if not finished:
        return out
    if step is None and len(run["losses"]) != len(healthy["losses"]):
        out.append(f"{len(run['losses'])} steps logged, a healthy run logs {len(healthy['losses'])}")
    if healthy["validation"] is not None and not (run["validation"] is not None
                                                  and abs(run["validation"] - healthy["validation"]) <= LOSS_TOL):
        out.append(f"validation loss {run['validation']}, a healthy run reaches {healthy['validation']:.4f}")
    if healthy["generation"] is not None and not (run["generation"] is not None
                                                  and run["generation"] <= max(1e-4, 10 * healthy["generation"])):
        out.append(f"cached decoding differs from the full forward by {run['generation']} "
                   f"(healthy: {healthy['generation']:.1e})")
    return out


def run_train(args: list[str]) -> tuple[str, int | None]:
    """train.py's output and exit code (None: it did not finish in time)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    try:
        proc = subprocess.run([sys.executable, "train.py", *args], cwd=HERE, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "", None
    return proc.stdout + proc.stderr, proc.returncode


def unrunnable(root: Path) -> str | None:
    """Why the folder cannot run at all (a file missing or not valid Python), None if it can."""
    if not (root / "train.py").exists() or not (root / "model").is_dir():
        return "cannot run: train.py or model/ is missing"
    for path in [root / "train.py", *sorted((root / "model").glob("*.py"))]:
        try:
            compile(path.read_bytes(), str(path), "exec")
        except (SyntaxError, ValueError) as exc:
            return f"cannot run: {path.relative_to(root)} is not valid Python: {exc}"
    return None


def verdict(log: str, code: int | None, healthy: dict) -> tuple[int, list[str]]:
    """(0 behaves | 1 differs | 2 cannot run, the lines saying why) of a train.py run (``code`` None: it hung)."""
    if code is None:
        return 1, [f"train.py did not finish within {TIMEOUT_S} s (it hangs)"]
    run = parse_log(log)
    last = log.strip().splitlines()[-1] if log.strip() else "(no output)"
    if code != 0 and not run["losses"] and (code == 2 or last.startswith(CANNOT_START)):
        return 2, [f"cannot run: train.py exited with {code}: {last}"]
    problems = [f"train.py crashes (exit code {code}): {last}"] if code else []
    problems += differences(run, healthy, finished=not code)
    return (1, problems) if problems else (0, [])


def check() -> tuple[int, list[str]]:
    """(exit code, what to print): run train.py as the colleague did and compare it with the healthy run."""
    why = unrunnable(HERE) or (None if (HERE / "healthy_run.json").exists() else "cannot run: no healthy_run.json")
    if why:
        return 2, [why]
    healthy = json.loads((HERE / "healthy_run.json").read_text())
    return verdict(*run_train(healthy["args"]), healthy)


def main(argv: list[str]) -> int:
    if argv == ["--seams"]:
        for name, subsystem, file, present in seam_listing():
            print(f"{subsystem:12s} {name:48s} {file}{'' if present else ' (not found)'}")
        return 0
    if argv:
        print(f"usage: python check.py [--seams] (got {' '.join(argv)})", file=sys.stderr)
        return 2
    code, lines = check()
    if code == 2:
        print(lines[0])
        return code
    print("FAIL: the run still differs from a healthy one:" if code else "PASS: the run behaves like the healthy one")
    for line in lines:
        print(f"  - {line}")
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
