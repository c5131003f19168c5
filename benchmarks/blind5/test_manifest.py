"""Every fault of the fifth blind set is real: its manifest scenario, clean vs faulty on the same seeds, shows it.

Mirrors tests/faults/test_manifest.py for the plugin alone:
``pytest benchmarks/blind5/test_manifest.py -q -n 2``. Clean runs are shared by the session's workers.
"""

import hashlib
import os
import pickle
from pathlib import Path

import pytest

from faultbench.faults.registry import FAULTS, all_faults, load_plugin
from faultbench.harness.launch import RankPool
from faultbench.harness.manifest import prove

PLUGIN = str(Path(__file__).with_name("blind_faults.py"))
_before = set(all_faults(None))  # both targets' builtin faults first (the HF seams resolve then)
load_plugin(PLUGIN)
IDS = sorted((f for f in FAULTS if f not in _before), key=lambda f: (FAULTS[f].target, f))


class _Shared:
    """Clean outcomes as pickles in a folder the xdist workers share."""

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
def blind_clean_cache(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    return _Shared(shared / "blind5-clean-outcomes")


def test_set_shape():
    targets = [FAULTS[f].target for f in IDS]
    assert len(IDS) >= 16 and targets.count("ref") >= 7 and targets.count("hf") >= 7
    assert len({FAULTS[f].subsystem for f in IDS}) >= 8
    assert all(FAULTS[f].references for f in IDS)


@pytest.mark.parametrize("fault_id", [pytest.param(f, id=f"{FAULTS[f].target}/{f}") for f in IDS])
def test_fault_manifests(fault_id, blind_clean_cache):
    spec = FAULTS[fault_id]
    if spec.manifest.scenario.startswith("ddp"):
        with RankPool(2) as pool:
            ok, evidence = prove(fault_id, pool=pool, plugins=(PLUGIN,), clean_cache=blind_clean_cache)
    else:
        ok, evidence = prove(fault_id, plugins=(PLUGIN,), clean_cache=blind_clean_cache)
    assert ok, f"{spec.target}/{fault_id} did not manifest: {evidence}"
