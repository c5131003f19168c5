"""The fault registry: frozen metadata next to each buggy replacement of a reference seam.

A fault module defines the buggy function(s) with the ``@fault`` decorator (and ``@also_replaces``
for a fault that spans a second seam). Builtin faults live in one module per subsystem and are
loaded on first lookup; plugins register through the same decorators (``load_plugin``).
"""

from __future__ import annotations

import builtins
import dataclasses
import difflib
import dis
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import textwrap
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from faultbench.model.seams import SEAMS, SUBSYSTEMS, resolve

TRIGGERS = ("always", "rare-batch", "after-step", "on-resume", "multi-rank", "amp-only", "eval-only")
SYMPTOMS = (
    # crash-state: an object in an invalid state (None where a tensor was expected, a scaler used twice)
    "crash-shape", "crash-dtype", "crash-index", "crash-state", "nan", "divergence", "stall", "silent-quality",
    "eval-metric", "desync", "hang",
    # performance faults break no number but waste the machine
    "slowdown", "memory-growth",
)
SCENARIOS = ("train", "resume", "generate", "ddp", "ddp_resume")
_SUBSYSTEM_MODULES = ("data", "collate", "mask", "position", "model", "loss", "optimizer", "precision",
                      "checkpoint", "distributed", "eval")
# per target, the modules of its builtin faults: a target's faults load with it (the HF stack's import costs
# seconds, so a process that only touches the reference never pays for it)
BUILTIN_MODULES = {
    "ref": tuple(f"faultbench.faults.{m}" for m in _SUBSYSTEM_MODULES),
    "hf": tuple(f"faultbench.faults.hf.{m}" for m in _SUBSYSTEM_MODULES),
}
ENTRY_POINT_GROUP = "faultbench.plugins"


@dataclass(frozen=True)
class Manifest:
    """How the proof test makes the fault show: a scenario, a run variant, and the check that must hold.

    ``variant`` overrides config sections (``{"data": {"pad_side": "left"}, "train": {...}}``);
    ``check`` names a check in ``harness.manifest.CHECKS`` and ``params`` are its thresholds.
    """

    check: str
    steps: int = 30
    scenario: str = "train"
    variant: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    seeds: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class FaultSpec:
    id: str
    title: str
    subsystem: str
    seams: tuple[str, ...]
    trigger: str
    symptoms: tuple[str, ...]
    explanation: str
    fix: str
    references: tuple[str, ...]
    manifest: Manifest
    also_acceptable: tuple[str, ...] = ()
    target: str = "ref"  # the training stack whose seams it replaces (``targets.get``)
    replacements: dict[str, Callable] = field(default_factory=dict, compare=False, repr=False)

    def metadata(self) -> dict:
        """Everything but the replacement functions, JSON-able."""
        d = dataclasses.asdict(self)
        d.pop("replacements")
        return d


FAULTS: dict[str, FaultSpec] = {}
_loaded_builtin: set[str] = set()  # the targets whose builtin faults are registered


class FaultError(ValueError):
    """An invalid fault definition, or an unknown fault id."""


def _header(fn: Callable) -> str:
    """``fn``'s parameters as written (names, kinds, defaults), without annotations: ``(a, b=1, *, c)``."""
    params = [p.replace(annotation=p.empty) for p in inspect.signature(fn).parameters.values()]
    return str(inspect.Signature(params))


