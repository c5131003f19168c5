"""Machine-made faults: mutation operators over the seams of every target (``faultbench mutate``).

``operators`` holds the operators (each a class of real bug), ``generate`` the candidates and their
registration as faults, ``harness.mutants`` the admission (reach, show, distinct) that writes the versioned
admitted set, and two plugin modules register them: ``candidates`` (every candidate, for admission's rank
workers) and ``admitted`` (the admitted set, for ``bench --mutants``).
"""

from __future__ import annotations

from pathlib import Path

VERSION = "mutants-v1"


def admitted_path() -> Path:
    """The committed admitted set of this version."""
    return Path(__file__).resolve().parent / f"{VERSION}.json"
