"""Honesty: detectors never see which fault is injected and cannot reach the answer or the clean reference.

Two checks. A static one reads every detector module's AST (ours, the API's, the peer tools' adapters)
for introspection that reaches the harness or the injection: frames (the harness's locals hold the
case's fault ids), gc (the live ``injected()`` generator), linecache and seam source (the spliced
module), the environment, caches of seam functions, the module table, dynamic imports, ``faults``,
``harness`` and ``model``, by any alias or quoting. A dynamic one runs a spy that implements every hook
on faults of several kinds and asserts that nothing it can reach names the fault.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import types
from pathlib import Path

import pytest
import torch

from faultbench.detectors.api import DETECTORS, HOOKS, SUBSYSTEMS, RunContext, all_detectors, resolve_ids
from faultbench.faults.inject import injected
from faultbench.faults.registry import FaultSpec, all_faults
from faultbench.harness.case import execute
from faultbench.harness.matcher import recipe_for
from faultbench.harness.record import Case
from faultbench.model.seams import SEAMS, resolve
from faultbench.targets.ref.recipes import RECIPES
from tests.detectors.helpers import REF_ROLES
from tests.detectors.reach import reachable_strings

ROOT = Path(__file__).resolve().parents[2]
# our detectors and the peer tools' detector adapters (the TrainCheck runner is not a detector: it runs cases)
SOURCES = sorted((ROOT / "detectors").glob("**/*.py")) + [ROOT / "peers" / f
                                                        for f in ("torcheck_peer.py", "smdebug_peer.py")]

# ------------------------------------------------------------------------------------------ the static check
# modules a detector may not import at all (any submodule, any alias)
BANNED_MODULES = ("faultbench.faults", "faultbench.harness", "faultbench.model", "faults", "harness", "model",
                  "sys", "gc", "linecache", "importlib", "builtins", "dis", "ctypes",
                  "runpy", "pkgutil", "marshal")
# attributes of allowed modules that reach frames, source, the environment or a function's insides
BANNED_QUALIFIED = {
    f"inspect.{n}" for n in ("currentframe", "stack", "trace", "getouterframes", "getinnerframes", "getframeinfo",
                             "getsource", "getsourcelines", "getsourcefile", "getfile", "findsource", "getcomments",
                             "getmodule", "getclosurevars", "getgeneratorlocals", "getcoroutinelocals", "unwrap")
} | {f"os.{n}" for n in ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv", "sys")} | {
    f"traceback.{n}" for n in ("walk_stack", "walk_tb", "extract_stack", "format_stack", "print_stack")
} | {"threading.settrace", "threading.setprofile", "threading.settrace_all_threads", "threading.setprofile_all_threads"}
# attribute names banned on any object: frames, code, closures, module globals, caches, the module table's way in
BANNED_ATTRS = {
    "f_back", "f_locals", "f_globals", "f_code", "f_builtins", "tb_frame", "gi_frame", "cr_frame", "ag_frame",
    "gi_code", "cr_code", "ag_code", "__code__", "__globals__", "__closure__", "__builtins__", "__wrapped__",
    "__subclasses__", "cache_info", "cache_clear", "cache_parameters", "_getframe", "_current_frames", "settrace",
    "setprofile", "currentframe", "getouterframes", "getinnerframes", "getframeinfo", "getsource", "getsourcelines",
    "getsourcefile", "findsource", "getclosurevars", "environ", "getenv", "walk_stack", "walk_tb", "import_module",
    "__import__", "get_objects", "get_referrers", "get_referents", "sys",
}
# builtins that import, or run text the static check cannot read
BANNED_NAMES = {"__import__", "eval", "exec", "compile", "breakpoint", "__builtins__"}
BANNED_KEYWORDS = {"capture_locals"}  # traceback's way to the locals of every frame
# string constants (getattr's names, paths): a banned name, or a path into the fault or harness packages
BANNED_STRING = re.compile(r"^(?:(?:faultbench[./])?(?:faults|harness)(?:[./].*)?|sys|gc|linecache|inspect\.\w+)$"
                           r"|/proc/")

# Narrow exemptions: (file, function) -> the rules that function may break, and why.
EXEMPT = {
    # the registry loads the builtin detector modules (constant names) and installed entry points
    ("api.py", "all_detectors"): {"importlib", "import_module"},
    # the context's trusted side: line spans of the live seams from their code objects (never the
    # source), so that ``seam_at``/``raising_seam`` answer what a traceback line already shows
    ("api.py", "_line_span"): {"__code__", "inspect.unwrap"},
}


def _qualifier(tree: ast.Module, package: str) -> dict[str, str]:
    """{local name: qualified module or attribute} of every import in the module (any scope)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:
                module = f"{package}.{module}".rstrip(".")
            for a in node.names:
                aliases[a.asname or a.name] = f"{module}.{a.name}" if module else a.name
    return aliases


