"""Repro bundles: everything needed to see a finding again, and ``replay`` that shows it again.

A bundle is a folder written when a detector fires (``faultbench run ... --detectors``, ``faultbench
bench --bundles DIR``), for the case's top-ranked finding:

  bundle.json      the command that made it, the case (recipe, seed, faults, detectors, plugins), the
                   run config, the finding's step and rank, the code digest and the torch version
  finding.json     the finding, every finding of the case, and its crash (if any)
  batch.pt         the micro-batches the run trained on at the finding's step (absent when the step never
                   drew one: a crash while collating, a finding after the last step)
  checkpoint.pt    the run's state just before that step: model, optimizer, scheduler, scaler, step and
                   this rank's RNG states (``torch.load(..., weights_only=True)``)
  metrics.jsonl    the per-step metrics of the run, one JSON object a line
  MANIFEST.sha256  the sha256 of every other file (``sha256sum -c MANIFEST.sha256`` checks it)

``replay`` verifies the manifest, runs the case again from its seed with the same capture, and says
whether the same finding (detector, step, subsystem, seam, message) comes back, and whether the batch
and the state before the step are bit-identical to the bundle's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from faultbench.harness.atomic import check_replaceable

FORMAT = 1
FILES = ("bundle.json", "finding.json", "batch.pt", "checkpoint.pt", "metrics.jsonl")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _capture_before(rank_dir: Path, step: int | None) -> dict:
    """The first capture, in the order they happened, at or after the finding's step: the state just before
    that step ran (after a resume that mangled the step counter: the state just loaded)."""
    index = [json.loads(line) for line in (rank_dir / "index.jsonl").read_text().splitlines()] \
        if (rank_dir / "index.jsonl").exists() else []
    if not index:
        raise ValueError(f"nothing was captured under {rank_dir}: the run did not start")
    return next((c for c in index if c["step"] >= (step or 0)), index[-1])


def write_bundle(directory, record: dict, capture_dir, command: list[str]) -> Path:
    """The bundle of ``record``'s top finding from the case's capture; written to a temporary folder and
    renamed into place. Returns the folder."""
    from faultbench.harness.digest import code_digest
    from faultbench.targets.ref.recipes import RECIPES

    if not record["findings"]:
        raise ValueError("no finding to bundle: the detectors were silent on this case")
    directory = Path(directory)
    finding = record["findings"][0]
    rank = finding["evidence"].get("rank", 0)
    rank_dir = Path(capture_dir) / f"rank{rank}"
    captured = _capture_before(rank_dir, finding["step"])
    number = captured["capture"]
    case = record["case"]
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = {"format": FORMAT, "command": " ".join(command), "replay": f"faultbench replay {directory}",
            "case": case, "config": RECIPES[case["recipe"]].config(case["seed"]).to_dict(),
            "seed": case["seed"], "step": captured["step"], "capture": number, "rank": rank,
            "code_digest": code_digest(case["plugins"]),
            "torch": torch.__version__}
    (tmp / "bundle.json").write_text(json.dumps(meta, indent=2) + "\n")
    (tmp / "finding.json").write_text(json.dumps({"finding": finding, "findings": record["findings"],
                                                  "crash": record["crash"]}, indent=2, default=str) + "\n")
    shutil.copy(rank_dir / f"state-{number:04d}.pt", tmp / "checkpoint.pt")
    if (rank_dir / f"batch-{number:04d}.pt").exists():
        shutil.copy(rank_dir / f"batch-{number:04d}.pt", tmp / "batch.pt")
    (tmp / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in record["history"]))
    (tmp / "MANIFEST.sha256").write_text("".join(f"{_sha256(tmp / name)}  {name}\n" for name in FILES
                                                 if (tmp / name).exists()))
    check_replaceable(directory, "MANIFEST.sha256", "repro bundle")
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return directory


REQUIRED = ("bundle.json", "finding.json", "checkpoint.pt", "metrics.jsonl")  # batch.pt may be absent
BUNDLE_FIELDS = {"case": dict, "seed": int, "step": int, "capture": int, "rank": int, "code_digest": str}
CASE_FIELDS = {"recipe": str, "seed": int, "faults": list, "detectors": list, "plugins": list}
FINDING_FIELDS = ("detector", "step", "subsystem", "seam", "message")


def _manifest(directory: Path) -> dict[str, str]:
    """MANIFEST.sha256 as {file: sha256}; ValueError unless every line is ``<sha256>  <bundle file>`` and every
    file of the bundle is listed."""
    manifest = directory / "MANIFEST.sha256"
    if not manifest.is_file():
        raise ValueError(f"{directory} is not a repro bundle (no MANIFEST.sha256)")
    listed = {}
    for number, line in enumerate(manifest.read_text(errors="replace").splitlines(), 1):
        parts = line.split()
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-f]{64}", parts[0]) or parts[1] not in FILES:
            raise ValueError(f"{manifest} line {number} is not '<sha256>  <one of {', '.join(FILES)}>': {line!r}")
        listed[parts[1]] = parts[0]
    unlisted = [n for n in FILES if n not in listed and (n in REQUIRED or (directory / n).exists())]
    if unlisted:
        raise ValueError(f"the bundle's MANIFEST.sha256 does not list {', '.join(unlisted)}: it was edited")
    return listed


def _json_file(path: Path, fields) -> dict:
    """The JSON object in ``path``, with ``fields`` (names, or {name: type}); ValueError otherwise."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    kinds = fields if isinstance(fields, dict) else dict.fromkeys(fields, object)
    wrong = [k for k, kind in kinds.items() if not isinstance(data, dict) or not isinstance(data.get(k), kind)]
    if wrong:
        raise ValueError(f"{path} lacks (or mistypes) {', '.join(wrong)}")
    return data