def _code_tree(code: types.CodeType):
    """``code`` and every code object nested in it (inner functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_tree(const)


def _spliced_code(seam: str, fn: Callable) -> types.CodeType:
    """The code object ``fn``'s source compiles to where the splice puts it: at module level, or in a class
    body for a method seam (where a zero-argument ``super()`` makes ``__class__`` a closure variable)."""
    target = inspect.unwrap(resolve(seam))
    text = textwrap.dedent(inspect.getsource(fn))
    if "." in target.__qualname__:
        text = "class Seam:\n" + textwrap.indent(text, "    ")
    # ``annotations`` is the __future__ feature imported above: compile as the seam's module does (PEP 563)
    future = vars(sys.modules[target.__module__]).get("annotations") is annotations
    code = compile(text, "<fault>", "exec", flags=annotations.compiler_flag if future else 0)
    return next(c for c in _code_tree(code) if c.co_name == fn.__name__)


@functools.lru_cache(maxsize=512)
def _global_loads(code: types.CodeType) -> frozenset[str]:
    """The global names ``code`` (and the code nested in it) loads."""
    return frozenset(i.argval for c in _code_tree(code) for i in dis.get_instructions(c) if i.opname == "LOAD_GLOBAL")


def _check_function(seam: str, fn: Callable) -> None:
    """Same signature as the seam, a docstring, globals the seam's module (or the builtins) defines, and the
    seam's closure variables: the body runs spliced into the seam's module, under the seam's header."""
    target = inspect.unwrap(resolve(seam))
    where = f"{fn.__module__}.{fn.__name__}"
    if _header(fn) != _header(target):  # same names, kinds and defaults: the spliced copy keeps the seam's header
        raise FaultError(f"{where} must have the signature of {seam} (names, kinds and defaults): "
                         f"{_header(target)}, got {_header(fn)}")
    if not inspect.getdoc(fn):
        raise FaultError(f"{where} needs a docstring saying what is wrong")
    try:
        code = _spliced_code(seam, fn)
    except (OSError, SyntaxError) as e:  # no source to splice (defined in a REPL or exec), or it does not compile
        raise FaultError(f"{where} cannot be spliced into {seam}: {e}") from None
    seam_globals = vars(sys.modules[target.__module__])
    names = {"LOAD_GLOBAL": set(), "STORE_GLOBAL": set()}  # a name the body stores as a global is defined
    for c in _code_tree(code):
        for i in dis.get_instructions(c):
            names.get(i.opname, set()).add(i.argval)
    # a name the seam's own code loads is as defined for the copy as for the original (e.g. transformers' ``xm``,
    # imported only where torch_xla is installed and used only behind that check)
    seam_loads = _global_loads(target.__code__)
    unknown = sorted(n for n in names["LOAD_GLOBAL"] - names["STORE_GLOBAL"] - seam_loads
                     if n not in seam_globals and not hasattr(builtins, n))
    local_only = [n for n in unknown if n in fn.__globals__]
    if local_only:
        raise FaultError(f"{where} uses {', '.join(local_only)}, which {seam}'s module does not define; import "
                         "them inside the function")
    if unknown:
        raise FaultError(f"{where} uses undefined name(s) {', '.join(unknown)} (neither {target.__module__}'s "
                         "globals nor builtins)")
    if code.co_freevars != target.__code__.co_freevars:
        raise FaultError(f"{where} closes over {list(code.co_freevars)} where {seam} closes over "
                         f"{list(target.__code__.co_freevars)} (e.g. a zero-argument super()): it cannot replace "
                         "the seam's code")


def _validate(spec: FaultSpec) -> None:
    problems = []
    if spec.subsystem not in SUBSYSTEMS:
        problems.append(f"unknown subsystem {spec.subsystem!r}")
    problems += [f"unknown also_acceptable subsystem {s!r}" for s in spec.also_acceptable if s not in SUBSYSTEMS]
    table = seam_table(spec.target)
    problems += [f"unknown seam {s!r} of target {spec.target!r}" for s in spec.seams if s not in table]
    if spec.trigger not in TRIGGERS:
        problems.append(f"unknown trigger {spec.trigger!r}; expected one of {TRIGGERS}")
    problems += [f"unknown symptom {s!r}" for s in spec.symptoms if s not in SYMPTOMS]
    if not spec.symptoms:
        problems.append("no symptoms")
    if not spec.references:
        problems.append("no references: cite the real bug or checklist item it models")
    if spec.manifest.scenario not in SCENARIOS:
        problems.append(f"unknown scenario {spec.manifest.scenario!r}; expected one of {SCENARIOS}")
    if problems:
        raise FaultError(f"fault {spec.id!r}: " + "; ".join(problems))


def seam_table(target: str) -> dict[str, str]:
    """{seam: subsystem} of ``target``; an unknown target raises ``FaultError`` naming the known ones."""
    if target == "ref":
        return SEAMS
    from faultbench import targets

    try:
        return targets.get(target).seams()
    except ValueError as e:
        raise FaultError(str(e)) from None