def _qualified(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``inspect.stack`` for ``i.stack`` after ``import inspect as i``; None unless the chain starts at an import."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _qualified(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        base = _qualified(node.args[0], aliases)
        return f"{base}.{node.args[1].value}" if base else None
    return None


def _module_rule(qualified: str) -> str | None:
    """The banned module or attribute ``qualified`` names or lies under, or None."""
    for banned in (*BANNED_MODULES, *BANNED_QUALIFIED):
        if qualified == banned or qualified.startswith(banned + "."):
            return banned
    return None


def _docstrings(tree: ast.Module) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _rules(node: ast.AST, aliases: dict[str, str], docstrings: set[int]) -> set[str]:
    """The banned things one AST node uses."""
    found = set()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        local = _qualifier(ast.Module(body=[node], type_ignores=[]), aliases.get("__package__", ""))
        found |= {rule for q in local.values() if (rule := _module_rule(q))}
        # ``import faultbench.faults.registry`` binds only ``faultbench``: the module it loads is the use
        found |= {rule for a in node.names if isinstance(node, ast.Import) and (rule := _module_rule(a.name))}
        found |= {a.name for a in node.names if a.name in BANNED_ATTRS}
    elif isinstance(node, (ast.Attribute, ast.Call)):
        if isinstance(node, ast.Attribute) and node.attr in BANNED_ATTRS:
            found.add(node.attr)
        qualified = _qualified(node, aliases)
        if qualified and (rule := _module_rule(qualified)):
            found.add(rule)
        if isinstance(node, ast.Call):
            found |= {k.arg for k in node.keywords if k.arg in BANNED_KEYWORDS}
    elif isinstance(node, ast.Name):
        if node.id in BANNED_NAMES:
            found.add(node.id)
        qualified = aliases.get(node.id)
        if qualified and (rule := _module_rule(qualified)):
            found.add(rule)
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
        if node.value in BANNED_ATTRS | BANNED_KEYWORDS or BANNED_STRING.search(node.value):
            found.add(f"string {node.value!r}")
    return found


def violations(source: str, package: str = "detectors") -> list[tuple[int, str, str]]:
    """(line, enclosing function, rule) of every banned use in ``source``."""
    tree = ast.parse(source)
    aliases = {**_qualifier(tree, package), "__package__": package}
    docstrings = _docstrings(tree)
    out = []

    def visit(node: ast.AST, function: str) -> None:
        for rule in sorted(_rules(node, aliases, docstrings)):
            out.append((getattr(node, "lineno", 0), function, rule))
        inner = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, "<module>")
    return out


def _unexempted(path: Path) -> list[tuple[int, str, str]]:
    found = violations(path.read_text(), path.parent.name)
    return [(line, fn, rule) for line, fn, rule in found if rule not in EXEMPT.get((path.name, fn), set())]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_detector_modules_use_no_introspection_that_reaches_the_harness_or_the_injection(path):
    assert _unexempted(path) == []


def test_every_exemption_is_still_needed():
    """An exemption nothing uses any more is a door left open for the next edit."""
    used = {(p.name, fn, rule) for p in SOURCES for _, fn, rule in violations(p.read_text(), p.parent.name)}
    assert [(f, fn, r) for (f, fn), rules in EXEMPT.items() for r in rules if (f, fn, r) not in used] == []


