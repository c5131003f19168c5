"""Atomic file writes: a reader never sees half a file, a crash never leaves one."""

from __future__ import annotations

import json
import os
import sys
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


NAME_MAX = 255  # bytes in one path component (Linux, macOS)


def check_output(path, flag: str, *, force: bool = False, folder_of: str | None = None) -> Path:
    """One policy for every command's output path, checked before any work (ValueError, one line): never ``''``,
    no component longer than ``NAME_MAX``, no file where a folder is meant or the reverse, nothing under an
    unwritable folder. A file: its folder exists, and an existing file is replaced only with ``force``. A folder
    (``folder_of``: a glob for what a previous output holds, e.g. summary.json, */bundle.json): missing parents are
    made; an existing folder holding other files and nothing ``folder_of`` matches is written into only with
    ``force``."""
    if path is None or not str(path).strip():
        raise ValueError(f"{flag} '' names no {'folder' if folder_of else 'file'}")
    path = Path(path)
    long = next((part for part in path.parts if len(part.encode()) > NAME_MAX), None)
    if long is not None:
        raise ValueError(f"{flag} {str(path)[:60]}...: a name longer than {NAME_MAX} bytes ({long[:20]}...)")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing != path and not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, not a folder")
    if not os.access(existing if existing.is_dir() else existing.parent, os.W_OK):
        raise ValueError(f"{flag} {path}: {existing} is not writable")
    if folder_of is None:
        if path.is_dir():
            raise ValueError(f"{flag} {path} is a folder, not a file")
        if not path.parent.is_dir():
            raise ValueError(f"{flag} {path}: its folder {path.parent} does not exist")
        if path.exists() and not force:
            raise ValueError(f"{flag} {path} exists: pass --force to replace it, or name another file")
        return path
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder")
    if path.is_dir() and any(path.iterdir()) and not any(path.glob(folder_of)) and not force:
        raise ValueError(f"{flag} {path} holds files of something else (no {folder_of}): pass --force to write "
                         "into it, or name another folder")
    return path


def read_cached_json(path, what: str, problem=lambda value: None):
    """The JSON value cached at ``path``, or None: absent, or bad (unreadable, not JSON, or ``problem(value)``
    names what is wrong with it), in which case it is reported by path on stderr and deleted, so the caller
    computes it again and never uses it."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())
        wrong = problem(value)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        wrong = f"{type(e).__name__}: {e}"
    if wrong is None:
        return value
    print(f"faultbench: discarding the bad {what} {path} ({wrong}); computing it again", file=sys.stderr)
    path.unlink(missing_ok=True)
    return None
