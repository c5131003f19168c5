"""faultbench's public API: watch any causal-LM training loop with the black-box detectors.

    import faultbench
    with faultbench.watch(model, optimizer, scheduler=scheduler, scaler=scaler) as w:
        ...  # the training loop, unchanged
    w.findings  # Finding objects; w.to_json(); the readable report is printed at exit

    with faultbench.guard():  # around the whole program: a crash before the watch is located too
        main()

Names load lazily: importing faultbench costs nothing until one is used.
"""

from __future__ import annotations

import importlib
import importlib.metadata

try:
    __version__ = importlib.metadata.version("faultbench")
except importlib.metadata.PackageNotFoundError:  # a checkout on the path, not installed
    __version__ = "0+unknown"

_EXPORTS = {"watch": "faultbench.watch", "Watch": "faultbench.watch", "record_golden": "faultbench.watch",
            "load_golden": "faultbench.watch", "Finding": "faultbench.detectors.api", "guard": "faultbench.guard"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'faultbench' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the function, not the submodule of the same name the import set
    return value