def verify(directory) -> dict:
    """The bundle's bundle.json after checking every file against MANIFEST.sha256 and the JSON files' shape
    (ValueError if not)."""
    directory = Path(directory)
    for name, digest in _manifest(directory).items():
        path = directory / name
        if not path.exists():
            raise ValueError(f"the bundle is incomplete: {name} is missing")
        if _sha256(path) != digest:
            raise ValueError(f"the bundle was modified: {name} does not match its sha256 in MANIFEST.sha256")
    meta = _json_file(directory / "bundle.json", BUNDLE_FIELDS)
    wrong = [k for k, kind in CASE_FIELDS.items() if not isinstance(meta["case"].get(k), kind)]
    if wrong:
        raise ValueError(f"{directory / 'bundle.json'}: its case lacks (or mistypes) {', '.join(wrong)}")
    finding = _json_file(directory / "finding.json", {"finding": dict})["finding"]
    if not all(k in finding for k in FINDING_FIELDS):
        raise ValueError(f"{directory / 'finding.json'}: its finding lacks one of {', '.join(FINDING_FIELDS)}")
    return meta


def _same_finding(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in ("detector", "step", "subsystem", "seam", "message"))


def _tensors_equal(a, b) -> bool:
    """Nested dicts/lists/tuples of tensors and plain values, compared exactly."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_tensors_equal, a, b))
    return a == b


def run_captured(case, capture_dir: str) -> dict:
    """The case's record (findings of every rank merged), with its steps captured under ``capture_dir``."""
    from faultbench.harness.case import execute
    from faultbench.harness.golden import load_golden
    from faultbench.targets.ref.recipes import RECIPES

    pool = None
    if RECIPES[case.recipe].world_size > 1:
        from faultbench.harness.launch import RankPool

        pool = RankPool(RECIPES[case.recipe].world_size)
    try:
        golden = load_golden([case.recipe], pool)[case.recipe]
        return execute(case, golden, pool, capture_dir=capture_dir)
    finally:
        if pool is not None:
            pool.close()


def _load_tensors(path: Path):
    """``torch.load`` (weights only) of ``path``; None when absent; ValueError when it is not such a file."""
    if not path.exists():
        return None
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # a truncated or foreign file: torch raises pickle, zip and runtime errors alike
        first_line = (str(e).splitlines() or [""])[0]
        raise ValueError(f"{path} cannot be loaded: {type(e).__name__}: {first_line}") from None


