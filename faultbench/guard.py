"""``faultbench.guard``: a crash of a training program located even when no watch was on yet.

    import faultbench
    with faultbench.guard():
        corpus, model, optimizer = build()          # a crash here: no watch has seen the run
        with faultbench.watch(model, optimizer):    # a crash here: the watch locates it, the guard stays quiet
            ...

A program crashes as often while it builds its data, model and optimizer as while it trains. The traceback says
where it raised; the guard adds what a user needs to act on it: the place in code (``module.qualname``, file and
line: the innermost frame that is neither Python's, torch's nor numpy's), whether that place is the user's code or
a library's (with its version), and what the program had built when it crashed (the subsystem it was in). It
watches one thing while on: how many parameters modules have registered (torch's global registration hook), so a
crash before any model is told from one after it. Nothing is monkeypatched; the hook is removed on exit, and the
user's exception always propagates unchanged.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import sys
import traceback
import types

import torch

# top-level packages whose frames are the machinery a crash passes through, never the place to act on
_MACHINERY = frozenset({"torch", "numpy", "runpy", "importlib", "_pytest", "pytest", "pluggy"})
_OWN = ("faultbench.guard", "faultbench.watch", "faultbench.hf", "faultbench.detectors")

_active: list[Guard] = []


def code_place(frame, line: int) -> dict:
    """Where ``frame`` runs, in a user's terms: {"qualname": "pkg.module.Class.method", "file", "line",
    "library": "transformers 5.0.0" for an installed package's code (None for the user's own), "method_of_module":
    the function is a method of a torch module (its ``self`` is an ``nn.Module``)}."""
    place = _place(frame.f_code, frame.f_globals.get("__name__", "?"), line)
    return {**place, "method_of_module": isinstance(frame.f_locals.get("self"), torch.nn.Module)}


def object_place(obj) -> dict | None:
    """Where ``obj`` is defined, as ``code_place`` says it (its first line): a function (a partial's, a bound
    method's), a torch module's class ``forward``; None for what has no Python code (a builtin)."""
    if isinstance(obj, functools.partial):
        obj = obj.func
    module = isinstance(obj, torch.nn.Module)
    if module:
        obj = type(obj).forward
    elif callable(obj) and not inspect.isroutine(obj) and not isinstance(obj, type):  # a callable object: its __call__
        obj = type(obj).__call__
    fn = inspect.unwrap(getattr(obj, "__func__", obj))
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return None
    return {**_place(code, getattr(fn, "__module__", None) or "?", code.co_firstlineno), "method_of_module": module}


def _place(code: types.CodeType, module: str, line: int) -> dict:
    path = code.co_filename.replace("\\", "/")
    library = None
    if "/site-packages/" in path or "/dist-packages/" in path:
        top = module.split(".")[0]
        try:
            library = f"{top} {importlib.metadata.version(top)}"
        except importlib.metadata.PackageNotFoundError:
            library = top
    return {"qualname": f"{module}.{code.co_qualname}", "file": path, "line": line, "library": library}


def _is_machinery(frame) -> bool:
    module = frame.f_globals.get("__name__", "")
    top = module.split(".")[0]
    return top in _MACHINERY or top in sys.stdlib_module_names or module.startswith(_OWN)


def crash_of(exc: BaseException) -> dict:
    """A crash as data: {type, message, frames: [(file, line, function)] innermost last, qualnames: each frame's
    ``module.qualname``, code: the place to act on (``code_place`` of the innermost frame that is not machinery;
    None if every frame is)}."""
    walked = list(traceback.walk_tb(exc.__traceback__))
    code = next((code_place(f, line) for f, line in reversed(walked) if not _is_machinery(f)), None)
    return {"type": type(exc).__name__, "message": str(exc),
            "frames": [(f.f_code.co_filename, line, f.f_code.co_name) for f, line in walked],
            "qualnames": [frame_qualname(f) for f, _ in walked], "code": code}


def caller_place(skip: int = 1) -> dict | None:
    """``code_place`` of the innermost frame above this call (``skip`` frames up: the caller's caller with 1) that is
    neither machinery nor a wrapper of a model's forward (accelerate's autocast): the code that called the model, in
    a forward hook. None when every frame is machinery."""
    frame = sys._getframe(skip + 1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not _is_machinery(frame) and not module.startswith(_FORWARD_WRAPPERS):
            return code_place(frame, frame.f_lineno)
        frame = frame.f_back
    return None


_FORWARD_WRAPPERS = ("accelerate.utils.operations",)  # model.forward replaced by an autocast + fp32-output wrapper


def frame_qualname(frame) -> str:
    """``module.qualname`` of the function ``frame`` runs (``model.gpt.Block.forward``)."""
    return f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_qualname}"


def watched_crash(exc: BaseException) -> None:
    """A watch located ``exc`` (its ``on_crash`` ran): the guards around it leave it alone."""
    for guard in _active:
        guard.handled.add(id(exc))


class Guard:
    """See the module docstring. ``report``: print the findings to stderr when a crash is located. ``findings``:
    what it located (``Finding`` objects of the detector ``bb_crash_site``)."""

    def __init__(self, report: bool = True):
        self.print_report = report
        self.findings: list = []
        self.parameters = 0  # parameters registered by any module since the guard was entered
        self.handled: set[int] = set()
        self._handle = None

    def __enter__(self) -> Guard:
        if self._handle is not None:
            raise RuntimeError("faultbench.guard: this guard is already on (one `with` at a time)")
        self._handle = torch.nn.modules.module.register_module_parameter_registration_hook(self._registered)
        _active.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        if isinstance(exc, Exception):
            self.crashed(exc)
        return False  # the user's exception propagates unchanged

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            _active.remove(self)

    def crashed(self, exc: Exception) -> None:
        """Locate ``exc`` unless a watch did."""
        if id(exc) in self.handled:
            return
        from faultbench.detectors.blackbox.crashes import unwatched_crash

        self.findings.append(unwatched_crash({**crash_of(exc), "parameters": self.parameters}))
        if self.print_report:
            finding = self.findings[-1]
            print(f"faultbench.guard: [{finding.subsystem}] {finding.message}", file=sys.stderr)

    def _registered(self, module, name, param):
        self.parameters += 1


def guard(report: bool = True) -> Guard:
    """``with faultbench.guard(): main()``: see ``Guard``."""
    return Guard(report=report)


def callable_module(name: str, function) -> None:
    """Module ``name`` (``faultbench.watch``, ``faultbench.guard``) called calls ``function``: the package's
    attribute of that name is the module once the module is imported as a submodule."""
    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return function(*args, **kwargs)

    sys.modules[name].__class__ = _CallableModule


callable_module(__name__, guard)