# each snippet must be caught: the check itself can fail
BANNED_SNIPPETS = {
    "inspect.currentframe": "import inspect\nf = inspect.currentframe()",
    "aliased inspect.stack": "import inspect as i\ns = i.stack()",
    "from-import stack": "from inspect import stack as s\nx = s()",
    "getouterframes": "import inspect\nx = inspect.getouterframes(None)",
    "sys._getframe": "import sys\nf = sys._getframe(1)",
    "from sys import _getframe": "from sys import _getframe as g\nf = g()",
    "getattr(sys, '_getframe')": "import sys\nf = getattr(sys, '_getframe')(1)",
    "f_back.f_locals": "def hook(ctx, exc):\n    return exc.__traceback__.tb_frame.f_back.f_locals",
    "f_globals": "x = frame.f_globals",
    "gi_frame": "x = gen.gi_frame",
    "getattr f_back (double quotes)": 'x = getattr(frame, "f_back")',
    "gc": "import gc\nobjs = gc.get_objects()",
    "aliased gc": "import gc as g\nobjs = g.get_referrers(x)",
    "linecache": "import linecache\nlines = linecache.getlines('model/data.py')",
    "from linecache import": "from linecache import cache",
    "inspect.getsource": "import inspect\nsrc = inspect.getsource(ctx.seam('model.data.collate'))",
    "inspect.getsourcelines": "from inspect import getsourcelines\nx = getsourcelines(fn)",
    "inspect.getfile": "import inspect\nx = inspect.getfile(fn)",
    "inspect.unwrap": "import inspect\nraw = inspect.unwrap(fn)",
    "os.environ": "import os\nd = os.environ.get('TOKENIZER_CACHE_DIR')",
    "os.getenv": "import os as o\nd = o.getenv('X')",
    "from os import environ": "from os import environ as e\nd = dict(e)",
    "getattr(os, 'environ')": "import os\nd = getattr(os, 'environ')",
    "cache_info": "n = ctx.seam('model.data.load_corpus').cache_info().misses",
    "cache_clear": "ctx.seam('model.data.load_corpus').cache_clear()",
    "__wrapped__": "raw = fn.__wrapped__",
    "__code__": "code = fn.__code__.co_code",
    "__globals__": "g = fn.__globals__['x']",
    "__closure__": "c = fn.__closure__[0].cell_contents",
    "sys.modules": "import sys\nm = sys.modules['faults.registry']",
    "os.sys": "import os\nm = os.sys.modules",
    "import faults": "import faults.registry",
    "from faults import": "from faults.registry import all_faults",
    "from harness import": "from harness.case import run_case",
    "import model": "import model.data as d",
    "import faultbench.faults": "import faultbench.faults.registry",
    "from faultbench.harness import": "from faultbench.harness.case import run_case",
    "from faultbench import model": "from faultbench import model",
    "faultbench.faults by attribute": "import faultbench\nr = faultbench.faults.registry.FAULTS",
    "string faultbench.faults module": "name = 'faultbench.faults.registry'",
    "importlib single quotes": "import importlib\nm = importlib.import_module('faults.registry')",
    "importlib double quotes": 'import importlib\nm = importlib.import_module("faults.registry")',
    "from importlib import import_module": "from importlib import import_module as imp\nm = imp('model.data')",
    "__import__": "m = __import__('faults')",
    "builtins.__import__": "import builtins\nm = builtins.__import__('x')",
    "exec": "exec('import gc')",
    "eval": "x = eval('1')",
    "string path into faults": "text = open('faults/loss.py').read()",
    "string faults module": "name = 'faults.registry'",
    "traceback.walk_stack": "import traceback\nfor frame, line in traceback.walk_stack(None): pass",
    "capture_locals": "import traceback\ns = traceback.StackSummary.extract(frames, capture_locals=True)",
    "settrace": "import threading\nthreading.settrace(fn)",
    "/proc": "env = open('/proc/self/environ').read()",
}


