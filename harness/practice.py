"""Practice and interview mode: standalone exercises with one hidden fault, graded by behaviour.

- ``new`` / ``export`` write a folder to hand to a candidate: a copy of ``model/`` with the fault spliced
  into its source, ``train.py``, ``check.py`` (runs train.py and says what still differs from
  ``healthy_run.json``: exit 0 behaves, 1 differs, 2 cannot run), ``loss.png`` and a README saying only
  what a colleague would report. The folder runs without the faultbench checkout and locates nothing
  but by behaviour: every file has the same mtime, the function listing (``python check.py --seams``)
  is computed from the copy, the replaced functions carry their author's docstring
  (``harness.exercise_docs``), and the answer key stays with the interviewer (``.cache/practice/`` of
  this checkout, ``$FAULTBENCH_PRACTICE_KEYS`` or ``--keys``); the folder holds a random token only.
- ``hint`` (three stages, specific to the symptom class, then "no more"), ``answer`` (refuses unknown
  names unrecorded; accepts a unique short function name; after ``reveal``, recorded and not scored),
  ``check`` (the folder's own train.py judged as check.py judges it, against the interviewer's healthy
  run, then the stricter scenario comparison), ``reveal``.
Every call is an event with a time in the key (``harness.practice_session`` reads them).
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from faultbench.faults.inject import find_def
from faultbench.faults.registry import all_faults, get_fault
from faultbench.harness.atomic import write_text
from faultbench.harness.exercise_check import parse_log
from faultbench.harness.exercise_docs import exercise_docstring
from faultbench.harness.offer_table import TABLE as OFFER_TABLE
from faultbench.harness.offer_table import offered
from faultbench.harness.practice_level import DIFFICULTIES, NO_MORE_HINTS, difficulty, hints, readme_evidence, shown
from faultbench.harness.practice_log import folder_secret, intact, sealed
from faultbench.harness.practice_runs import reference_cached, run_train, train_args
from faultbench.model.seams import SEAMS, SUBSYSTEMS
from faultbench.paths import cache_dir

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
Clock = Callable[[], float]
MAX_ANSWERS = 3  # scored answers per exercise unless ``new --max-answers`` says otherwise


# ---- the answer key ---------------------------------------------------------------------------------

def keys_dir(keys=None) -> Path:
    """Where answer keys live: ``keys``, else $FAULTBENCH_PRACTICE_KEYS, else practice/ of the cache folder
    (``faultbench.paths``: the checkout's .cache/ in a clone)."""
    return Path(keys or os.environ.get("FAULTBENCH_PRACTICE_KEYS", cache_dir() / "practice"))


def key_folders(keys=None) -> list[Path]:
    """Every folder that may hold answer keys (``keys``, $FAULTBENCH_PRACTICE_KEYS, the checkout's default):
    what a candidate's code must never see."""
    candidates = (keys, os.environ.get("FAULTBENCH_PRACTICE_KEYS"), cache_dir() / "practice")
    return list(dict.fromkeys(Path(p).resolve() for p in candidates if p))


def load_key(directory, keys=None) -> tuple[dict, Path]:
    """The answer key of an exercise folder and its path (ValueError: not an exercise, or no key here)."""
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
    path = keys_dir(keys) / f"{token}.json"
    if not path.exists():
        raise ValueError(f"the answer key of {directory} is not on this machine ({path})")
    return unsealed(json.loads(path.read_text()), path.parent), path


def unsealed(key: dict, folder: Path) -> dict:
    """A key as read from ``folder``, marked ``altered`` for good when its seal does not hold
    (``harness.practice_log``): the mark is sealed in with the next event, so it cannot be laundered."""
    if not key.get("altered") and not intact(key, folder_secret(folder)):
        key["altered"] = True
    return key


def record(key: dict, path: Path, kind: str, clock: Clock, **fields) -> dict:
    """Append an event (``kind``, its time, ``fields``) to the key and save it sealed; returns the event."""
    event = {"kind": kind, "t": clock(), **fields}
    key["events"].append(event)
    write_text(path, json.dumps(sealed(key, folder_secret(path.parent))))
    return event


def revealed(key: dict) -> bool:
    return any(e["kind"] == "reveal" for e in key["events"])


def started(key: dict) -> tuple[float, float | None]:
    """When the session started (its ``start`` event, else the exercise's making) and its budget (None: none)."""
    begun = next((e for e in key["events"] if e["kind"] == "start"), None)
    return (begun["t"], begun["budget_s"]) if begun else (key["created"], None)


def _late(key: dict, now: float) -> bool:
    """Whether ``now`` is past the session's budget (never, without one)."""
    t0, budget = started(key)
    return budget is not None and now - t0 > budget


def _open_session(directory, keys) -> tuple[dict, Path]:
    """The key of an exercise whose session is still on (ValueError after ``stop``)."""
    key, path = load_key(directory, keys)
    if any(e["kind"] == "stop" for e in key["events"]):
        raise ValueError(f"the session of {directory} was stopped: hints, answers and checks are closed "
                         "(`report` and `reveal` still work)")
    return key, path


# ---- choosing and writing the exercise --------------------------------------------------------------

def choose_fault(seed: int | None, fault: str | None, subsystem: str | None, level: str | None,
                 results: Path = RESULTS, secret: bytes = b"") -> str:
    """The hidden fault: ``fault`` itself, else a seeded choice among the reference's faults that match, keyed by
    the keys folder's ``secret`` (a seed alone does not tell a candidate which fault it draws). Only the faults
    ``practice_offer`` marks offered (their run shows a symptom, the repair passes) are ever chosen."""
    shown = offered(results)
    if fault:
        spec = get_fault(fault)
        if spec.target != "ref":  # its seams live in installed transformers, not in a copy we can hand over
            raise ValueError(f"{fault!r} is a fault of the {spec.target} target: its code lives in the installed "
                             "library and cannot be spliced into a standalone copy; practice uses ref faults")
        if shown is not None and spec.id not in shown:
            raise ValueError(f"{fault!r} is not offered: a candidate's run of it shows no symptom, or the repair "
                             f"does not pass (results/{OFFER_TABLE} says which)")
        return spec.id
    if level is not None and level not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {level!r}")
    pool = sorted(f for f, spec in all_faults("ref").items()
                  if subsystem in (None, spec.subsystem) and level in (None, difficulty(spec, results))
                  and (shown is None or f in shown))
    if not pool:
        raise ValueError(f"no fault matches subsystem={subsystem!r} difficulty={level!r}")
    return random.Random(f"{secret.hex()}:{seed}" if seed is not None else None).choice(pool)


def set_docstring(source: str, qualname: str, doc: str | None) -> str:
    """``source`` with the docstring of ``qualname``'s def replaced by ``doc`` (None: removed)."""
    lines = source.splitlines()
    fn = find_def(ast.parse(source), qualname)
    first = fn.body[0]
    has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str)
    indent = " " * first.col_offset
    new = [] if doc is None else [f'{indent}"""{doc}"""']
    if has_doc:
        lines[first.lineno - 1 : first.end_lineno] = new
    else:
        lines[first.lineno - 1 : first.lineno - 1] = new
    return "\n".join(lines) + "\n"


