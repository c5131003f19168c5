"""Atomic file writes: a reader never sees half a file, a crash never leaves one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_bytes(path, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("wb", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(data)
    os.chmod(f.name, 0o666 & ~_umask())  # a temporary file is private (0600); the result is an ordinary file
    os.replace(f.name, path)
    return path


def write_text(path, text: str) -> Path:
    return write_bytes(path, text.encode())


def check_replaceable(path, marker: str, what: str) -> None:
    """Refuse (ValueError) to replace ``path`` unless it is absent, an empty folder, or a previous ``what``
    (a folder holding ``marker``): a mistyped output path must never delete a user's file or folder."""
    path = Path(path)
    if path.exists() and not (path.is_dir() and ((path / marker).exists() or not any(path.iterdir()))):
        raise ValueError(f"{path} exists and is not a {what} (no {marker}): refusing to replace it; give a new "
                         "folder")
