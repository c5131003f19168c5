"""What a detector can reach from an object without the introspection the honesty rules ban."""

from __future__ import annotations

import types

import torch

from faultbench.detectors.api import RunContext


def reachable_strings(*roots) -> set[str]:
    """Every string a detector can reach from ``roots`` without the banned introspection: through
    attributes, dicts, sequences, bound methods' objects, classes and their bases, and callables' names
    and docstrings (the context's seams included). Modules are not entered: the static check bans the
    ways to one, and reaching a module is reaching every module."""
    found, seen, todo = set(), {}, list(roots)  # seen keeps what it saw alive: a freed object's id is reused
    while todo:
        obj = todo.pop()
        if isinstance(obj, str):
            found.add(obj)
            continue
        if obj is None or isinstance(obj, (bool, int, float, complex, bytes, types.ModuleType)) or id(obj) in seen:
            continue
        seen[id(obj)] = obj
        if isinstance(obj, (dict, types.MappingProxyType)):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif isinstance(obj, torch.Tensor):
            todo += [obj.dtype, obj.device]
        if callable(obj) or isinstance(obj, type):
            todo += [getattr(obj, a, None) for a in ("__name__", "__qualname__", "__doc__", "__module__")]
        if isinstance(obj, types.FunctionType):
            todo += [obj.__defaults__, obj.__kwdefaults__]
        if isinstance(obj, types.MethodType):
            todo += [obj.__self__, obj.__func__]
        todo += list(obj.__bases__) if isinstance(obj, type) else [type(obj)]
        try:
            todo.append(dict(vars(obj)))
        except TypeError:  # no __dict__ (slots, builtins)
            todo += [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())]
        if isinstance(obj, RunContext):  # what the context hands out on request
            todo += [obj.seam(name) for name in obj.seams]
    return found
