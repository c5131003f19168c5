"""Every registered fault is real: its scenario, clean vs faulty on the same seeds, shows the symptom."""

import pytest

from faults.registry import all_faults
from harness.manifest import prove

FAULT_IDS = sorted(all_faults())


@pytest.mark.parametrize("fault_id", FAULT_IDS)
def test_fault_manifests(fault_id, clean_cache, request):
    spec = all_faults()[fault_id]
    pool = request.getfixturevalue("fault_pool") if spec.manifest.scenario.startswith("ddp") else None
    ok, evidence = prove(fault_id, pool=pool, clean_cache=clean_cache)
    assert ok, f"{fault_id} did not manifest: {evidence}"