def _author_docstrings(folder: Path, spec) -> None:
    """Each replaced function of the copy gets the docstring ``exercise_docstring`` gives it."""
    import inspect

    from faultbench.model.seams import resolve

    for seam in spec.seams:
        _, module, qualname = seam.split(".", 2)
        path = folder / "model" / f"{module}.py"
        doc = exercise_docstring(spec.id, seam, inspect.getdoc(inspect.unwrap(resolve(seam))))
        write_text(path, set_docstring(path.read_text(), qualname, doc))


def build_folder(directory, fault_id: str) -> Path:
    """The exercise's code, no run yet: ``model/`` with the fault spliced in and its author's docstrings,
    ``train.py`` and ``check.py``. ``directory`` must not exist or be empty."""
    from faultbench.faults.inject import render_tree

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} is a file; give a new folder")
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory} is not empty; give a new folder")
    spec = get_fault(fault_id)
    render_tree(directory, [fault_id])
    _author_docstrings(directory, spec)
    shutil.copy(ROOT / "harness" / "exercise_train.py", directory / "train.py")
    shutil.copy(ROOT / "harness" / "exercise_check.py", directory / "check.py")
    return directory


def uniform_mtimes(directory: Path, when: float) -> None:
    """Every file and folder under ``directory`` (itself included) modified at ``when``, after removing what
    our runs left (bytecode, the tokenizer cache; the candidate's first run makes them again) and rewriting every
    file afresh in sorted order: the faulty file is not the last one written (its inode, its birth time)."""
    for cache in [*directory.rglob("__pycache__"), directory / ".cache"]:
        shutil.rmtree(cache, ignore_errors=True)
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    for path in files:  # new inodes in sorted order, while the old ones still hold theirs
        staged = path.with_name(path.name + ".settle")
        staged.write_bytes(path.read_bytes())
        os.chmod(staged, path.stat().st_mode)
    for path in files:
        os.replace(path.with_name(path.name + ".settle"), path)
    for path in [*directory.rglob("*"), directory]:
        os.utime(path, (when, when))


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
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def _excerpt(lines: list[str], keep: int = 14) -> str:
    return "\n".join(lines if len(lines) <= keep else lines[:4] + ["..."] + lines[-(keep - 5):])


