"""Candidate mutants of a target's seams, and their registration as faults.

``candidates(target)`` applies every operator to every seam of the target (its ``def`` as it stands in its
module, real transformers files included) and returns each distinct mutated seam as a ``Candidate``: its id,
operator, the source lines it touches and its diff. Generation is pure: the same sources give the same ids in
the same order.

``register(specs)`` makes candidates faults like any other: their functions are written to a generated module
per seam module under ``.cache/mutants/<digest>/`` (a fault needs a real source file: splicing, the diff and
the traceback lines read it), with the seam module's globals, and registered with ``@fault``, so they pass the
same checks (signature, names, closure) and splice, inject and diff as a hand-written fault does.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import importlib.util
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from faultbench.faults.inject import display_path, find_def
from faultbench.faults.mutants.operators import OPERATORS, Source, apply, body_of
from faultbench.faults.registry import FAULTS, FaultError, Manifest, fault, seam_table
from faultbench.model.seams import resolve
from faultbench.paths import cache_dir

CACHE = cache_dir() / "mutants"


@dataclass(frozen=True)
class Candidate:
    """One mutated seam: ``function`` is the seam's ``def`` with the mutation, as it would stand in its module."""

    id: str
    target: str
    seam: str
    subsystem: str
    operator: str
    label: str
    lines: tuple[int, int]  # first and last line of the seam's file that the mutation touches
    function: str
    diff: str


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def mutant_id(target: str, seam: str, operator: str, index: int) -> str:
    """``mut_<target>_<module>_<function>_<operator>_<n>``: the seam's last two name parts."""
    return f"mut_{target}_{_slug('_'.join(seam.split('.')[-2:]))}_{operator}_{index}"


@cache
def _parsed(path: str) -> tuple[Source, ast.Module]:
    source = Source(Path(path).read_text())
    return source, ast.parse("\n".join(source.lines))


@cache
def _seam_def(seam: str) -> tuple[Source, ast.FunctionDef, str]:
    fn = inspect.unwrap(resolve(seam))
    path = inspect.getsourcefile(fn)
    source, tree = _parsed(path)
    return source, find_def(tree, fn.__qualname__), path


def seam_candidates(target: str, seam: str, subsystem: str) -> list[Candidate]:
    """Every distinct mutant of one seam, operator by operator, sites in source order."""
    source, node, path = _seam_def(seam)
    original = source.lines[node.lineno - 1 : node.end_lineno]
    seen = {"\n".join(original)}
    out = []
    rel = display_path(path)
    for op in OPERATORS.values():
        index = 0
        for site in op.sites(node, source):
            mutated = apply(source, site.edits, node.lineno, node.end_lineno)
            text = "\n".join(mutated)
            if text in seen:
                continue  # another site (or operator) wrote the same code already
            try:
                ast.parse(textwrap.dedent(text))
            except SyntaxError:
                continue
            seen.add(text)
            diff = "".join(difflib.unified_diff([line + "\n" for line in original], [line + "\n" for line in mutated],
                                                fromfile=f"a/{rel} ({seam})", tofile=f"b/{rel} ({seam})"))
            out.append(Candidate(mutant_id(target, seam, op.name, index), target, seam, subsystem, op.name,
                                 site.label, site.lines, text + "\n", diff))
            index += 1
    return out


def candidates(target: str) -> list[Candidate]:
    """Every candidate mutant of ``target``, seam by seam in table order. Two seams whose names read alike
    (``PreTrainedTokenizerBase.pad`` and ``._pad``) would give the same id: the later one's gets its place in the
    table appended (``_s9``), so every id names one mutant."""
    out, ids = [], set()
    for index, (seam, subsystem) in enumerate(seam_table(target).items()):
        for c in seam_candidates(target, seam, subsystem):
            if c.id in ids:
                c = dataclasses.replace(c, id=f"{c.id}_s{index}")
            ids.add(c.id)
            out.append(c)
    return out


# ---- registration ---------------------------------------------------------------------------------------

def _function_text(c: Candidate, name: str, doc: str) -> str:
    """The candidate's def as a module-level function ``name`` whose docstring is ``doc`` (the seam's own
    docstring, if any, replaced): what ``@fault`` registers and the splice takes the body of."""
    source, node, _ = _seam_def(c.seam)
    lines = textwrap.dedent(c.function).splitlines()
    has_doc = len(body_of(node)) < len(node.body)
    doc_line = " " * (node.body[0].col_offset - node.col_offset) + repr(doc)
    start = node.body[0].lineno - node.lineno  # the seam's docstring lines (mutations come after them)
    end = node.body[0].end_lineno - node.lineno + 1 if has_doc else start
    lines[start:end] = [doc_line]
    lines[0] = re.sub(rf"\bdef {re.escape(node.name)}\(", f"def {name}(", lines[0], count=1)
    return "\n".join(lines) + "\n"


def _module_file(cands: list[Candidate], module: str) -> Path:
    """The generated module holding ``cands`` (all of one seam module), written once per content."""
    body = [f'"""Mutants of {module} (generated by faultbench.faults.mutants.generate; do not edit)."""',
            "from __future__ import annotations", "",
            "import importlib as _importlib", "",
            f"globals().update({{k: v for k, v in vars(_importlib.import_module({module!r})).items() "
            "if not k.startswith('__')})", ""]
    for c in cands:
        body += ["", _function_text(c, _slug(c.id), f"Mutant {c.id}: {OPERATORS[c.operator].title}: {c.label}.")]
    text = "\n".join(body)
    path = CACHE / hashlib.sha256(text.encode()).hexdigest()[:16] / f"{_slug(module)}.py"
    if not path.exists():
        from faultbench.harness.atomic import write_text

        write_text(path, text)
    return path


def _import(path: Path):
    name = f"faultbench_mutants_{path.parent.name}_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def register(entries: list[tuple[Candidate, dict]]) -> dict[str, str]:
    """Register each (candidate, metadata) as a fault; metadata gives ``manifest`` (scenario, variant, steps),
    ``trigger`` and ``symptoms``. Returns {id: why it could not register} for those refused (a name the seam's
    module does not define, a changed closure: a mutant that would crash at import)."""
    refused = {}
    by_module: dict[str, list[tuple[Candidate, dict]]] = {}
    for c, meta in entries:
        if c.id not in FAULTS:
            by_module.setdefault(inspect.unwrap(resolve(c.seam)).__module__, []).append((c, meta))
    for module_name, group in by_module.items():
        module = _import(_module_file([c for c, _ in group], module_name))
        for c, meta in group:
            op = OPERATORS[c.operator]
            try:
                fault(c.id, seam=c.seam, title=f"{op.title} ({c.label})", subsystem=c.subsystem,
                      trigger=meta.get("trigger", "always"), symptoms=meta.get("symptoms", ("silent-quality",)),
                      explanation=f"Machine-made mutant ({op.name}) of {c.seam}: {c.label}.",
                      fix=f"Undo the mutation of {c.seam} (lines {c.lines[0]}-{c.lines[1]}): {c.label}.",
                      references=(op.reference,), manifest=Manifest(check="bench_behaviour", **meta["manifest"]),
                      target=c.target)(getattr(module, _slug(c.id)))
            except FaultError as e:
                refused[c.id] = str(e)
    return refused


@cache
def by_id(target: str) -> dict[str, Candidate]:
    return {c.id: c for c in candidates(target)}
