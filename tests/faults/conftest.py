import hashlib
import os
import pickle
from pathlib import Path

import pytest


class SharedOutcomes:
    """A mapping of clean outcomes kept as pickles in a folder the session's xdist workers share: a clean run
    that several faults' proofs compare against is computed once per session, not once per worker (two workers
    racing on a key both compute it; the file is replaced whole)."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def _path(self, key) -> Path:
        return self.folder / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:24]}.pkl"

    def __contains__(self, key) -> bool:
        return self._path(key).exists()

    def __getitem__(self, key):
        return pickle.loads(self._path(key).read_bytes())

    def __setitem__(self, key, outcome) -> None:
        path = self._path(key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(outcome))
        tmp.replace(path)


@pytest.fixture(scope="session")
def clean_cache(tmp_path_factory) -> SharedOutcomes:
    """Clean outcomes per (target, scenario, variant, steps, seed), shared by the faults of the session."""
    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the workers' common folder
    return SharedOutcomes(shared / "clean-outcomes")