_WARNING = re.compile(r"^(?P<file>\S+\.py):\d+: (?P<what>\w*Warning: .*)\n(?:  .*\n)?", re.MULTILINE)


def scrub_paths(log: str, directory: Path) -> str:
    """A log as the colleague's machine would print it: the folder as ``~/job``, installed packages under
    ``.../site-packages`` (our paths would name this checkout); a warning keeps its file and message but not its
    line number nor the source line Python prints under it (they would point at the changed code)."""
    log = _WARNING.sub(lambda m: f"{m['file']}: {m['what']}\n", log)
    log = log.replace(str(directory.resolve()), "~/job")
    return re.sub(r"[^\s\"']*/(site|dist)-packages/", ".../site-packages/", log)


def readme(args: list[str], level: str, log: str, code: int, healthy: str) -> str:
    """What the colleague reports, showing as much evidence as ``level`` allows (``readme_evidence``)."""
    theirs, healthy_lines = readme_evidence(level, log, healthy)
    said = f"It {'crashed' if code else 'finished'}; here is the log:" if code >= 0 else "It never finished:"
    return "\n".join([
        "# A training run that does not behave",
        "",
        "A colleague ran this and asks for help. Find the bug in `model/`, say where it is, fix it.",
        "",
        "```bash",
        f"python train.py {' '.join(args)}",
        "```",
        "",
        said,
        "",
        "```",
        _excerpt(theirs),
        "```",
        "",
        "Their loss curve is in `loss.png`, next to last week's run of the same job, before the recent changes"
        + (", which reported:" if healthy_lines else "."),
        "",
        *[f"    {line}" for line in healthy_lines],
        "",
        "`python check.py` runs the job again and says whether it now behaves like the healthy run (exit 0) or "
        "what still differs (exit 1); `python check.py --seams` lists the functions of `model/` by area, with "
        "their files. Hints, and whether your diagnosis is right: ask your interviewer.",
    ]) + "\n"


def _healthy(args: list[str]) -> tuple[str, int]:
    """The clean reference's train.py log for ``args`` (cached per config and source digest; a run that
    failed or logged no step raises and is not cached)."""
    script = ROOT / "harness" / "exercise_train.py"

    def compute() -> tuple[str, int]:
        log, code = run_train(script, ROOT, args, ROOT)
        if code != 0 or not parse_log(log)["losses"]:
            raise RuntimeError(f"the reference's own train.py run failed (exit code {code}):\n{log[-2000:]}")
        return log, code

    return tuple(reference_cached("train", {"args": args}, ("model", "harness/exercise_train.py"), compute))


def new_exercise(directory, seed: int | None = None, fault: str | None = None, subsystem: str | None = None,
                 level: str | None = None, keys=None, clock: Clock = time.time, candidate: str | None = None,
                 max_answers: int = 3) -> Path:
    """Write the exercise into ``directory`` (new or empty) and its answer key with the interviewer: the fault,
    the candidate's name, the cap on scored answers, and the code as handed over (for the report's diff)."""
    if max_answers < 1:
        raise ValueError(f"--max-answers must be at least 1, got {max_answers}")
    fault_id = choose_fault(seed, fault, subsystem, level, secret=folder_secret(keys_dir(keys)))
    spec = get_fault(fault_id)
    directory = build_folder(directory, fault_id)
    args = train_args(spec.manifest)
    log, code = run_train(directory / "train.py", directory, args, directory)
    healthy, _ = _healthy(args)
    curves = {"this run": parse_log(log)["losses"], "last week's run": parse_log(healthy)["losses"]}
    if "--resume-at" in args:  # the same job, never interrupted, for comparison
        cut = args.index("--resume-at")
        whole, _ = run_train(directory / "train.py", directory, args[:cut] + args[cut + 2:], directory)
        curves["the same job without the restart"] = parse_log(whole)["losses"]
    _plot(directory / "loss.png", {k: v for k, v in curves.items() if v})
    level = difficulty(spec, RESULTS)
    write_text(directory / "README.md", readme(args, level, scrub_paths(log, directory), code, healthy))
    write_text(directory / "healthy_run.json", json.dumps({"args": args, **parse_log(healthy)}, indent=1) + "\n")
    write_key(directory, keys, {"fault": fault_id, "seed": seed, "args": args, "difficulty": level,
                                "candidate": candidate, "max_answers": max_answers,
                                "shown": shown(log, code, healthy)}, clock())
    return directory