@pytest.mark.parametrize("snippet", BANNED_SNIPPETS.values(), ids=BANNED_SNIPPETS.keys())
def test_the_static_check_catches_each_banned_form(snippet):
    assert violations(snippet), snippet


def test_the_static_check_allows_ordinary_detector_code():
    allowed = (
        "import inspect\nimport torch\nimport traceback\n"
        "def on_start(ctx):\n"
        "    '''Uses sys.modules, gc and faults only in words.'''\n"
        "    model = ctx.run.model\n"
        "    n = len(list(model.modules()))\n"
        "    x = torch.stack([torch.ones(2)]).trace()\n"
        "    p = inspect.signature(ctx.seam('model.data.collate')).parameters\n"
        "    run_model = getattr(ctx.run, 'model')\n"
        "    seam = ctx.raising_seam(ValueError())\n"
        "    frames = traceback.extract_tb(None)\n"
    )
    assert violations(allowed) == []


# ------------------------------------------------------------------------------------------ the context
def _context() -> RunContext:
    return RunContext(run=None, seam_resolver=resolve, seams=dict(SEAMS), roles=REF_ROLES)


@pytest.mark.parametrize("name", ["faults.registry.all_faults", "targets.ref.case.run_case", "faultbench.model.data",
                                  "model",
                                  "model.tokenizer.cache_dir", "os.environ"])
def test_the_context_resolves_nothing_but_seams(name):
    ctx = _context()
    ctx.seams[name] = "data"  # the table a detector can edit is not the one the resolver checks
    with pytest.raises(ValueError):
        ctx.seam(name)
    with pytest.raises(ValueError):
        ctx.seam_resolver(name)


def test_a_cached_seam_comes_without_its_cache():
    ctx = _context()
    live = resolve("model.data.load_corpus")
    assert hasattr(live, "cache_info")  # the premise: the seam is lru_cached
    seam = ctx.seam("model.data.load_corpus")
    assert not any(hasattr(seam, a) for a in ("cache_info", "cache_clear", "cache_parameters", "__wrapped__"))
    assert inspect.unwrap(seam) is seam
    assert (seam.__name__, seam.__doc__) == (live.__name__, live.__doc__)
    assert inspect.signature(seam) == inspect.signature(live)
    assert ctx.seam("model.gpt.KVCache") is resolve("model.gpt.KVCache")  # a class of a seam still resolves
    assert ctx.seam("model.data.collate") is resolve("model.data.collate")


def test_raising_seam_names_the_innermost_seam_a_probe_raised_in():
    ctx = _context()
    try:
        ctx.seam("model.data.truncate")(None, 4, 0)  # len(None) raises inside truncate
    except TypeError as exc:
        assert ctx.raising_seam(exc) == "model.data.truncate"
    try:
        raise ValueError("outside every seam")
    except ValueError as exc:
        assert ctx.raising_seam(exc) is None


def test_the_tokenizer_fault_leaves_the_environment_alone():
    import faultbench.model.tokenizer as tokenizer_module

    before, shared = dict(os.environ), tokenizer_module.cache_dir()
    with injected("missing_bos"):
        assert dict(os.environ) == before
        assert tokenizer_module.cache_dir() != shared  # still kept out of the shared disk cache
    assert tokenizer_module.cache_dir() == shared


# ------------------------------------------------------------------------------------------ the registry
def test_every_detector_is_registered_with_a_known_family_and_description():
    registry = all_detectors()
    assert len([d for d, c in registry.items() if not c.baseline]) >= 20
    families = set(SUBSYSTEMS) | {"baseline", "resources"}
    for det_id, cls in registry.items():
        assert cls.family in families, (det_id, cls.family)
        assert cls.description, det_id
        assert cls.baseline == (cls.family == "baseline"), det_id


def test_unknown_detector_ids_get_a_suggestion():
    some = next(iter(all_detectors()))
    with pytest.raises(ValueError, match="did you mean"):
        resolve_ids([some[:-1] + "x"])


