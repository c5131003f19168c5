"""Every registered fault is real: its scenario, clean vs faulty on the same seeds, shows the symptom.

Plugin faults too: ``pytest tests/faults/test_manifest.py --fault-plugin FILE -k FAULT_ID`` proves one."""

import pytest

from faults.registry import all_faults
from harness.manifest import prove

FAULT_IDS = sorted(all_faults())


@pytest.mark.parametrize("fault_id", FAULT_IDS)
def test_fault_manifests(fault_id, clean_cache, fault_plugins, request):
    spec = all_faults()[fault_id]
    pool = request.getfixturevalue("fault_pool") if spec.manifest.scenario.startswith("ddp") else None
    ok, evidence = prove(fault_id, pool=pool, plugins=fault_plugins, clean_cache=clean_cache)
    assert ok, f"{fault_id} did not manifest: {evidence}"
