"""Every fault of the fourth blind set is real: its manifest scenario, clean vs faulty on the same seeds, shows it.

Outside ``tests/`` so that ``make test`` never collects (and prints) its fault ids; run it on its own:

    .venv/bin/python -m pytest benchmarks/blind4/test_manifest.py -q -n 2

It mirrors ``tests/faults/test_manifest.py``: the plugin's faults are proved with ``harness.manifest.prove``, clean
runs are shared by the session's workers per (target, scenario, variant, steps, seed), and the data-parallel
scenarios of the reference run on a pool of 2 ranks.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from faultbench.faults.registry import FAULTS, load_plugin  # noqa: E402
from faultbench.harness.manifest import prove  # noqa: E402

PLUGIN = str(Path(__file__).with_name("blind_faults.py"))
load_plugin(PLUGIN)
IDS = sorted((f for f in FAULTS if f.startswith("blind4_")), key=lambda f: (FAULTS[f].target, f))


class SharedOutcomes:
    """Clean outcomes kept as pickles in a folder the session's xdist workers share (computed once per key)."""

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
def blind_clean_cache(tmp_path_factory) -> SharedOutcomes:
    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    return SharedOutcomes(shared / "blind4-clean-outcomes")


@pytest.fixture(scope="session")
def blind_pool():
    from faultbench.harness.launch import RankPool

    with RankPool(2) as pool:
        yield pool


def test_set_shape():
    """At least 18 faults, 7 per target, over at least 9 subsystems, each citing its threads."""
    targets = [FAULTS[f].target for f in IDS]
    assert len(IDS) >= 18
    assert targets.count("ref") >= 7 and targets.count("hf") >= 7
    assert len({FAULTS[f].subsystem for f in IDS}) >= 9
    assert all(FAULTS[f].references for f in IDS)


@pytest.mark.parametrize("fault_id", [pytest.param(f, id=f"{FAULTS[f].target}/{f}") for f in IDS])
def test_blind_fault_manifests(fault_id, blind_clean_cache, request):
    spec = FAULTS[fault_id]
    pool = request.getfixturevalue("blind_pool") if spec.manifest.scenario.startswith("ddp") else None
    ok, evidence = prove(fault_id, pool=pool, plugins=(PLUGIN,), clean_cache=blind_clean_cache)
    assert ok, f"{spec.target}/{fault_id} did not manifest: {evidence}"
