"""The unseen plugin faults (examples/unseen_faults.py) are real: each shows next to the clean run."""

from pathlib import Path

import pytest

from faults.registry import FAULTS, all_faults, load_plugin
from harness.manifest import prove

PLUGIN = str(Path(__file__).resolve().parents[2] / "examples" / "unseen_faults.py")
all_faults()
_before = set(FAULTS)
load_plugin(PLUGIN)
UNSEEN = sorted(set(FAULTS) - _before) or sorted(f for f in FAULTS if f.startswith("unseen_"))


def test_the_plugin_registers_its_faults():
    assert len(UNSEEN) >= 6


@pytest.mark.parametrize("fault_id", UNSEEN)
def test_unseen_fault_manifests(fault_id):
    ok, evidence = prove(fault_id, plugins=(PLUGIN,))
    assert ok, evidence