def write_key(directory: Path, keys, fields: dict, created: float) -> None:
    """Hand ``directory`` over: its marker (a fresh token), one file time for all of it, and with the interviewer
    the sealed key (``fields`` plus the folder, ``created`` and no events yet) and the code as handed over."""
    token = secrets.token_hex(8)
    write_text(directory / ".exercise", json.dumps({"token": token}) + "\n")
    uniform_mtimes(directory, int(created))
    handed = json.dumps(handed_sources(directory), sort_keys=True)
    write_text(keys_dir(keys) / f"{token}.handed", handed)
    write_text(keys_dir(keys) / f"{token}.json", json.dumps(sealed({
        **fields, "folder": str(directory.resolve()), "created": created,
        "handed_sha256": hashlib.sha256(handed.encode()).hexdigest(), "events": []}, folder_secret(keys_dir(keys)))))


def handed_sources(directory: Path) -> dict[str, str]:
    """The folder's Python sources by relative path: what the candidate may edit."""
    return {str(p.relative_to(directory)): p.read_text() for p in sorted(directory.rglob("*.py"))
            if "__pycache__" not in p.parts}


def candidate_diff(directory, keys=None) -> str | None:
    """The candidate's changes: a unified diff of the folder's sources against the code as handed over (None when
    the handed copy is missing or does not match the sealed key's hash)."""
    key, path = load_key(directory, keys)
    handed_path = path.with_suffix(".handed")
    if not handed_path.exists():
        return None
    text = handed_path.read_text()
    if hashlib.sha256(text.encode()).hexdigest() != key.get("handed_sha256"):
        return None
    before, after = json.loads(text), handed_sources(Path(directory))
    lines = []
    for name in sorted(set(before) | set(after)):
        lines += difflib.unified_diff(before.get(name, "").splitlines(), after.get(name, "").splitlines(),
                                      f"handed/{name}", f"now/{name}", lineterm="")
    return "\n".join(lines)


