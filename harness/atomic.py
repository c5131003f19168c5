"""Atomic file writes: a reader never sees half a file, a crash never leaves one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text(path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(text)
    os.replace(f.name, path)
    return path
