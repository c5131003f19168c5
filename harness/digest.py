"""Digests of the sources a result depends on, and the bench cache's key for one case."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from faultbench.harness.record import Case

def source_digest(*folders: str) -> str:
    """sha256 over the Python sources of ``folders`` (relative to the repository root; a file counts as itself)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder in folders:
        top = root / folder
        for path in [top] if top.is_file() else sorted(top.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def case_hash(case: Case, code_digest: str) -> str:
    """Cache key: the case and the digest of every source file that can change its result."""
    blob = json.dumps({"case": case.to_dict(), "code": code_digest}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def code_digest(plugins=()) -> str:
    """The digest of every source a case's result depends on: the project's (every target's too) and its
    plugins' (a plugin's file, or its module's file, loaded already)."""
    import importlib.util

    # the watch (faultbench/) and its bench glue (harness/watched.py) shape every black-box finding
    digest = source_digest("model", "targets", "faults", "detectors", "faultbench", "harness/case.py",
                           "harness/record.py", "harness/suite.py", "harness/recorder.py", "harness/golden.py",
                           "harness/watched.py")
    for plugin in plugins:
        path = Path(plugin) if plugin.endswith(".py") else Path(importlib.util.find_spec(plugin).origin)
        digest = hashlib.sha256((digest + path.read_text()).encode()).hexdigest()
    return digest[:16]
