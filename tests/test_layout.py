"""The layout is one-way (issue 24): no import cycle, and a target reaches the harness only through its shared types.

Data flows CLI -> bench -> case -> target -> score -> report. A target (``targets/<name>/``) may import the
record and suite types a runner fills (``harness.record``, ``harness.suite``, ``harness.watched``,
``harness.capture``) and nothing else of ``harness/``; a third target is a new package plus one line in
``targets._MODULES``, which the last test shows with a toy stack.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import tomllib

from faultbench import targets
from faultbench.harness.case import execute
from faultbench.harness.record import Case, empty_record

ROOT = Path(__file__).resolve().parents[1]
SHARED = {"faultbench.harness.record", "faultbench.harness.suite", "faultbench.harness.watched",
          "faultbench.harness.capture"}


def _modules() -> dict[str, Path]:
    """Every module of the distribution, by its installed name (pyproject's package-dir mapping)."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for package, folder in dirs.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            if all(part not in ("blind", "__pycache__") for part in parts):
                out.setdefault(name, path)
    return out


def _imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The modules of ours ``path`` imports at run time, anywhere in it (``if TYPE_CHECKING:`` blocks left out)."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *filter(None, [base])])
            candidates = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in candidates:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):  # a package's own __init__
                found.add(target)
                break
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(path, name, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others(graph):
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_targets_import_only_the_shared_types_of_the_harness(graph):
    reach = {name: sorted(t for t in deps if t.startswith("faultbench.harness") and t not in SHARED)
             for name, deps in graph.items() if name.startswith("faultbench.targets")}
    assert any(name.startswith("faultbench.targets.ref.") for name in reach)  # the walk reads the targets
    assert {name: deps for name, deps in reach.items() if deps} == {}


# ---- a third target: a package with a TARGET, and one line in targets._MODULES ---------------------------------
TOY = '''
from dataclasses import dataclass

from faultbench.harness.record import Case, empty_record
from faultbench.targets import Target


@dataclass(frozen=True)
class Recipe:
    name: str
    steps: int = 2
    world_size: int = 1
    resume_at: int | None = None


def run_case(recipe, seed, detectors=(), golden=None, rank=0, workdir=None):
    out = empty_record(Case(recipe, seed, (), tuple(detectors), target="toy"), rank)
    out["history"] = [{"step": s, "loss": 1.0 / (s + 1)} for s in range(RECIPES[recipe].steps)]
    return out


RECIPES = {"plain": Recipe("plain")}
TARGET = Target(name="toy", seams=dict, resolve=lambda name: None, recipes=lambda: RECIPES, run_case=run_case,
                clean_guarantees=(), needs=lambda manifest: {}, has=lambda recipe, need: None,
                features=lambda recipe: 0)
'''


def test_a_third_target_is_a_package_and_one_line(tmp_path, monkeypatch):
    (tmp_path / "toy_stack").mkdir()
    (tmp_path / "toy_stack" / "__init__.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(targets._MODULES, "toy", "toy_stack")  # the one line
    record = execute(Case("plain", 3, target="toy"))
    assert record["case"]["target"] == "toy" and record["crash"] is None
    assert [h["loss"] for h in record["history"]] == [1.0, 0.5]
    assert set(empty_record(Case("plain", 0, target="toy"))) <= set(record)