def replay(directory, plugins=()) -> dict:
    """Run the bundle's case again; what came back and what differs (``reproduced``: all of it matches).

    A bundle runs no code of its own: each plugin its case names must be one of ``plugins`` (given again by the
    user, ``replay --plugin``), else ValueError; ``MANIFEST.sha256`` catches damage, not tampering (anyone can
    write it again), so it is never a reason to import a file a bundle names."""
    from faultbench.faults.registry import load_plugin, plugin_module_name
    from faultbench.harness.digest import code_digest
    from faultbench.harness.record import case_from_dict
    from faultbench.targets.ref.recipes import RECIPES

    directory = Path(directory)
    meta = verify(directory)
    case = case_from_dict(meta["case"])
    if case.recipe not in RECIPES:
        raise ValueError(f"the bundle's recipe {case.recipe!r} is not one of this checkout's: {', '.join(RECIPES)}")
    given = {plugin_module_name(p) for p in plugins}  # a plugin as it loads: a file by its resolved path
    unsigned = [p for p in case.plugins if plugin_module_name(p) not in given]
    if unsigned:
        raise ValueError(f"the bundle's case loads plugin {unsigned[0]}; a bundle runs no code of its own: pass "
                         f"--plugin {unsigned[0]} to replay it with that plugin")
    for plugin in case.plugins:
        load_plugin(plugin)
    expected = json.loads((directory / "finding.json").read_text())["finding"]
    state, batch = _load_tensors(directory / "checkpoint.pt"), _load_tensors(directory / "batch.pt")  # before the run
    with tempfile.TemporaryDirectory(prefix="faultbench-replay-") as capture:
        record = run_captured(case, capture)
        rank_dir = Path(capture) / f"rank{meta['rank']}"
        number = meta["capture"]
        state_same = _tensors_equal(state, _load_tensors(rank_dir / f"state-{number:04d}.pt"))
        batch_same = _tensors_equal(batch, _load_tensors(rank_dir / f"batch-{number:04d}.pt"))
    found = next((f for f in record["findings"] if _same_finding(f, expected)), None)
    differences = []
    if found is None:
        differences.append("the finding did not come back" + (f"; the top finding now: {record['findings'][0]}"
                                                               if record["findings"] else "; no finding at all"))
    if not state_same:
        differences.append(f"the state before step {meta['step']} differs from checkpoint.pt")
    if not batch_same:
        differences.append(f"the batch of step {meta['step']} differs from batch.pt")
    return {"reproduced": not differences, "finding": expected, "evidence_identical": bool(found) and
            json.dumps(found["evidence"], sort_keys=True, default=str)
            == json.dumps(expected["evidence"], sort_keys=True, default=str),
            "state_identical": state_same, "batch_identical": batch_same, "differences": differences,
            "same_code": meta["code_digest"] == code_digest(case.plugins), "step": meta["step"], "case": meta["case"]}


def describe_replay(result: dict) -> str:
    f = result["finding"]
    case = result["case"]
    head = (f"case {'+'.join(case['faults']) or 'clean'} / {case['recipe']} / seed {case['seed']}; finding: "
            f"{f['detector']} at step {f['step']}: {f['subsystem']} / {f['seam'] or '-'}: {f['message']}")
    if not result["same_code"]:
        head += "\nnote: the code has changed since the bundle was written"
    if result["reproduced"]:
        return (f"{head}\nreproduced: the same finding came back; the batch and the state before step "
                f"{result['step']} are bit-identical to the bundle's"
                + ("" if result["evidence_identical"] else " (its evidence values differ)"))
    return f"{head}\nNOT reproduced:\n" + "\n".join(f"  - {d}" for d in result["differences"])


def bundle_name(case: dict) -> str:
    return f"{'+'.join(case['faults']) or 'clean'}-{case['recipe']}-s{case['seed']}"