def fault(id: str, *, seam: str, title: str, subsystem: str, trigger: str, symptoms, explanation: str,
          fix: str, references, manifest: Manifest, also_acceptable=(), target: str = "ref"):
    """Register the decorated function as fault ``id``'s replacement for ``seam``."""

    def register(fn: Callable) -> Callable:
        if id in FAULTS:
            raise FaultError(f"fault id {id!r} is registered twice")
        spec = FaultSpec(id=id, title=title, subsystem=subsystem, seams=(seam,), trigger=trigger,
                         symptoms=tuple(symptoms), explanation=explanation, fix=fix,
                         references=tuple(references), manifest=manifest,
                         also_acceptable=tuple(also_acceptable), target=target, replacements={seam: fn})
        _validate(spec)
        _check_function(seam, fn)
        FAULTS[id] = spec
        return fn

    return register


def also_replaces(id: str, seam: str):
    """Add the decorated function to the already registered fault ``id`` as its replacement for ``seam``."""

    def register(fn: Callable) -> Callable:
        spec = FAULTS.get(id)
        if spec is None:
            raise FaultError(f"also_replaces({id!r}): register the fault with @fault first")
        if seam in spec.replacements:
            raise FaultError(f"fault {id!r} already replaces {seam}")
        _check_function(seam, fn)
        updated = dataclasses.replace(spec, seams=spec.seams + (seam,),
                                      replacements={**spec.replacements, seam: fn})
        _validate(updated)
        FAULTS[id] = updated
        return fn

    return register


def load_builtin(target: str | None = "ref") -> None:
    """Register the builtin faults of ``target`` (None: of every target) and the installed plugins."""
    for name in BUILTIN_MODULES if target is None else (target,):
        if name not in _loaded_builtin:
            _loaded_builtin.add(name)
            for module in BUILTIN_MODULES[name]:
                if importlib.util.find_spec(module) is not None:  # a subsystem may have no fault on a target
                    importlib.import_module(module)
    if "entry points" not in _loaded_builtin:
        _loaded_builtin.add("entry points")
        _load_entry_points()


def _load_entry_points() -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()


def plugin_module_name(path_or_module: str) -> str:
    """The module a plugin loads as: a .py file's name and a digest of its resolved path (two plugins of one file
    name in two folders are two modules), or the module's own name."""
    path = Path(path_or_module)
    if path.suffix != ".py":
        return path_or_module
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    return f"faultbench_plugin_{path.stem}_{digest}"


def load_plugin(path_or_module: str) -> None:
    """Import a plugin (a .py file or a module name) that registers faults (or detectors); a plugin that cannot
    be imported raises ``FaultError`` with a one-line reason (the file:line of a syntax error)."""
    path = Path(path_or_module)
    if path.suffix != ".py" and (path.exists() or os.sep in path_or_module):
        raise FaultError(f"plugin {path_or_module} is not a .py file nor a module name")
    if path.suffix == ".py" and not path.is_file():
        raise FaultError(f"plugin file {path} does not exist")
    name = plugin_module_name(path_or_module)
    if name in sys.modules:
        return
    try:
        if path.suffix == ".py":
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            importlib.import_module(path_or_module)
    except FaultError:
        sys.modules.pop(name, None)  # so a corrected plugin loads on the next try
        raise
    except SyntaxError as e:
        sys.modules.pop(name, None)
        raise FaultError(f"plugin {e.filename}:{e.lineno}: {e.msg}") from None
    except Exception as e:  # an import that fails: where in the plugin, and why
        sys.modules.pop(name, None)
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path.resolve())]
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        raise FaultError(f"plugin {path_or_module} failed to import{where}: {type(e).__name__}: {e}") from None


def all_faults(target: str | None = "ref") -> dict[str, FaultSpec]:
    """The registered faults of ``target`` (None: every target), plugins included."""
    load_builtin(target)
    return {k: v for k, v in FAULTS.items() if target in (None, v.target)}


def get_fault(fault_id: str) -> FaultSpec:
    """The fault ``fault_id`` of any target; an unknown id raises ``FaultError`` with the closest ids."""
    for target in ("ref", None):  # the reference's faults first: the HF stack is imported only when needed
        if fault_id in FAULTS:
            break
        load_builtin(target)
    faults = FAULTS
    if fault_id not in faults:
        close = difflib.get_close_matches(fault_id, faults, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise FaultError(f"unknown fault id {fault_id!r}{hint} (`faultbench faults` lists them)")
    return faults[fault_id]