def export_archive(directory, archive, keys=None) -> Path:
    """The exercise folder as a .tar.gz to hand over: every member with the folder's own uniform mtime."""
    directory, archive = Path(directory), Path(archive)
    load_key(directory, keys)  # an exercise of this machine, not any folder
    when = int(directory.stat().st_mtime)

    def same_time(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        info.mtime = when
        return None if "__pycache__" in info.name else info

    with tarfile.open(archive, "w:gz") as tar:
        tar.add(directory, arcname=directory.name, filter=same_time)
    return archive


# ---- the candidate's moves --------------------------------------------------------------------------

def hint(directory, keys=None, clock: Clock = time.time) -> str:
    """The next staged hint (with the earlier ones); after the third, a note that there are no more."""
    key, path = _open_session(directory, keys)
    stages = hints(get_fault(key["fault"]), key.get("shown"))
    given = sum(e["kind"] == "hint" for e in key["events"])
    if given >= len(stages):
        return NO_MORE_HINTS
    record(key, path, "hint", clock, stage=given + 1, counted=not revealed(key))  # after the reveal: free
    return "\n".join(stages[: given + 1])


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def resolve_seam(name: str) -> str:
    """The full seam name ``name`` designates: itself, or the one seam it ends (``apply_rope``, ``KVCache.update``).
    ValueError for an unknown name (with the closest) or an ambiguous one (with the candidates)."""
    if name in SEAMS:
        return name
    matches = [s for s in SEAMS if s.endswith("." + name)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(f"{name!r} is ambiguous: {', '.join(matches)}")
    short = {s.rsplit(".", 1)[-1] for s in SEAMS} | set(SEAMS)
    raise ValueError(f"unknown function {name!r}{_did_you_mean(name, short)} (`python check.py --seams` lists them)")


def answer(directory, subsystem: str, seam: str | None = None, keys=None, clock: Clock = time.time) -> dict:
    """Grade a diagnosis: the subsystem (right, acceptable, wrong) and the function if given. Unknown names and
    answers past the exercise's cap (``max_answers``) are refused (ValueError) and not recorded; an answer after
    ``reveal`` is recorded but not scored; one past the time budget is scored and marked late."""
    if subsystem not in SUBSYSTEMS:
        raise ValueError(f"unknown subsystem {subsystem!r}{_did_you_mean(subsystem, SUBSYSTEMS)} "
                         f"(one of {', '.join(SUBSYSTEMS)})")
    seam = None if seam is None else resolve_seam(seam)
    key, path = _open_session(directory, keys)
    hints_used = sum(e["kind"] == "hint" and e.get("counted", True) for e in key["events"])
    if revealed(key):
        record(key, path, "answer", clock, subsystem=subsystem, seam=seam, scored=False)
        return {"scored": False, "subsystem": None, "seam": None, "hints_used": hints_used, "late": False}
    cap, used = key.get("max_answers", MAX_ANSWERS), sum(e["kind"] == "answer" and e["scored"] for e in key["events"])
    if used >= cap:
        raise ValueError(f"no answers left: all {cap} were used (`reveal` shows the fault; the report lists them)")
    verdict = {"scored": True, **grade(get_fault(key["fault"]), subsystem, seam), "hints_used": hints_used}
    event = record(key, path, "answer", clock, subsystem=subsystem, seam=seam, verdict_subsystem=verdict["subsystem"],
                   verdict_seam=verdict["seam"], scored=True, late=_late(key, clock()))
    return {**verdict, "late": event["late"], "left": cap - used - 1}


def grade(spec, subsystem: str, seam: str | None) -> dict:
    """A diagnosis of ``spec``: the subsystem right, acceptable or wrong; the function (a full seam name) right or
    wrong, None when not given."""
    sub = "right" if subsystem == spec.subsystem else "acceptable" if subsystem in spec.also_acceptable else "wrong"
    return {"subsystem": sub, "seam": None if seam is None else ("right" if seam in spec.seams else "wrong")}


def stop(directory, keys=None, clock: Clock = time.time) -> dict:
    """End the session: the clock stops; hints, answers and checks are refused from now on."""
    key, path = _open_session(directory, keys)
    return record(key, path, "stop", clock)


def reveal(directory, keys=None, clock: Clock = time.time) -> str:
    from faultbench.faults.inject import diff

    key, path = load_key(directory, keys)
    spec = get_fault(key["fault"])
    record(key, path, "reveal", clock)
    return "\n".join([
        f"{spec.title}  (fault `{spec.id}`, {spec.subsystem}, {key['difficulty']})", "",
        "What is wrong:", f"  {spec.explanation}", "", "The fix:", f"  {spec.fix}", "",
        "The real bug it models:", *[f"  - {ref}" for ref in spec.references], "",
        diff(spec.id),
    ])


def check(directory, keys=None, clock: Clock = time.time, strict: bool = True) -> dict:
    """Is the copy repaired? The folder's own train.py, run as the colleague ran it, judged as its check.py
    judges (``harness.exercise_check.verdict``) but against the interviewer's healthy run (a candidate can
    edit check.py and healthy_run.json); if it behaves and ``strict``, the fault's scenario on the copy
    against the reference (probe metrics the log does not show). The copy's code runs in ``harness.sandbox``
    with every answer-key folder hidden. {"code": 0 repaired | 1 not | 2 cannot run, "problems": [...],
    "isolated": whether the sandbox's namespaces held it}; never names the fault."""
    from faultbench.harness.exercise_check import unrunnable, verdict
    from faultbench.harness.practice_runs import candidate_outcome, candidate_train, reference_outcome, repair_problems

    key, path = _open_session(directory, keys)
    folder = Path(directory).resolve()
    hidden = key_folders(keys)
    why, isolated = unrunnable(folder), True
    if why:
        code, problems = 2, [why]
    else:
        log, exit_code, isolated = candidate_train(folder, key["args"], hidden)
        code, problems = verdict(log, None if exit_code == -1 else exit_code, parse_log(_healthy(key["args"])[0]))
    if code == 0 and strict:
        manifest = get_fault(key["fault"]).manifest
        try:
            problems = repair_problems(candidate_outcome(folder, manifest, hidden), reference_outcome(manifest),
                                       manifest)
        except RuntimeError as exc:
            problems = [f"the copy does not run: {str(exc).strip().splitlines()[-1]}"]
        code = 1 if problems else 0
    record(key, path, "check", clock, code=code, problems=problems[:5], isolated=isolated, late=_late(key, clock()))
    return {"code": code, "problems": problems, "isolated": isolated}