# ------------------------------------------------------------------------------------------ the spy
def secrets(spec: FaultSpec) -> list[str]:
    """The strings that would identify ``spec``: id, title, references, the fault functions' names, and
    the opening and every long sentence of its explanation, fix and fault docstrings."""
    out = [spec.id, spec.title, *spec.references]
    texts = [spec.explanation, spec.fix]
    for fn in spec.replacements.values():
        out.append(fn.__name__)
        texts.append(inspect.cleandoc(fn.__doc__ or ""))
    for text in texts:
        out.append(text[:40])
        out += [s for s in re.split(r"(?<=[.;:!?])\s+", " ".join(text.split())) if len(s) >= 30]
    return [s for s in out if s]


def leaked(spec: FaultSpec, strings) -> list[str]:
    """The secrets of ``spec`` found in ``strings`` (as written, or with their whitespace collapsed)."""
    text = "\n".join(strings)
    flat = " ".join(text.split())
    return [s for s in secrets(spec) if s in text or " ".join(s.split()) in flat]


def test_the_spy_would_see_a_secret_anywhere_the_context_leads():
    """The walk reaches attributes, containers, tensors, bound methods, classes and callables' names and
    docstrings, and the matching finds every kind of secret: the spy's clean verdict means something."""
    spec = all_faults()["missing_bos"]
    tensor = torch.zeros(1)
    tensor.tag = (spec.id, spec.title)
    holder = types.SimpleNamespace(note=f"{spec.explanation}\n{spec.fix}")
    method = types.SimpleNamespace(hook=types.MethodType(lambda self: None, holder))
    instance = type("X", (), {"__doc__": str(spec.references)})()
    planted = {"fault": [(1, *spec.replacements.values())], "tensor": tensor, "method": method, "instance": instance}
    run = types.SimpleNamespace(config=None, step=0, model=torch.nn.Linear(2, 2))
    run.model.planted = planted
    ctx = RunContext(run=run, seam_resolver=resolve, seams=dict(SEAMS), roles=REF_ROLES)
    assert len(leaked(spec, reachable_strings(ctx))) == len(secrets(spec)) > 6


# one fault per kind of trigger the bench can afford: a crash, a resume, the tokenizer (and corpus cache),
# an fp16 fault, a 2-rank one
SPIED = ("ignore_index_mismatch", "optimizer_state_not_restored", "missing_bos", "scaler_update_never_called",
         "ddp_double_reduction")


SPY, SPY_PLUGIN = "test_context_spy", str(Path(__file__).with_name("spy_plugin.py"))


@pytest.fixture
def spy_records(rank_pool):
    """{fault id: the case record of the spy on it}; the spy's registration is undone after the runs."""
    try:
        yield {fault_id: execute(Case(recipe_for(all_faults()[fault_id].manifest), 0, (fault_id,), (SPY,),
                                      (SPY_PLUGIN,)), pool=rank_pool)
               for fault_id in SPIED}
    finally:
        DETECTORS.pop(SPY, None)


@pytest.mark.xdist_group("rank_pool")  # with the other 2-rank cases: one worker, one pool
def test_the_spy_saw_every_hook_and_each_kind_of_case_and_nothing_it_reached_names_the_fault(spy_records):
    # one test: the spy's runs are the cost (a minute), and two tests of them landed on two workers
    recipes = [RECIPES[r["case"]["recipe"]] for r in spy_records.values()]
    assert any(r.world_size > 1 for r in recipes) and any(r.resume_at for r in recipes)
    assert "fp16" in {r.name for r in recipes}
    hooks = {h for r in spy_records.values() for h in r["summaries"][SPY]["hooks"]}
    assert hooks == set(HOOKS)
    assert spy_records["ignore_index_mismatch"]["crash"] is not None  # crash text was among what it read
    assert all(not r["detector_errors"] for r in spy_records.values())
    leaks = {f: leaked(all_faults()[f], spy_records[f]["summaries"][SPY]["strings"]) for f in SPIED}
    assert {f: found for f, found in leaks.items() if found} == {}
