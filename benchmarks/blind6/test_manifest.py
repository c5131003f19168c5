"""Every fault of the blind6 plugin manifests: its scenario, clean vs faulty on the same seeds, shows the symptom.

Run from the repository root (the plugin is loaded here, so ``--fault-plugin`` is optional):
``.venv/bin/python -m pytest benchmarks/blind6/test_manifest.py -q -p no:cacheprovider``
"""

from pathlib import Path

import pytest

from faultbench.faults.registry import all_faults, load_plugin
from faultbench.harness.manifest import prove

PLUGIN = str(Path(__file__).with_name("blind_faults.py"))
_before = set(all_faults(None))
load_plugin(PLUGIN)
FAULTS = {k: v for k, v in all_faults(None).items() if k not in _before or k.startswith("b6_")}
_CLEAN: dict = {}


@pytest.fixture(scope="module")
def rank_pool():
    from faultbench.harness.launch import RankPool

    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.mark.parametrize("fault_id", sorted(FAULTS, key=lambda f: (FAULTS[f].target, f)))
def test_blind_fault_manifests(fault_id, request):
    spec = FAULTS[fault_id]
    pool = request.getfixturevalue("rank_pool") if spec.manifest.scenario.startswith("ddp") else None
    ok, evidence = prove(fault_id, pool=pool, plugins=(PLUGIN,), clean_cache=_CLEAN)
    assert ok, f"{spec.target}/{fault_id} did not manifest: {evidence}"
