"""Where faultbench keeps what it computes (case records, golden runs, practice references and keys, mutants).

In a clone (an editable install: the checkout's ``pyproject.toml`` beside the package) the checkout's ``.cache/``,
so caches stay with the code they were computed from; installed from a wheel, the user's cache folder
(``$XDG_CACHE_HOME/faultbench``, else ``~/.cache/faultbench``), never the installed package; ``$FAULTBENCH_CACHE``
overrides both.
"""

from __future__ import annotations

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def in_checkout() -> bool:
    """Whether faultbench runs from a clone (its pyproject.toml beside the package), not an installed wheel."""
    return (CHECKOUT / "pyproject.toml").is_file()


def cache_dir() -> Path:
    """The cache root (see the module's docstring)."""
    if os.environ.get("FAULTBENCH_CACHE"):
        return Path(os.environ["FAULTBENCH_CACHE"])
    if in_checkout():
        return CHECKOUT / ".cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "faultbench"
