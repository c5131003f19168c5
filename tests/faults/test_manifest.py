"""Every registered fault of every target is real: its scenario, clean vs faulty on the same seeds, shows the symptom.

Parametrized over (target, fault id), e.g. ``ref/label_permute`` and ``hf/hf_label_shift_off_by_one``. A
worker's clean runs are shared per (target, scenario, variant, steps, seed) (``clean_cache``). The HF proofs run
in the xdist group of tests/hf: one worker pays for the transformers import and the 2-rank pool once.
Plugin faults too: ``pytest tests/faults/test_manifest.py --fault-plugin FILE -k FAULT_ID`` proves one."""

import pytest

from faults.registry import all_faults
from harness.manifest import prove

FAULTS = all_faults(None)


def _param(fault_id: str):
    target = FAULTS[fault_id].target
    marks = () if target == "ref" else (pytest.mark.xdist_group(target),)  # with tests/<target>/: one import
    return pytest.param(fault_id, id=f"{target}/{fault_id}", marks=marks)


@pytest.mark.parametrize("fault_id", [_param(f) for f in sorted(FAULTS, key=lambda f: (FAULTS[f].target, f))])
def test_fault_manifests(fault_id, clean_cache, fault_plugins, request):
    spec = FAULTS[fault_id]
    pool = request.getfixturevalue("fault_pool") if spec.manifest.scenario.startswith("ddp") else None
    ok, evidence = prove(fault_id, pool=pool, plugins=fault_plugins, clean_cache=clean_cache)
    assert ok, f"{spec.target}/{fault_id} did not manifest: {evidence}"
