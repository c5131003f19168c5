"""Run one case of a wild program: a fresh copy in its own folder, an injected bug's patch applied to it when asked,
the program run through ``python -m wild.attach`` in a process of its own (one torch thread, offline, a timeout)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from wild.programs import Program

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "wild"
BUGS = Path(__file__).parent / "bugs"
TIMEOUT_S = 600


@dataclass(frozen=True)
class Bug:
    """An injected user-side bug: a patch of the program's own code (wild/bugs/<program>/<name>.patch) whose
    header says what it is and where a right diagnosis points (``# subsystem:`` the acceptable subsystems,
    ``# place:`` words of which one names the edited code in the finding's place)."""

    program: str
    name: str
    title: str
    subsystems: tuple[str, ...]
    places: tuple[str, ...]
    path: Path

    @classmethod
    def load(cls, path: Path) -> Bug:
        head = {}
        for line in path.read_text().splitlines():
            if not line.startswith("# "):
                break
            key, _, value = line[2:].partition(":")
            head[key.strip()] = value.strip()
        return cls(path.parent.name, path.stem, head["title"], tuple(head["subsystem"].split()),
                   tuple(head.get("place", "").split()), path)


def bugs_of(program: str) -> list[Bug]:
    return [Bug.load(p) for p in sorted((BUGS / program).glob("*.patch"))]


def run_case(program: Program, seed: int, label: str, bug: Bug | None = None, mode: str | None = None,
             golden: Path | None = None, save: bool = False, work: Path = WORK) -> dict:
    """One run in ``work/<program>/<label>``; its result as wild.attach writes it (plus "folder", "returncode").
    ``mode="none"``: no watch."""
    folder = Path(work) / program.name / label
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    program.prepare(folder, seed)
    if bug is not None:
        subprocess.run(["patch", "-p1", "--quiet", "--no-backup-if-mismatch", "-d", str(folder), "-i",
                        str(bug.path)], check=True)
    mode = mode or program.mode
    cmd = [sys.executable, "-m", "wild.attach", "--out", "result.json", "--mode", mode]
    if golden is not None:
        cmd += ["--golden", str(golden)]
    if save:
        cmd += ["--save", "watch.json"]
    if program.declare:
        cmd += ["--declare", json.dumps(program.declare)]
    cmd += ["--", *program.command(seed)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONHASHSEED="0", WILD_BASELINE="1" if mode == "none" else "0", WANDB_MODE="disabled")
    with open(folder / "log.txt", "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    out = folder / "result.json"
    result = json.loads(out.read_text()) if out.exists() else {"error": f"no result (exit {code})", "watches": []}
    result["folder"], result["returncode"] = str(folder), code
    return result
