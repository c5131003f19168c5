"""One mechanism, three uses: splice a fault's source into a seam's module, diff it, inject it at runtime.

Splicing works on source text guided by the AST: the seam's ``def`` (its decorators stay) is replaced
by the seam's own header and docstring followed by the fault function's body, re-indented to the
seam's column. The fault's name, decorators and docstring (which explains the bug; a spliced copy
must not) are dropped. Comments and formatting of the fault body are kept as written.

Runtime injection compiles the spliced module under the seam module's real file name and swaps the
new code objects into the live functions of that module (``__code__``; a fault keeps its seam's
signature and defaults), so every reference to them, ``from model.x import f`` included, runs the fault, and a
traceback names ``model/x.py`` and the seam's function, showing the spliced lines (they are
registered with ``linecache``). Leaving the context restores everything.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import functools
import inspect
import linecache
import shutil
import sys
import tempfile
import textwrap
import types
from pathlib import Path

from faultbench.faults.registry import FaultError, FaultSpec, get_fault
from faultbench.model.seams import resolve

ROOT = Path(__file__).resolve().parent.parent
# modules whose functions feed the in-process corpus caches (model.data.load_corpus, targets.hf.data.load_texts)
_CORPUS_MODULES = {"faultbench.model.corpus", "faultbench.model.tokenizer", "faultbench.model.data",
                   "faultbench.targets.hf.data"}
# functions of those modules that never run while the corpus is built: replacing them keeps the cache
_NOT_IN_CORPUS = {"collate", "wrap_tokenizer", "TextDataset.__getitem__"}


def _touches_corpus(plan: dict[str, dict[str, str]]) -> bool:
    return any(set(plan[m]) - _NOT_IN_CORPUS for m in _CORPUS_MODULES & plan.keys())


def _module_of(seam: str) -> str:
    return inspect.unwrap(resolve(seam)).__module__


def _qualname_of(seam: str) -> str:
    return inspect.unwrap(resolve(seam)).__qualname__


def find_def(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    """The ``def`` (or class) that ``qualname`` names in ``tree``: at each level the LAST definition of the name,
    the one Python binds when a module or class defines it twice (a splice into an earlier one would change
    dead code)."""
    node: ast.AST = tree
    for part in qualname.split("."):
        found = [c for c in node.body if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and c.name == part]
        if not found:
            raise FaultError(f"no definition of {qualname} in the module source")
        node = found[-1]
    return node


def _docstring_span(fn: ast.FunctionDef) -> tuple[int, int] | None:
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.lineno, first.end_lineno
    return None


def fault_function_source(seam: str, fn) -> str:
    """The fault's function as it stands in the spliced module: the seam's own header (decorators
    dropped, name and signature verbatim) and docstring (or none), then the fault's body."""
    seam_lines = Path(inspect.getsourcefile(inspect.unwrap(resolve(seam)))).read_text().splitlines()
    seam_def = find_def(ast.parse("\n".join(seam_lines)), _qualname_of(seam))
    seam_doc = _docstring_span(seam_def)
    seam_body_start = seam_doc[1] if seam_doc else seam_def.body[0].lineno - 1  # last header/doc line
    head = [line[seam_def.col_offset :] for line in seam_lines[seam_def.lineno - 1 : seam_body_start]]

    lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
    fault_def = ast.parse("\n".join(lines)).body[0]
    _, doc_end = _docstring_span(fault_def)  # registration guarantees a docstring
    body = lines[doc_end:]
    return textwrap.indent("\n".join(head + body), " " * seam_def.col_offset) + "\n"


def seam_function_source(seam: str) -> str:
    """The seam's own ``def`` (without decorators) as it stands in its module."""
    fn = inspect.unwrap(resolve(seam))
    lines = Path(inspect.getsourcefile(fn)).read_text().splitlines()
    node = find_def(ast.parse("\n".join(lines)), fn.__qualname__)
    return "\n".join(lines[node.lineno - 1 : node.end_lineno]) + "\n"


def splice_module(source: str, replacements: dict[str, str]) -> str:
    """``source`` with each qualname's ``def`` replaced by the given function text (decorators kept)."""
    lines = source.splitlines()
    tree = ast.parse(source)
    spans = sorted(((find_def(tree, q), text) for q, text in replacements.items()),
                   key=lambda item: item[0].lineno, reverse=True)
    for node, text in spans:  # bottom-up, so earlier line numbers stay valid
        lines[node.lineno - 1 : node.end_lineno] = text.rstrip("\n").splitlines()
    return "\n".join(lines) + "\n"


def display_path(path) -> str:
    """A source file as a user names it: relative to this repository (``model/gpt.py``), or to the folder
    holding its installed package (``transformers/trainer.py``)."""
    path = Path(path).resolve()
    if path.is_relative_to(ROOT) and "site-packages" not in path.parts:  # a venv may live in the repository
        return str(path.relative_to(ROOT))
    for parent in path.parents:  # the top-level package is the outermost folder with an __init__.py
        if not (parent / "__init__.py").exists():
            return str(path.relative_to(parent))
    return str(path)


def _by_module(specs: list[FaultSpec]) -> dict[str, dict[str, str]]:
    """{module name: {seam qualname: fault function text}}; two faults on one seam is an error."""
    out: dict[str, dict[str, str]] = {}
    owner: dict[str, str] = {}
    for spec in specs:
        for seam, fn in spec.replacements.items():
            if seam in owner:
                raise FaultError(f"faults {owner[seam]!r} and {spec.id!r} both replace {seam}")
            owner[seam] = spec.id
            out.setdefault(_module_of(seam), {})[_qualname_of(seam)] = fault_function_source(seam, fn)
    return out


