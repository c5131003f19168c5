"""The answer key and its event log, sealed: an edit made outside faultbench is seen, not believed.

Each key holds its exercise (fault, seed, folder, time made) and its events (start, hint, answer, check, reveal).
Whenever faultbench writes a key it seals the whole of it (HMAC-SHA256 with a secret of the keys folder,
``.secret``, readable by its owner only), so an edited, added, removed or reordered event, or a changed time, breaks
the seal: a candidate who edits a key file to fake a quick solve is reported, and a candidate's code never gets the
chance (``practice check`` runs it in ``harness.sandbox`` with every keys folder hidden). Anyone who can read the
keys folder can also re-seal: the seal guards against edits, not against the interviewer's own account.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

SECRET = ".secret"


def folder_secret(folder: Path) -> bytes:
    """The keys folder's sealing secret, made on first use (created whole or not at all, mode 0600)."""
    path = Path(folder) / SECRET
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f"{SECRET}.{secrets.token_hex(4)}")
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(staged, path)  # atomic and exclusive: a concurrent first use keeps the one that landed
        except FileExistsError:
            pass
        finally:
            staged.unlink()
    return path.read_bytes()


def _seal(key: dict, secret: bytes) -> str:
    body = json.dumps({k: v for k, v in key.items() if k != "seal"}, sort_keys=True)
    return hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()


def sealed(key: dict, secret: bytes) -> dict:
    """``key`` with its seal (as written)."""
    return {**key, "seal": _seal(key, secret)}


def intact(key: dict, secret: bytes) -> bool:
    """Whether ``key`` is exactly as faultbench last wrote it."""
    return hmac.compare_digest(str(key.get("seal", "")), _seal(key, secret))