def _spliced(fault_ids) -> dict[Path, str]:
    """{source file: spliced module text} for every module the faults touch."""
    return {(path := Path(sys.modules[module].__file__).resolve()): splice_module(path.read_text(), replacements)
            for module, replacements in _by_module([get_fault(f) for f in fault_ids]).items()}


def spliced_sources(fault_ids) -> dict[str, str]:
    """{path as a user names it (``display_path``): spliced module text} for every module the faults touch."""
    return {display_path(path): text for path, text in _spliced(fault_ids).items()}


def render_tree(dest, fault_ids) -> Path:
    """Copy ``model/`` into ``dest/model`` with the faults spliced into its source (from a checkout or an installed
    wheel alike: each file goes where it lies in the model package)."""
    dest, model = Path(dest), (ROOT / "model").resolve()
    shutil.copytree(model, dest / "model", ignore=shutil.ignore_patterns("__pycache__"))
    for path, text in _spliced(fault_ids).items():
        (dest / "model" / path.relative_to(model)).write_text(text)
    return dest


def diff(fault_id: str) -> str:
    """The unified diff, seam by seam, between the clean reference and the fault: the bug itself."""
    spec = get_fault(fault_id)
    chunks = []
    for seam, fn in spec.replacements.items():
        rel = display_path(inspect.getsourcefile(inspect.unwrap(resolve(seam))))
        chunks += difflib.unified_diff(
            seam_function_source(seam).splitlines(keepends=True),
            fault_function_source(seam, fn).splitlines(keepends=True),
            fromfile=f"a/{rel} ({seam})", tofile=f"b/{rel} ({seam})",
        )
    return "".join(chunks)


def _code_objects(code: types.CodeType) -> dict[tuple[str, tuple[str, ...]], types.CodeType]:
    """Every function's code by (qualname, parameter names): a property's getter and setter share a qualname."""
    found = {}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found[const.co_qualname, _parameters(const)] = const
            found.update(_code_objects(const))
    return found


def _parameters(code: types.CodeType) -> tuple[str, ...]:
    n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS) \
        + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return code.co_varnames[:n]


def _module_functions(module: types.ModuleType):
    """(qualname, function) of every function and method defined in ``module``, unwrapped."""
    for obj in list(vars(module).values()):
        candidates = []
        if isinstance(obj, types.FunctionType) or hasattr(obj, "__wrapped__"):
            candidates.append(obj)
        elif isinstance(obj, type) and obj.__module__ == module.__name__:
            for attr in vars(obj).values():
                if isinstance(attr, (staticmethod, classmethod)):
                    attr = attr.__func__
                elif isinstance(attr, property):
                    attr = attr.fget
                elif isinstance(attr, functools.cached_property):
                    attr = attr.func
                candidates.append(attr)
        for fn in candidates:
            fn = inspect.unwrap(fn) if callable(fn) else fn
            if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
                yield fn.__qualname__, fn


def _clear_corpus_caches() -> None:
    for name in _CORPUS_MODULES & sys.modules.keys():  # the HF target's module is imported only with it
        for obj in vars(sys.modules[name]).values():
            if hasattr(obj, "cache_clear"):
                obj.cache_clear()


@contextlib.contextmanager
def _private_tokenizer_cache():
    """A faulty tokenizer must never land in the shared disk cache: the tokenizer module's ``cache_dir``
    answers a private temporary folder meanwhile. Swapped in the module, not set in the environment
    (``TOKENIZER_CACHE_DIR``), which any code of the process can read: a changed cache folder would
    tell that the tokenizer is faulty."""
    module = sys.modules["faultbench.model.tokenizer"]
    saved, tmp = module.cache_dir, Path(tempfile.mkdtemp(prefix="faultbench-tok-"))
    module.cache_dir = lambda: tmp
    try:
        yield
    finally:
        module.cache_dir = saved
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def injected(*fault_ids: str):
    """Run the reference with ``fault_ids`` injected; everything is restored on exit."""
    specs = [get_fault(f) for f in fault_ids]
    plan = _by_module(specs)
    saved: list[tuple[types.FunctionType, types.CodeType]] = []
    lines_saved: dict[str, tuple | None] = {}
    private_cache = contextlib.ExitStack()
    try:
        for module_name, replacements in plan.items():
            module = sys.modules[module_name]
            path = module.__file__
            text = splice_module(Path(path).read_text(), replacements)
            codes = _code_objects(compile(text, path, "exec"))
            for qualname, fn in _module_functions(module):
                new_code = codes.get((qualname, _parameters(fn.__code__)))
                if new_code is None or len(new_code.co_freevars) != len(fn.__code__.co_freevars):
                    continue
                saved.append((fn, fn.__code__))
                fn.__code__ = new_code
            lines_saved[path] = linecache.cache.get(path)
            linecache.cache[path] = (len(text), None, text.splitlines(keepends=True), path)
        if "faultbench.model.tokenizer" in plan:
            private_cache.enter_context(_private_tokenizer_cache())
        if _touches_corpus(plan):
            _clear_corpus_caches()
        yield specs
    finally:
        for fn, code in reversed(saved):
            fn.__code__ = code
        for path, entry in lines_saved.items():
            if entry is None:
                linecache.cache.pop(path, None)
            else:
                linecache.cache[path] = entry
        private_cache.close()
        if _touches_corpus(plan):
            _clear_corpus_caches()
